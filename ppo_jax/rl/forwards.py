"""The experience forwards as pure functions: every model's outputs over a rollout's responses.

    padded_forwards(modules, params, frozen, rows, hp)   on padded rows [B, Lq + Lr]
    packed_forwards(modules, params, frozen, packed, hp) on one packed microbatch [M, T]
    score_responses(modules, frozen, rows, hp)           the frozen models only (reference, reward model)

`microbatched` and `run_packed` run them over a whole rollout (row slices, or the packed
microbatches that hold tokens, read back into the padded layout). With `hp.scored_outside`
(roles.scoring="sampler") the sampler's mesh scored the responses already: the reference and reward
forwards do not run here and their outputs are 0.

Shapes: B rollout rows, Lq prompt length, Lr response length, V vocabulary; packed: M rows of T slots.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax import ppo
from ppo_jax.models import packing
from ppo_jax.models.forward import (response_logits, response_outputs, response_scores, response_values,
                                    sequence_inputs, token_logprobs)
from ppo_jax.rl.hyper import PPOHyper
from ppo_jax.rl.state import FrozenParams, Modules, Trainable, policy_variables, reference_variables, value_variables

Array = jax.Array


@flax.struct.dataclass
class ResponseRows:
    """Prompts and their sampled responses, left-padded prompts then right-padded responses."""

    prompt_tokens: Array  # [B, Lq]
    prompt_mask: Array  # [B, Lq]
    tokens: Array  # [B, Lr]
    mask: Array  # [B, Lr], 1 up to and including the first stop token
    experts: Array | None = None  # [B, Lq + Lr, Lm, k]: the policy forward's routing replay (moe.router_replay)


@flax.struct.dataclass
class ForwardOutputs:
    """Every model's outputs over the responses: per token [B, Lr] (packed: per slot [M, T], slot t
    predicting token t + 1) and per row [B] (packed: per slot, read at the row's last slot)."""

    logprobs: Array  # the policy's (the weights about to be updated), temperature applied
    ref_logprobs: Array  # the reference's; 0 when the sampler scored
    entropy: Array  # the policy's
    values: Array  # the value model's; 0 without a critic
    scores: Array  # the reward model's raw scores (before gain and bias); 0 without one or when the sampler scored
    routing_flips: Array | None = None  # routing replay: 1 where the token's own top k differs from the recorded one
    teacher_logprobs: Array | None = None  # on-policy distillation: the teacher's, temperature applied (None: off)
    # The reference's log-probs over the vocabulary [B, Lr, V] (packed: [M, T, V]) for the update's dense KL
    # (hp.dense_kl_stored); None: not kept
    ref_vocab_logprobs: Array | None = None


def padded_forwards(modules: Modules, params: Trainable, frozen: FrozenParams, rows: ResponseRows,
                    hp: PPOHyper) -> ForwardOutputs:
    """Every model's outputs over padded rows."""
    pt, pm, tokens, mask = rows.prompt_tokens, rows.prompt_mask, rows.tokens, rows.mask
    policy_params, adapters = policy_variables(params.policy, frozen.policy)
    policy = response_outputs(modules.policy, policy_params, pt, pm, tokens, mask, hp.temperature, adapters,
                              experts=rows.experts)
    logits = policy.hidden
    zeros = jnp.zeros(tokens.shape, jnp.float32)
    ref_logp, scores, ref_vocab = zeros, jnp.zeros(tokens.shape[:1], jnp.float32), None
    if not hp.scored_outside:
        ref_logits = reference_logits(modules, frozen, rows, hp)
        ref_logp, scores = token_logprobs(ref_logits, tokens, mask), reward_scores(modules, frozen, rows)
        ref_vocab = jax.nn.log_softmax(ref_logits, axis=-1) if hp.dense_kl_stored else None
    value_params, value_adapters = value_variables(params.value, frozen.value)
    values = (response_values(modules.value, value_params, pt, pm, tokens, mask, adapters=value_adapters)
              if params.value is not None else zeros)
    teacher_logp = None
    if frozen.teacher is not None:  # the teacher routes by its own router: replay is the policy's
        teacher_logp = token_logprobs(response_logits(modules.teacher, frozen.teacher, pt, pm, tokens, mask,
                                                      hp.temperature), tokens, mask)
    return ForwardOutputs(token_logprobs(logits, tokens, mask), ref_logp, ppo.entropy_from_logits(logits, mask),
                          values, scores, policy.flips, teacher_logp, ref_vocab)


def packed_forwards(modules: Modules, params: Trainable, frozen: FrozenParams, rows: packing.PackedRows,
                    hp: PPOHyper) -> ForwardOutputs:
    """Every model's per-slot outputs over one packed microbatch [M, T] (`run_packed` reads them at
    the right slots); the reward model's scores per slot too."""
    policy_params, adapters = policy_variables(params.policy, frozen.policy)
    policy = packing.next_token_outputs(modules.policy, policy_params, rows, hp.temperature, adapters)
    logits = policy.hidden
    zeros = jnp.zeros(rows.tokens.shape, jnp.float32)
    ref_logp, scores, ref_vocab = zeros, zeros, None
    if not hp.scored_outside:
        ref_logits = packed_reference_logits(modules, frozen, rows, hp)
        ref_logp = packing.next_token_logprobs(ref_logits, rows.tokens)
        scores = packed_reward_scores(modules, frozen, rows)
        ref_vocab = jax.nn.log_softmax(ref_logits, axis=-1) if hp.dense_kl_stored else None
    value_params, value_adapters = value_variables(params.value, frozen.value)
    values = (packing.scalar_outputs(modules.value, value_params, rows, value_adapters)
              if params.value is not None else zeros)
    teacher_logp = None
    if frozen.teacher is not None:
        teacher_logits = packing.next_token_logits(modules.teacher, frozen.teacher, rows.replace(experts=None),
                                                   hp.temperature)
        teacher_logp = packing.next_token_logprobs(teacher_logits, rows.tokens)
    return ForwardOutputs(packing.next_token_logprobs(logits, rows.tokens), ref_logp,
                          ppo.entropy_from_logits(logits), values, scores, policy.flips, teacher_logp, ref_vocab)


def reference_logits(modules: Modules, frozen: FrozenParams, rows: ResponseRows, hp: PPOHyper) -> Array:
    """The reference's logits [B, Lr, V] over padded rows' responses, the rollout temperature applied."""
    ref_params, ref_adapters = reference_variables(frozen)
    return response_logits(modules.policy, ref_params, rows.prompt_tokens, rows.prompt_mask, rows.tokens,
                           rows.mask, hp.temperature, adapters=ref_adapters)


def reward_scores(modules: Modules, frozen: FrozenParams, rows: ResponseRows) -> Array:
    """The reward model's raw scores [B] of padded rows; 0 without a reward model."""
    if frozen.reward is None:
        return jnp.zeros(rows.tokens.shape[:1], jnp.float32)
    return response_scores(modules.reward, frozen.reward, rows.prompt_tokens, rows.prompt_mask, rows.tokens,
                           rows.mask)


def score_responses(modules: Modules, frozen: FrozenParams, rows: ResponseRows, hp: PPOHyper) -> tuple[Array, Array]:
    """(the reference's log-probs [B, Lr] under the rollout temperature, the reward model's raw scores
    [B]; 0 without a reward model) of padded rows."""
    ref_logp = token_logprobs(reference_logits(modules, frozen, rows, hp), rows.tokens, rows.mask)
    return ref_logp, reward_scores(modules, frozen, rows)


def packed_reference_logits(modules: Modules, frozen: FrozenParams, rows: packing.PackedRows,
                            hp: PPOHyper) -> Array:
    """`reference_logits` per slot of one packed microbatch [M, T] -> [M, T, V]."""
    ref_params, ref_adapters = reference_variables(frozen)
    ref_rows = rows.replace(experts=None)  # the reference routes by its own router: replay is the policy's
    return packing.next_token_logits(modules.policy, ref_params, ref_rows, hp.temperature, ref_adapters)


def packed_reward_scores(modules: Modules, frozen: FrozenParams, rows: packing.PackedRows) -> Array:
    """The reward model's scores per slot of one packed microbatch [M, T] (0 without one)."""
    if frozen.reward is None:
        return jnp.zeros(rows.tokens.shape, jnp.float32)
    return packing.scalar_outputs(modules.reward, frozen.reward, rows)


def packed_scores(modules: Modules, frozen: FrozenParams, rows: packing.PackedRows,
                  hp: PPOHyper) -> tuple[Array, Array]:
    """`score_responses` per slot of one packed microbatch [M, T]: the reference's log-probs and the
    reward model's scores (0 without one)."""
    ref_logp = packing.next_token_logprobs(packed_reference_logits(modules, frozen, rows, hp), rows.tokens)
    return ref_logp, packed_reward_scores(modules, frozen, rows)


def microbatched(fn: Callable, num_chunks: int, *args):
    """Applies fn to `num_chunks` row slices with lax.map and stitches the results back.

    Rows are dealt round-robin (chunk i = rows i, i + n, ...), so with a batch-sharded input every
    chunk still spans all data-parallel devices instead of landing on a few of them.
    """
    if num_chunks == 1:
        return fn(*args)

    def split(x):
        x = x.reshape((x.shape[0] // num_chunks, num_chunks) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    def merge(x):
        x = jnp.swapaxes(x, 0, 1)
        return x.reshape((-1,) + x.shape[2:])

    out = jax.lax.map(lambda chunk: fn(*chunk), jax.tree.map(split, args))
    return jax.tree.map(merge, out)


def run_packed(forward: Callable, rows: ResponseRows, hp: PPOHyper):
    """Runs `forward` on the padded rows packed (`models/packing.py`), only on the microbatches
    holding tokens. forward(PackedRows [M, T]) -> (a pytree of per-slot outputs, per-slot scores),
    each leaf [M, T]. Returns (that pytree read at each response token's prediction slot, [B, Lr]
    leaves, 0 on padding; the scores read at each row's last real token [B]; the Packing)."""
    seq, _, seq_mask = sequence_inputs(rows.prompt_tokens, rows.prompt_mask, rows.tokens, rows.mask)
    layout = packing.plan(seq_mask, hp.packed_shape(seq.shape[0]))
    packed = packing.pack_rows(seq, layout, rows.experts)
    per_slot, slot_scores = packing.map_used(forward, layout.microbatches_used, packed)
    slots = packing.prediction_slots(layout, rows.prompt_tokens.shape[1], rows.mask)
    scores = packing.gather(slot_scores, packing.last_slots(layout, seq_mask))[:, 0]
    return jax.tree.map(lambda x: packing.gather(x, slots), per_slot), scores, layout
