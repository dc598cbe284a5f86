"""The decode loop: `sample` runs one prefill forward over the prompts, then a `lax.while_loop` decode
over a preallocated KV cache, one token per row per step. Pure and jittable (`Sampler` jits it).

Conventions: B prompts, n samples per prompt (R = B * n output rows, the n rows of one prompt
consecutive), Lq prompt length (prompts are left-padded), N = max_new_tokens, V vocabulary,
S = Lq + N - 1 cache slots (the last sampled token is never fed back, so it needs no slot), padded
up to a multiple of the mesh's context axis, which splits them (`SPLIT_KV_CACHE_AXES`: each device
holds S / c slots of every row; XLA partitions the decode's attention over them, all-reducing the
softmax's max and sum [R, H, 1] and its weighted values [R, H, Dh] over the axis, never gathering the
cache). The rows, their hidden states and logits stay whole on every device of the axis.

Everything has a fixed shape: the response buffers are [R, N] from the start, a row that has produced
a stop token keeps running (fed padding, its outputs masked) until every row has stopped, at which
point the loop exits early. The loop tests for that every `config.steps_per_sync` = K steps: each of
its iterations decodes K steps in a loop of known trip count, which XLA:GPU runs without a host round
trip (the outer loop's data-dependent condition costs one per iteration). Steps past the response's
end write into K - 1 spare columns of the buffers, dropped at the end.

Contract. Prompts are left-padded and every row has at least one real token (a row of padding only
yields finite garbage, it is not detected inside the compiled program). With num_samples > 1 the
prompt is prefilled once per prompt and its cache repeated, so the peak holds the B-row prefill
cache next to the R-row decode cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax import sharding
from ppo_jax.models import forward, moe
from ppo_jax.models.cache import KV_CACHE_AXES, SPLIT_KV_CACHE_AXES, KVCache, init_cache, split_cache
from ppo_jax.models.transformer import CausalLM, chosen_experts, positions_from_mask, split_layer_params
from ppo_jax.ppo.stats import last_token_index
from ppo_jax.sampling.config import SampleOutput, SamplingConfig, validate_inputs
from ppo_jax.sampling.token_choice import TokenChoice, choose_tokens, response_uniforms

Array = jax.Array


@flax.struct.dataclass
class DecodeState:
    """Carry of the decode loop (R rows, N response slots, S cache slots).

    step []: response tokens already chosen; cache: KV cache (index = Lq + step - 1), or one per layer
    when the decode is unrolled; kv_mask [R, S]; stopped [R]: row produced a stop token;
    done [R]: row has stopped or reached its limit; the [R, N] buffers are filled column by column;
    experts [R, N, Lm, k]: with `record_experts`, column j the routing of response token j, written
    when the token is fed back (the step after it was chosen), else None.
    """

    step: Array
    cache: KVCache | tuple[KVCache, ...]
    kv_mask: Array
    stopped: Array
    done: Array
    tokens: Array
    logprobs: Array
    sampling_logprobs: Array
    mask: Array
    experts: Array | None = None


def constrain(x: Array, logical_names: tuple[str | None, ...]) -> Array:
    """Pins an intermediate's sharding by logical names under the current mesh (no-op without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, sharding.logical_to_spec(logical_names, x.shape, mesh))


def constrain_cache(cache: KVCache, axes: tuple[str, ...] = KV_CACHE_AXES) -> KVCache:
    """`constrain` for a KV cache, stacked [L, B, K, S, Dh] or one layer's [B, K, S, Dh]; axes: its
    logical names (`SPLIT_KV_CACHE_AXES`: the slots split over the context axis)."""
    names = axes[-cache.k.ndim:]  # a per-layer cache has no layers axis
    return cache.replace(k=constrain(cache.k, names), v=constrain(cache.v, names))


