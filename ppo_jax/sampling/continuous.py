"""The continuous-batching decode engine: `sample_continuous` decodes a fixed number of slots, fed
from a queue of the R = B * n output rows, instead of all R rows at once. Pure and jittable (one
program, no host round-trip: the queue, the inserts and the decode steps are one `lax.while_loop`).

Conventions as in `loop.py`: B prompts, n samples each (output row r = prompt r // n, sample r % n),
Lq prompt length (left-padded), N = max_new_tokens, C = Lq + N - 1 cache slots per row, V vocabulary;
S decode slots (`SamplingConfig.slots`), P prompts per prefill (`SamplingConfig.prefill_batch`).

How it runs. A free slot takes the next prefilled row waiting; when none waits and prompts remain,
the next P prompts are prefilled together (prefill-then-insert: one forward over [P, Lq] into a
[P, Lq] cache, each prompt once, each of its n samples' rows copied into a slot of its own when one
is free) and each row's first token is chosen from the prefill's logits. So a slot idles only when
nothing is left to insert, whatever P is. Then every slot decodes one token at its own cache slot
and position (a per-row KV index, `KVCache.index` [S]); a row that stops (a stop token, or its
limit) frees its slot at once. The cache holds S rows, not R: memory follows the slots, and a
decode step pays for S rows however long the longest row runs. Once the queue is empty and at most half the slots are busy, the busy
rows move into half as many slots and decoding goes on there (`SamplingConfig.tail_halvings`
times at most; by default twice with the unrolled decode, never with the scanned one): the long
tail of the last rows does not pay for the slots the short ones left.

Randomness is scheduling-invariant: row r's token at response position t is drawn with the uniform
(r, t) of `response_uniforms`, the same one the static engine uses, so for the same key both
engines give the same tokens; its log-probs equal the static engine's to float round-off (the same
row's logits, computed in batches of other sizes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax import sharding
from ppo_jax.models import forward
from ppo_jax.models.cache import SPLIT_KV_CACHE_AXES, KVCache, init_cache, split_cache
from ppo_jax.models.transformer import CausalLM, positions_from_mask
from ppo_jax.ppo.stats import last_token_index
from ppo_jax.sampling.config import SampleOutput, SamplingConfig, validate_inputs
from ppo_jax.sampling.loop import (DecodeLayers, apply_last, constrain, constrain_cache, decode_layers,
                                   row_limits, take_cache_rows, unrecorded)
from ppo_jax.sampling.responses import Responses, expert_buffers, record_choices
from ppo_jax.sampling.token_choice import TokenChoice, choose_tokens, response_uniforms

Array = jax.Array


@flax.struct.dataclass
class Prefilled:
    """Rows prefilled and waiting for a slot (W = P * n of them, a prompt's n samples consecutive).

    row [W] int32: the output row, -1 once it took a slot (or finished on its first token); last [W]:
    its first token; prompt_length [W]; mask [W, Lq]; k, v [L, P, K, Lq, Dh]: the prefill's cache,
    one per prompt (its samples share it until each is copied into its slot).
    """

    row: Array
    last: Array
    prompt_length: Array
    mask: Array
    k: Array
    v: Array


@flax.struct.dataclass
class Slots:
    """Carry of the engine (S slots).

    row [S] int32: the output row a slot decodes, -1 when free; step [S] int32: tokens the row has;
    last [S] int32: its last token (fed at the next step); prompt_length [S] int32: its real prompt
    tokens; cache: KV cache [L, S, K, C, Dh] (or one [S, K, C, Dh] per layer, unrolled) with a
    per-slot index; kv_mask [S, C]; waiting: the Prefilled rows; next_prompt []: the first prompt not
    yet prefilled; clock []: slot-steps decoded (every decode step adds the slots it ran); out: the
    Responses.
    """

    row: Array
    step: Array
    last: Array
    prompt_length: Array
    cache: KVCache | tuple[KVCache, ...]
    kv_mask: Array
    waiting: Prefilled
    next_prompt: Array
    clock: Array
    out: Responses


def stage_sizes(slots: int, halvings: int) -> tuple[int, ...]:
    """Slot counts of the engine's stages: `slots`, then halved up to `halvings` times while the half
    still splits evenly over the data-parallel devices of the mesh being traced for."""
    mesh = jax.sharding.get_abstract_mesh()
    divisor = 1 if mesh.empty else sharding.batch_divisor(mesh)
    sizes = [slots]
    while len(sizes) <= halvings and sizes[-1] % 2 == 0 and (sizes[-1] // 2) % divisor == 0:
        sizes.append(sizes[-1] // 2)
    return tuple(sizes)


def _compact(slots: Slots, size: int) -> Slots:
    """The busy slots (at most `size` of them) moved into the first `size` slots, the rest dropped."""
    keep = jnp.argsort(slots.row < 0, stable=True)[:size]

    def rows(x, axis=0):
        x = jnp.take(x, keep, axis=axis)
        return constrain(x, (None,) * axis + ("batch",) + (None,) * (x.ndim - axis - 1))

    def kv(c, axis=0):  # k and v stay split along their slots over the context axis
        return c.replace(k=take_cache_rows(c.k, keep, axis), v=take_cache_rows(c.v, keep, axis),
                         index=rows(c.index))

    if isinstance(slots.cache, tuple):
        cache = tuple(constrain_cache(kv(c), SPLIT_KV_CACHE_AXES) for c in slots.cache)
    else:
        cache = constrain_cache(kv(slots.cache, 1), SPLIT_KV_CACHE_AXES)
    return slots.replace(row=rows(slots.row), step=rows(slots.step), last=rows(slots.last),
                         prompt_length=rows(slots.prompt_length), cache=cache, kv_mask=rows(slots.kv_mask))


@dataclasses.dataclass(frozen=True)
class Engine:
    """What every step of one `sample_continuous` call reads: the model and its variables, the
    prompts, each row's uniforms and length limit, and the static sizes."""

    model: CausalLM
    config: SamplingConfig
    variables: Any  # the model's variables (adapters applied)
    layers: DecodeLayers  # the decode's per-layer trees when it unrolls the layer loop
    prompt_tokens: Array  # [B, Lq] int32
    prompt_mask: Array  # [B, Lq] int32
    uniforms: Array  # [R, N]: row r's draw at step t, wherever it runs
    limits: Array  # [R] int32: each row's max new tokens
    chunk: int  # P, prompts per prefill
    version: Array | None = None  # [] int32: the policy version of `variables` (segmented runs)

    @property
    def batch(self) -> int:
        return self.prompt_tokens.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.prompt_tokens.shape[1]

    @property
    def width(self) -> int:
        """C = Lq + N - 1 cache slots per row, padded to a multiple of the context axis (which splits
        them; the padding slots stay masked)."""
        width = self.prompt_len + self.config.max_new_tokens - 1
        return width - width % -sharding.context_axis_size()

    def choose(self, logits: Array, rows: Array, steps: Array) -> TokenChoice:
        """Tokens for output `rows` [M] (-1: none) at response positions `steps` [M]."""
        new = self.config.max_new_tokens
        draws = self.uniforms[jnp.maximum(rows, 0), jnp.minimum(steps, new - 1)]
        return choose_tokens(logits, steps, draws, self.config)


def _by_rows(x: Array, names=("batch",)) -> Array:
    """x split over the batch axes by its first axis (or `names`)."""
    return constrain(x, names + (None,) * (x.ndim - len(names)))


def _prefill(e: Engine, next_prompt: Array, out: Responses, clock: Array) -> tuple[Prefilled, Responses]:
    """The next `e.chunk` prompts prefilled (to wait for slots), their rows' first tokens chosen and
    recorded. Takes and returns no slot state: under `lax.cond` every operand passes through both
    branches, and the slots' KV cache would be copied on the way."""
    n, chunk, batch = e.config.num_samples, e.chunk, e.batch
    prompts = next_prompt + jnp.arange(chunk)
    valid = jnp.repeat(prompts < batch, n)  # [W]: a last short chunk's padding rows
    prompts = jnp.minimum(prompts, batch - 1)
    tokens, mask = e.prompt_tokens[prompts], e.prompt_mask[prompts]
    cache = init_cache(e.model.config, chunk, e.prompt_len, e.config.cache_dtype)
    (logits, cache), experts = apply_last(e.model, e.variables, tokens, positions_from_mask(mask), mask, cache,
                                          jnp.maximum(last_token_index(mask), 0), record=e.config.record_experts)
    if experts is not None:  # past the last prompt: dropped
        at = jnp.where(next_prompt + jnp.arange(chunk) < batch, prompts, batch)
        out = out.replace(prompt_experts=out.prompt_experts.at[at].set(experts, mode="drop"))
    new_rows = jnp.where(valid, jnp.repeat(prompts, n) * n + jnp.tile(jnp.arange(n), chunk), -1)
    first_steps = jnp.zeros((chunk * n,), jnp.int32)
    choice = e.choose(jnp.repeat(logits, n, axis=0), new_rows, first_steps)
    out, finished = record_choices(out, clock, new_rows, first_steps, choice, e.limits, e.config, e.version)
    waiting = Prefilled(row=jnp.where(finished, -1, new_rows), last=choice.tokens,
                        prompt_length=jnp.repeat(mask.sum(-1), n), mask=jnp.repeat(mask, n, axis=0),
                        k=cache.k, v=cache.v)
    return waiting, out


def _insert(e: Engine, slots: Slots) -> Slots:
    """Moves waiting rows, in order, into the free slots, as many as both allow."""
    n, num_slots, prompt_len = e.config.num_samples, e.config.slots, e.prompt_len
    width_waiting = e.chunk * n  # inserts happen in the first stage only: num_slots slots
    pairs = min(num_slots, width_waiting)
    free = jnp.argsort(slots.row >= 0, stable=True)[:pairs]  # free slots first, in slot order
    ready = jnp.argsort(slots.waiting.row < 0, stable=True)[:pairs]  # waiting rows first, in order
    moves = jnp.minimum(jnp.sum(slots.row < 0), jnp.sum(slots.waiting.row >= 0))
    moving = jnp.arange(pairs) < moves
    targets = jnp.where(moving, free, num_slots)  # past the end: dropped
    w = slots.waiting

    def put(buffer, values):  # values [pairs, ...] into the target slots
        return buffer.at[targets].set(values.astype(buffer.dtype), mode="drop")

    def copy_prompt(buffer, source, layer_axis):  # a [.., P, K, Lq, Dh] prefill cache into slots
        source = jnp.take(source, ready // n, axis=layer_axis).astype(buffer.dtype)
        if sharding.context_axis_size() > 1:
            # whole rows of C slots (zeros past the prompt: masked), each device gathering its own
            # slots, so the scatter indexes rows only: a prompt-wide scatter into the slots split
            # over the context axis had XLA all-gather them
            slots = jnp.arange(buffer.shape[-2])
            source = jnp.take(source, jnp.minimum(slots, prompt_len - 1), axis=-2)
            source = constrain(jnp.where((slots < prompt_len)[:, None], source, 0), SPLIT_KV_CACHE_AXES[-source.ndim:])
            return buffer.at[(slice(None),) * layer_axis + (targets,)].set(source, mode="drop")
        if layer_axis:
            return buffer.at[:, targets, :, :prompt_len].set(source, mode="drop")
        return buffer.at[targets, :, :prompt_len].set(source, mode="drop")

    if e.layers.unroll:
        cache = tuple(c.replace(k=copy_prompt(c.k, w.k[i], 0), v=copy_prompt(c.v, w.v[i], 0))
                      for i, c in enumerate(slots.cache))
    else:
        cache = slots.cache.replace(k=copy_prompt(slots.cache.k, w.k, 1), v=copy_prompt(slots.cache.v, w.v, 1))
    kv_mask = jnp.concatenate([w.mask[ready], jnp.zeros((pairs, e.width - prompt_len), jnp.int32)], axis=1)
    consumed = w.row.at[jnp.where(moving, ready, width_waiting)].set(-1, mode="drop")
    return slots.replace(
        row=put(slots.row, w.row[ready]), step=put(slots.step, jnp.ones((pairs,), jnp.int32)),
        last=put(slots.last, w.last[ready]), prompt_length=put(slots.prompt_length, w.prompt_length[ready]),
        cache=cache, kv_mask=put(slots.kv_mask, kv_mask), waiting=w.replace(row=consumed))


def _to_insert(e: Engine, slots: Slots) -> Array:
    """Rows waiting, or prompts left to prefill."""
    return jnp.any(slots.waiting.row >= 0) | (slots.next_prompt < e.batch)


def _fill(e: Engine, slots: Slots) -> Slots:
    """Free slots take waiting rows; when none wait, the next prompts are prefilled first."""
    def step(slots: Slots) -> Slots:
        some_wait = jnp.any(slots.waiting.row >= 0)
        waiting, out = jax.lax.cond(some_wait, lambda w, o, p, c: (w, o),
                                    lambda w, o, p, c: _prefill(e, p, o, c),
                                    slots.waiting, slots.out, slots.next_prompt, slots.clock)
        next_prompt = slots.next_prompt + jnp.where(some_wait, 0, e.chunk)
        return _insert(e, slots.replace(waiting=waiting, out=out, next_prompt=next_prompt))

    return jax.lax.while_loop(lambda s: jnp.any(s.row < 0) & _to_insert(e, s), step, slots)


def _decode(e: Engine, slots: Slots) -> Slots:
    """One token for every slot, each at its own cache slot Lq + step - 1 and position."""
    size = slots.row.shape[0]  # this stage's slots
    busy = slots.row >= 0
    # A free slot decodes too (static shapes): it writes its own, masked slot and sits at
    # position 0, so it moves no row's length-dependent rope (dynamic NTK, LongRoPE).
    index = jnp.where(busy, e.prompt_len + slots.step - 1, e.width - 1)
    kv_mask = slots.kv_mask.at[jnp.arange(size), index].set(1)
    positions = jnp.where(busy, slots.prompt_length + slots.step - 1, 0)[:, None]
    if e.layers.unroll:
        cache = tuple(c.replace(index=index) for c in slots.cache)
    else:
        cache = slots.cache.replace(index=index)
    (logits, cache), experts = apply_last(e.model, e.variables, slots.last[:, None], positions, kv_mask, cache,
                                          jnp.zeros((size,), jnp.int32), e.layers.params, e.layers.adapters,
                                          record=e.config.record_experts)
    slots = slots.replace(cache=cache, kv_mask=kv_mask, clock=slots.clock + size)
    if experts is not None:  # the fed token, response column step - 1 of its row (a free slot's: dropped)
        at = jnp.where(busy, slots.row, slots.out.experts.shape[0])
        slots = slots.replace(out=slots.out.replace(
            experts=slots.out.experts.at[at, slots.step - 1].set(experts[:, 0], mode="drop")))
    choice = e.choose(logits, slots.row, slots.step)
    out, finished = record_choices(slots.out, slots.clock, slots.row, slots.step, choice, e.limits, e.config,
                            e.version)
    return slots.replace(row=jnp.where(finished, -1, slots.row), step=slots.step + busy, last=choice.tokens, out=out)


def initial_slots(e: Engine, versions: bool = False) -> Slots:
    """Every slot free, nothing waiting, the output buffers [R, N] empty (with a version per token
    when `versions`, -1 until chosen)."""
    mc, config, num_slots, chunk, n = e.model.config, e.config, e.config.slots, e.chunk, e.config.num_samples
    rows, new = e.batch * n, config.max_new_tokens
    cache = init_cache(mc, num_slots, e.width, config.cache_dtype)
    cache = cache.replace(index=jnp.zeros((num_slots,), jnp.int32))
    if e.layers.unroll:
        cache = tuple(constrain_cache(layer, SPLIT_KV_CACHE_AXES) for layer in split_cache(cache))
    else:
        cache = constrain_cache(cache, SPLIT_KV_CACHE_AXES)

    def slot_array(dtype, fill_value=0):
        return _by_rows(jnp.full((num_slots,), fill_value, dtype))

    def buffer(dtype, fill_value=0):
        return _by_rows(jnp.full((rows, new), fill_value, dtype), ("batch", "length"))

    waiting_cache = init_cache(mc, chunk, e.prompt_len, config.cache_dtype)
    waiting = Prefilled(row=jnp.full((chunk * n,), -1, jnp.int32), last=jnp.zeros((chunk * n,), jnp.int32),
                        prompt_length=jnp.zeros((chunk * n,), jnp.int32),
                        mask=jnp.zeros((chunk * n, e.prompt_len), jnp.int32), k=waiting_cache.k, v=waiting_cache.v)
    return Slots(
        row=slot_array(jnp.int32, -1), step=slot_array(jnp.int32), last=slot_array(jnp.int32),
        prompt_length=slot_array(jnp.int32), cache=cache, waiting=waiting,
        kv_mask=_by_rows(jnp.zeros((num_slots, e.width), jnp.int32)), next_prompt=jnp.zeros((), jnp.int32),
        clock=jnp.zeros((), jnp.int32),
        out=Responses(tokens=buffer(jnp.int32, config.pad_token_id), logprobs=buffer(jnp.float32),
                      sampling_logprobs=buffer(jnp.float32), mask=buffer(jnp.int32),
                      stopped=_by_rows(jnp.zeros((rows,), bool)),
                      slot_steps_at_finish=_by_rows(jnp.zeros((rows,), jnp.int32)),
                      version=buffer(jnp.int32, -1) if versions else None,
                      **(expert_buffers(e.model.config, rows, new, e.batch, e.prompt_len)
                         if config.record_experts else {})))


def _busy_count(slots: Slots) -> Array:
    return jnp.sum(slots.row >= 0)


def make_engine(params: Any, prompt_tokens: Array, prompt_mask: Array, uniforms: Array, limits: Array, *,
                model: CausalLM, config: SamplingConfig, adapters: Any = None, version: Array | None = None) -> Engine:
    """The Engine of one call: prompts [B, Lq], uniforms [R, N], limits [R] int32; version [] int32
    (segmented runs: what every token chosen under `params` is stamped with)."""
    return Engine(model=model, config=config, variables=forward.variables(params, adapters),
                  layers=decode_layers(params, adapters, config), prompt_tokens=prompt_tokens.astype(jnp.int32),
                  prompt_mask=prompt_mask.astype(jnp.int32), uniforms=uniforms, limits=limits,
                  chunk=config.prefill_batch(prompt_tokens.shape[0]), version=version)


def _stage_sizes(e: Engine) -> tuple[int, ...]:
    halvings = e.config.tail_halvings if e.config.tail_halvings is not None else (2 if e.layers.unroll else 0)
    return stage_sizes(e.config.slots, halvings)


def _first_stage_goes_on(e: Engine, slots: Slots) -> Array:
    """[] bool: stage 0 (inserts and decodes on all the slots) has more to do: something is left to
    insert, or more rows are busy than the next stage has slots."""
    sizes = _stage_sizes(e)
    following = sizes[1] if len(sizes) > 1 else 0
    return _to_insert(e, slots) | (_busy_count(slots) > following)


def first_stage_steps(e: Engine, slots: Slots, budget: Array) -> Slots:
    """At most `budget` [] int32 decode steps of stage 0 (fewer when it ends): one segment of a
    segmented run. Every step is the unsegmented engine's, so segments under the same weights
    decode what one call does."""
    def go_on(carry):
        slots, done = carry
        return (done < budget) & _first_stage_goes_on(e, slots)

    slots, _ = jax.lax.while_loop(go_on, lambda c: (_decode(e, _fill(e, c[0])), c[1] + 1),
                                  (slots, jnp.zeros((), jnp.int32)))
    return slots


def run_to_end(e: Engine, slots: Slots) -> Slots:
    """Every row decoded from `slots` on: the rest of stage 0, then each later stage on fewer slots."""
    # Stage 0 inserts and decodes on all the slots until nothing is left to insert and at most the
    # next stage's slots are busy (one fill site in the program: the prefill compiles once; a fill
    # leaves a slot busy unless every row it prefilled stopped at once and nothing is left, and the
    # decode after it then records nothing). Each later stage decodes on fewer slots, no inserts.
    sizes = _stage_sizes(e)
    for stage, size in enumerate(sizes):
        following = sizes[stage + 1] if stage + 1 < len(sizes) else 0
        if stage == 0:
            slots = jax.lax.while_loop(lambda s: _first_stage_goes_on(e, s), lambda s: _decode(e, _fill(e, s)), slots)
        else:
            slots = jax.lax.while_loop(lambda s, f=following: _busy_count(s) > f, lambda s: _decode(e, s), slots)
        if following:
            slots = _compact(slots, following)
    return slots


def sample_output(e: Engine, out: Responses) -> SampleOutput:
    """The finished Responses as a SampleOutput (rows in prompt order)."""
    n = e.config.num_samples
    prompt_mask = jnp.repeat(e.prompt_mask, n, axis=0)
    routed = None
    if out.experts is not None:
        routed = jnp.concatenate([unrecorded(jnp.repeat(out.prompt_experts, n, axis=0), prompt_mask),
                                  unrecorded(out.experts, out.mask)], axis=1)
    return SampleOutput(
        prompt_tokens=jnp.repeat(e.prompt_tokens, n, axis=0), prompt_mask=prompt_mask,
        tokens=out.tokens, logprobs=out.logprobs, sampling_logprobs=out.sampling_logprobs, mask=out.mask,
        lengths=out.mask.sum(axis=-1), stopped=out.stopped, slot_steps_at_finish=out.slot_steps_at_finish,
        token_policy_version=out.version, routed_experts=routed)


def sample_continuous(params: Any, prompt_tokens: Array, prompt_mask: Array, key: Array, *,
                      model: CausalLM, config: SamplingConfig, adapters: Any = None,
                      response_limits: Array | None = None) -> SampleOutput:
    """`loop.sample` (same arguments, same SampleOutput, rows in prompt order) on `config.slots`
    decode slots fed from a queue of the B * n rows."""
    validate_inputs(model, config, prompt_tokens.shape, prompt_mask.shape)
    rows = prompt_tokens.shape[0] * config.num_samples
    # Built as before segments existed (the uniforms traced after the layers): the same program.
    e = Engine(model=model, config=config, variables=forward.variables(params, adapters),
               layers=decode_layers(params, adapters, config), prompt_tokens=prompt_tokens.astype(jnp.int32),
               prompt_mask=prompt_mask.astype(jnp.int32), uniforms=response_uniforms(key, rows, config.max_new_tokens),
               limits=row_limits(response_limits, rows, config), chunk=config.prefill_batch(prompt_tokens.shape[0]))
    return sample_output(e, run_to_end(e, initial_slots(e)).out)
