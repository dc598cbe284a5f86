"""Padding-free forwards: the real tokens of a padded batch packed into few fixed-shape rows.

A padded batch [B, L] (a left-padded prompt + a right-padded response per row) pays every forward and
backward for its padding. Packing moves each row's real tokens, in order, into packed rows of
T = L slots, several sequences per packed row: `segment_ids` name each slot's sequence (0 on
padding), `positions` restart at 0 for each sequence, and attention stays within a sequence
(`models/attention.attention_mask`, on every kernel). The packed rows are laid out as K
microbatches of M rows, [K, M, T]; a microbatch is computed only when it holds a token, so the
work follows the real token count, not B x L.

Everything is static-shaped and jitted: K * M >= B packed rows of L slots are enough for the worst
case (each sequence alone in its row), so packing never overflows and never truncates. Which rows
go where is first-fit decreasing (longest sequence first, each into the first packed row it fits),
in a `lax.scan` over the B rows inside the step itself (no host round trip, no recompile when the
lengths change); the filled packed rows are a prefix, so the microbatches with tokens are too.

Shapes: B padded rows, L = Lq + Lr padded length, K microbatches, M packed rows per microbatch,
T = L slots per packed row, V vocabulary. A "slot" is a flat index into the K * M * T packed slots;
`Packing.end` (one past the last) marks a padding token, dropped when packing and read as 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax.models.forward import HiddenStates, forward_hidden, variables
from ppo_jax.models.transformer import CausalLM, ScalarModel
from ppo_jax.ppo.stats import last_token_index
from ppo_jax.traced import trace_once

Array = jax.Array


@flax.struct.dataclass
class Packing:
    """Where each real token of a padded batch lies in the packed [K, M, T] slots."""

    slots: Array  # [B, L] int32: flat packed slot of each real token; `end` on padding
    lengths: Array  # [B] int32: real tokens per padded row
    rows_used: Array  # [] int32: packed rows holding a token (always a prefix of the K * M)
    shape: tuple[int, int, int] = flax.struct.field(pytree_node=False)  # (K, M, T)

    @property
    def end(self) -> int:
        """One past the last packed slot: the slot of a padding token."""
        k, m, t = self.shape
        return k * m * t

    @property
    def microbatches_used(self) -> Array:
        """[] int32: microbatches holding a token (the first ones): the only ones computed."""
        rows_per_microbatch = self.shape[1]
        return (self.rows_used + rows_per_microbatch - 1) // rows_per_microbatch

    @property
    def token_efficiency(self) -> Array:
        """[] float32: real tokens / the slots of the computed microbatches."""
        _, m, t = self.shape
        computed = jnp.maximum(self.microbatches_used * m * t, 1)
        return self.lengths.sum().astype(jnp.float32) / computed


def padded_token_efficiency(*masks: Array) -> Array:
    """[] float32: real tokens / slots of padded rows, given the masks of their parts (the prompt's
    [B, Lq] and the response's [B, Lr]): what the padded forwards compute, to compare with
    `Packing.token_efficiency`."""
    return sum(m.sum() for m in masks).astype(jnp.float32) / sum(m.size for m in masks)


@flax.struct.dataclass
class PackedRows:
    """Model inputs of packed rows, each [..., M, T] (int32)."""

    tokens: Array
    positions: Array  # restart at 0 for each sequence
    segment_ids: Array  # 1 + the padded row a slot's token came from; 0 on padding
    experts: Array | None = None  # [..., M, T, Lm, k]: routing replay (moe.router_replay), -1 on padding; else None


def plan(seq_mask: Array, shape: tuple[int, int, int]) -> Packing:
    """First-fit-decreasing placement of the rows of `seq_mask` [B, L] into [K, M, T] packed slots.

    Needs K * M >= B and T >= L, so that every row fits even when each sits alone (checked here,
    while tracing; `rl/settings.py` derives such shapes from the config and refuses any other).
    A row's real tokens keep their order and need not be contiguous in the padded row.
    """
    num_microbatches, rows_per_microbatch, row_length = shape
    batch, length = seq_mask.shape
    num_rows = num_microbatches * rows_per_microbatch
    if num_rows < batch or row_length < length:
        raise ValueError(f"packing {batch} rows of {length} slots into {num_rows} rows of {row_length} slots "
                         "could overflow: need at least as many packed rows and slots per row")
    real = seq_mask.astype(bool)
    lengths = real.sum(-1).astype(jnp.int32)
    order = jnp.argsort(-lengths, stable=True)

    def place(used, n):  # used [num_rows]: slots taken in each packed row
        row = jnp.argmax(used + n <= row_length)  # the first row it fits (one always does)
        return used.at[row].add(n), (row, used[row])

    used, (rows, offsets) = jax.lax.scan(place, jnp.zeros(num_rows, jnp.int32), lengths[order])
    row_of = jnp.zeros(batch, jnp.int32).at[order].set(rows.astype(jnp.int32))
    offset_of = jnp.zeros(batch, jnp.int32).at[order].set(offsets)
    rank = jnp.cumsum(real, axis=-1, dtype=jnp.int32) - 1  # the token's position in its sequence
    end = num_rows * row_length
    slots = jnp.where(real, row_of[:, None] * row_length + offset_of[:, None] + rank, end)
    return Packing(slots=slots, lengths=lengths, rows_used=(used > 0).sum().astype(jnp.int32), shape=shape)


def scatter(values: Array, slots: Array, packing: Packing, fill=0) -> Array:
    """Padded values [B, N, ...] (tokens, or per-token quantities) at `slots` [B, N] -> packed
    [K, M, T, ...]; `fill` where nothing lands."""
    extra = values.shape[slots.ndim:]
    flat = jnp.full((packing.end,) + extra, fill, values.dtype)
    return flat.at[slots.reshape(-1)].set(values.reshape((-1,) + extra), mode="drop").reshape(packing.shape + extra)


def gather(packed: Array, slots: Array) -> Array:
    """Packed values [K, M, T, ...] read at `slots` [B, N] -> [B, N, ...]; 0 at `end` (padding)."""
    return packed.reshape((-1,) + packed.shape[3:]).at[slots].get(mode="fill", fill_value=0)


def pack_rows(seq_tokens: Array, packing: Packing, experts: Array | None = None) -> PackedRows:
    """The packed model inputs of a padded batch seq_tokens [B, L] placed by `packing`; experts
    [B, L, Lm, k]: its recorded routing (routing replay), None: none."""
    batch, length = seq_tokens.shape
    rank = jnp.cumsum(packing.slots < packing.end, axis=-1, dtype=jnp.int32) - 1  # position in its sequence
    row_ids = jnp.broadcast_to(jnp.arange(1, batch + 1, dtype=jnp.int32)[:, None], (batch, length))
    return PackedRows(tokens=scatter(seq_tokens.astype(jnp.int32), packing.slots, packing),
                      positions=scatter(rank, packing.slots, packing),
                      segment_ids=scatter(row_ids, packing.slots, packing),
                      experts=None if experts is None else scatter(experts, packing.slots, packing, fill=-1))


def prediction_slots(packing: Packing, prompt_length: int, response_mask: Array) -> Array:
    """[B, Lr]: the packed slot whose output predicts each real response token (the slot before it:
    every prompt has a token), `end` on padding. Per-token log-probs, values and losses of the
    response live at these slots."""
    slots = packing.slots[:, prompt_length:] - 1
    return jnp.where(response_mask.astype(bool), slots, packing.end)


def last_slots(packing: Packing, seq_mask: Array) -> Array:
    """[B, 1]: the packed slot of each row's last real token (where a reward model scores it)."""
    return jnp.take_along_axis(packing.slots, jnp.maximum(last_token_index(seq_mask), 0)[:, None], axis=1)


def next_token_outputs(model: CausalLM, params, rows: PackedRows, temperature: float, adapters=None,
                       router: bool = False) -> HiddenStates:
    """`next_token_logits` as a HiddenStates: `hidden` the logits [M, T, V]; with `rows.experts` (routing
    replay) `flips` [M, T] at slot t says whether the token at slot t + 1 flipped (the slot that
    predicts it, where every per-token quantity of packed rows lives)."""
    out = forward_hidden(model, variables(params, adapters), rows.tokens, rows.positions, rows.segment_ids != 0,
                         rows.segment_ids, router=router, experts=rows.experts)
    logits = model.apply(variables(params, adapters), out.hidden, method=CausalLM.project) / temperature
    flips = None if out.flips is None else jnp.concatenate([out.flips[:, 1:], jnp.zeros_like(out.flips[:, :1])], 1)
    return out.replace(hidden=logits, flips=flips)


def next_token_logits(model: CausalLM, params, rows: PackedRows, temperature: float, adapters=None,
                      router: bool = False):
    """Tempered logits of packed rows [M, T] -> [M, T, V] float32: slot t predicts slot t + 1; with
    `router` (an MoE policy) also the forward's RouterLosses: (logits, RouterLosses). Routing replay
    when `rows.experts` is given."""
    out = next_token_outputs(model, params, rows, temperature, adapters, router)
    return (out.hidden, out.router) if router else out.hidden


def next_token_logprobs(logits: Array, tokens: Array) -> Array:
    """log p(the token at slot t + 1) from the logits at slot t: [M, T, V], [M, T] -> [M, T]. The
    last slot (no successor) reads token 0; only prediction slots are ever read."""
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def scalar_outputs(model: ScalarModel, params, rows: PackedRows, adapters=None) -> Array:
    """Scalar-head outputs (values, reward scores) of packed rows [M, T] -> [M, T] float32."""
    out, _ = model.apply(variables(params, adapters), rows.tokens, rows.positions, rows.segment_ids != 0,
                         None, rows.segment_ids)
    return out


def map_used(fn: Callable[..., Any], microbatches_used: Array, *packed: Any) -> Any:
    """fn over the K microbatches of the [K, M, ...] leaves of `packed`, stacked to [K, ...], computing
    only the first `microbatches_used` (the others stay zeros): the work follows the real tokens.

    A `fori_loop` with a traced trip count (a while loop) writing each result in place, not a
    `lax.map` of `lax.cond`s: a conditional's branches write separate buffers, and XLA:GPU then
    copied and transposed the weights each step (ppo-jax-plan, TinyLlama shape on an H100).
    """
    fn = trace_once(fn, *jax.tree.map(lambda x: x[0], packed))  # one trace for the shapes and the body
    num_microbatches = jax.tree.leaves(packed)[0].shape[0]

    def step(k, out):
        chunk = microbatch(packed, k)
        return jax.tree.map(lambda o, r: jax.lax.dynamic_update_index_in_dim(o, r, k, 0), out, fn(*chunk))

    return jax.lax.fori_loop(0, microbatches_used, step, fn.zeros((num_microbatches,)))


def microbatch(packed: Any, index: Array) -> Any:
    """Microbatch `index` ([] int32) of the [K, ...] leaves of `packed`."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False), packed)