def take_cache_rows(x: Array, rows: Array, axis: int) -> Array:
    """jnp.take(x, rows, axis) of a cache's k or v ([.., B, K, S, Dh], the rows on `axis`) split along
    its slots over the context axis: per device of that axis on its own slots (XLA's gather
    partitioner all-gathered the slots to move rows between the batch axes' devices)."""
    if sharding.context_axis_size() == 1:
        return jnp.take(x, rows, axis=axis)
    return sharding.over_context(lambda x, rows: jnp.take(x, rows, axis=axis), (x.ndim - 2, None),
                                 x.ndim - 2)(x, rows)


def forward_last(module: CausalLM, tokens, positions, kv_mask, cache, last_index, layer_params=None,
                  layer_adapters=None):
    """Logits [B, V] at slot `last_index [B]` only: the prompt's [B, Lq, V] logits are never built.

    With `layer_params` (per-layer trees, and `layer_adapters` likewise when LoRA is on) the cache is
    a per-layer tuple and the layers are unrolled.
    """
    if layer_params is None:
        hidden, cache = module.transformer(tokens, positions, kv_mask, cache)
    else:
        hidden, cache = module.transformer.unrolled(tokens, positions, kv_mask, cache, layer_params,
                                                    layer_adapters)
    last_hidden = jnp.take_along_axis(hidden, last_index[:, None, None], axis=1)
    return module.project(last_hidden)[:, 0], cache


def apply_last(module: CausalLM, variables, *args, record: bool):
    """(logits, cache) of `forward_last`, and with `record` the experts its tokens went to
    [B, T, Lm, k] (`moe.index_dtype`), else None."""
    if not record:
        return module.apply(variables, *args, method=forward_last), None
    out, sown = module.apply(variables, *args, method=forward_last, mutable=[moe.CHOSEN])
    return out, chosen_experts(sown[moe.CHOSEN]).astype(moe.index_dtype(module.config.num_experts))


def unrecorded(experts: Array, mask: Array) -> Array:
    """experts [R, T, Lm, k] with -1 where mask [R, T] is 0 (padding: nothing to replay)."""
    return jnp.where(mask.astype(bool)[..., None, None], experts, jnp.asarray(-1, experts.dtype))


@dataclasses.dataclass(frozen=True)
class DecodeLayers:
    """How a decode loop runs its layers: `unroll` (per-layer weights and caches, `Transformer.unrolled`)
    with the per-layer parameter and adapter trees it then reads (None when scanning, or without
    adapters)."""

    unroll: bool
    params: Any = None
    adapters: Any = None


def decode_layers(params: Any, adapters: Any, config: SamplingConfig) -> DecodeLayers:
    """`config.unroll_layers` resolved (None: on except on TPU), and the per-layer trees it needs."""
    unroll = config.unroll_layers if config.unroll_layers is not None else jax.default_backend() != "tpu"
    return DecodeLayers(unroll=unroll, params=split_layer_params(params) if unroll else None,
                        adapters=split_layer_params(adapters) if unroll and adapters is not None else None)


def row_limits(response_limits: Array | None, rows: int, config: SamplingConfig) -> Array:
    """Each output row's own max_new_tokens [R] int32: `response_limits`, or N for every row."""
    if response_limits is None:
        return jnp.full((rows,), config.max_new_tokens, jnp.int32)
    return response_limits.astype(jnp.int32)


def is_stop_token(tokens: Array, config: SamplingConfig) -> Array:
    """tokens [R] int32 -> [R] bool: one of the stop tokens."""
    stop = jnp.zeros(tokens.shape, bool)
    for stop_id in config.stop_token_ids:
        stop |= tokens == stop_id
    return stop


def _record(state: DecodeState, choice: TokenChoice, config: SamplingConfig, limits: Array) -> DecodeState:
    """Writes the step's choice into column `state.step` (masked for rows already done); a row is done
    after a stop token or its `limits` [R] tokens."""
    active = ~state.done
    pad = jnp.asarray(config.pad_token_id, jnp.int32)
    tokens = jnp.where(active, choice.tokens, pad)
    is_stop = is_stop_token(tokens, config)

    def put(buffer, column):
        return jax.lax.dynamic_update_slice(buffer, column[:, None].astype(buffer.dtype), (0, state.step))

    zero = jnp.zeros((), jnp.float32)
    return state.replace(
        step=state.step + 1,
        stopped=state.stopped | (active & is_stop),
        done=state.done | (active & (is_stop | (state.step + 1 >= limits))),
        tokens=put(state.tokens, tokens),
        logprobs=put(state.logprobs, jnp.where(active, choice.logprobs, zero)),
        sampling_logprobs=put(state.sampling_logprobs, jnp.where(active, choice.sampling_logprobs, zero)),
        mask=put(state.mask, active.astype(jnp.int32)),
    )


def repeat_samples(n: int, arrays: tuple, cache: KVCache) -> tuple[tuple, KVCache]:
    """Each prompt's arrays ([B, ...] -> [B * n, ...], None stays None) and cache rows repeated n times:
    output row r is prompt r // n, sample r % n. The cache stays split along its slots."""
    def repeat(x, axis=0):
        return None if x is None else jnp.repeat(x, n, axis=axis)

    cache = constrain_cache(cache.replace(k=repeat(cache.k, 1), v=repeat(cache.v, 1)), SPLIT_KV_CACHE_AXES)
    return tuple(map(repeat, arrays)), cache


def steps_per_iteration(config: SamplingConfig) -> int:
    """Decode steps K of one iteration of `sample`'s loop (`config.steps_per_sync`, at most N - 1)."""
    return max(1, min(config.steps_per_sync, config.max_new_tokens - 1))


def decode_steps(config: SamplingConfig) -> int:
    """Decode steps `sample` runs when no row stops early: N - 1 rounded up to whole loop iterations
    (the first token comes from the prefill; 0 for N = 1)."""
    per_iteration = steps_per_iteration(config)
    return -(-(config.max_new_tokens - 1) // per_iteration) * per_iteration


def sample(params: Any, prompt_tokens: Array, prompt_mask: Array, key: Array, *, model: CausalLM,
           config: SamplingConfig, adapters: Any = None, response_limits: Array | None = None) -> SampleOutput:
    """Samples `config.num_samples` responses per left-padded prompt. Pure and jittable.

    params: the CausalLM parameter tree; prompt_tokens, prompt_mask [B, Lq] (left-padded, every row
    with at least one real token); key: a typed PRNG key; adapters: the model's LoRA adapter tree
    (models/lora.py), None to decode the base; response_limits [R] int32 (1..N): each output row's
    own max_new_tokens (a row reaching it ends unstopped), None: N for all. Returns a SampleOutput
    with R = B * n rows.
    """
    validate_inputs(model, config, prompt_tokens.shape, prompt_mask.shape)
    mc = model.config
    batch, prompt_len = prompt_tokens.shape
    n, new = config.num_samples, config.max_new_tokens
    # Cache slots padded to a multiple of the context axis, which splits them (the padding slots stay
    # masked: never written, never seen).
    slots = prompt_len + new - 1
    slots += -slots % sharding.context_axis_size()
    prompt_tokens = prompt_tokens.astype(jnp.int32)
    prompt_mask = prompt_mask.astype(jnp.int32)

    # Prefill once per prompt (not per sample), into slots [0, Lq) of the cache.
    cache = constrain_cache(init_cache(mc, batch, slots, config.cache_dtype), SPLIT_KV_CACHE_AXES)
    kv_mask = jnp.concatenate([prompt_mask, jnp.zeros((batch, slots - prompt_len), jnp.int32)], axis=1)
    variables = forward.variables(params, adapters)
    record = config.record_experts
    (logits, cache), prompt_experts = apply_last(
        model, variables, prompt_tokens, positions_from_mask(prompt_mask), kv_mask, cache,
        jnp.maximum(last_token_index(prompt_mask), 0), record=record)
    if n > 1:
        (prompt_tokens, prompt_mask, kv_mask, logits, prompt_experts), cache = repeat_samples(
            n, (prompt_tokens, prompt_mask, kv_mask, logits, prompt_experts), cache)
    rows = batch * n
    prompt_lengths = prompt_mask.sum(axis=-1)
    layers = decode_layers(params, adapters, config)
    if layers.unroll:
        cache = tuple(constrain_cache(layer, SPLIT_KV_CACHE_AXES) for layer in split_cache(cache))
    uniforms = constrain(response_uniforms(key, rows, new), ("batch", "length"))
    limits = row_limits(response_limits, rows, config)

    def choose(logits: Array, step: Array) -> TokenChoice:
        column = jax.lax.dynamic_index_in_dim(uniforms, step, axis=1, keepdims=False)
        return choose_tokens(logits, step, column, config)

    # Decode steps per loop iteration; steps past the last column (at most K - 1, once every row is
    # done) write into spare columns.
    per_sync = steps_per_iteration(config)

    def zeros(dtype):
        return constrain(jnp.zeros((rows, new + per_sync - 1), dtype), ("batch", "length"))

    state = DecodeState(
        step=jnp.zeros((), jnp.int32), cache=cache, kv_mask=kv_mask, stopped=jnp.zeros((rows,), bool),
        done=jnp.zeros((rows,), bool), tokens=zeros(jnp.int32) + config.pad_token_id,
        logprobs=zeros(jnp.float32), sampling_logprobs=zeros(jnp.float32), mask=zeros(jnp.int32),
        experts=None if not record else jnp.full((rows, new + per_sync - 1) + prompt_experts.shape[2:], -1,
                                                 prompt_experts.dtype))
    state = _record(state, choose(logits, state.step), config, limits)

    def keep_going(state: DecodeState) -> Array:
        return (state.step < new) & ~jnp.all(state.done)

    def decode_one(state: DecodeState) -> DecodeState:
        # Feed the token chosen last step into slot Lq + step - 1, at position prompt_len + step - 1.
        previous = jax.lax.dynamic_slice_in_dim(state.tokens, state.step - 1, 1, axis=1)
        slot = prompt_len + state.step - 1
        kv_mask = jax.lax.dynamic_update_slice(state.kv_mask, jnp.ones((rows, 1), jnp.int32), (0, slot))
        positions = (prompt_lengths + state.step - 1)[:, None]
        (logits, cache), experts = apply_last(model, variables, previous, positions, kv_mask, state.cache,
                                              jnp.zeros((rows,), jnp.int32), layers.params, layers.adapters,
                                              record=record)
        if record:  # the routing of the token just fed: response column step - 1
            state = state.replace(experts=jax.lax.dynamic_update_slice_in_dim(
                state.experts, experts, state.step - 1, axis=1))
        # pinned split in the loop carry too: the partitioner then keeps each device's slots in place
        cache = (tuple(constrain_cache(c, SPLIT_KV_CACHE_AXES) for c in cache) if layers.unroll
                 else constrain_cache(cache, SPLIT_KV_CACHE_AXES))
        state = state.replace(cache=cache, kv_mask=kv_mask)
        return _record(state, choose(logits, state.step), config, limits)

    def decode_group(state: DecodeState) -> DecodeState:
        if per_sync == 1:
            return decode_one(state)
        return jax.lax.fori_loop(0, per_sync, lambda _, s: decode_one(s), state)

    if new > 1:  # N = 1: the prefill's token is the whole response; no loop body to compile
        state = jax.lax.while_loop(keep_going, decode_group, state)
    tokens, logprobs, sampling_logprobs, mask = (x[:, :new] for x in (
        state.tokens, state.logprobs, state.sampling_logprobs, state.mask))
    lengths = mask.sum(axis=-1)
    routed = None
    if record:
        routed = jnp.concatenate([unrecorded(prompt_experts, prompt_mask),
                                  unrecorded(state.experts[:, :new], mask)], axis=1)
    return SampleOutput(
        prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=tokens, logprobs=logprobs,
        sampling_logprobs=sampling_logprobs, mask=mask, lengths=lengths, stopped=state.stopped,
        slot_steps_at_finish=(lengths - 1) * rows, routed_experts=routed)
