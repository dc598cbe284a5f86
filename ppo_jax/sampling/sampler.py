"""Rollout sampler: one prefill forward, then a `lax.while_loop` decode over a preallocated KV cache.

Conventions: B prompts, n samples per prompt (R = B * n output rows, the n rows of one prompt
consecutive), Lq prompt length (prompts are left-padded), N = max_new_tokens, V vocabulary,
S = Lq + N - 1 cache slots (the last sampled token is never fed back, so it needs no slot).

Everything has a fixed shape: the response buffers are [R, N] from the start, a row that has produced
a stop token keeps running (fed padding, its outputs masked) until every row has stopped, at which
point the loop exits early.

Log-probs. `logprobs` are log-probs of the sampled tokens under the full tempered distribution
`log_softmax(logits / temperature)`: exactly what the training forward computes for the same tokens,
so the PPO ratio of the first minibatch is 1. When the sampler does not sample from that distribution
(top-k, top-p, or stop tokens suppressed before `min_new_tokens`), the behaviour policy is the
truncated, renormalised distribution; its log-probs are in `sampling_logprobs`. The difference
`logprobs - sampling_logprobs = log(kept mass) <= 0` is what truncation does to the PPO ratio: with
old log-probs taken from `logprobs`, the true importance ratio pi_new/pi_behaviour is off by the factor
exp(sampling_logprobs - logprobs) >= 1 per token. `truncation_metrics` summarises it for logging.

Randomness. Output row r draws one uniform per step from `fold_in(fold_in(key, r), step)` and turns
it into a token by inverse CDF (`response_uniforms`, `draw_from_weights`), so a row's tokens depend
only on the key, its row index and its own logits: the same key gives the same tokens on every mesh
shape, and a row's tokens do not change when other rows stop or when the batch grows.

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
import numpy as np
from jax.sharding import Mesh

from ppo_jax import sharding
from ppo_jax.models.config import to_dtype
from ppo_jax.models.transformer import (
    KV_CACHE_AXES,
    CausalLM,
    KVCache,
    init_cache,
    last_token_index,
    positions_from_mask,
    split_cache,
    split_layer_params,
)

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How to sample responses (static: hashable, part of the compiled program).

    max_new_tokens: response length N (the buffers are always this long).
    min_new_tokens: stop tokens are suppressed while fewer than this many tokens were generated.
    temperature:    logits are divided by it, for sampling and for the returned log-probs.
    top_k:          keep only the k most likely tokens (0, or >= the vocabulary size: off).
    top_p:          keep the smallest set of most likely tokens whose mass reaches top_p (1.0: off);
                    applied after top_k, on the top-k-renormalised distribution (as transformers does).
    greedy:         take the argmax instead of sampling (log-probs still use the temperature;
                    sampling_logprobs are 0, the log-prob of a point mass).
    stop_token_ids: any of these ends a row; the stop token itself is part of the response (mask 1).
    pad_token_id:   written after a row has stopped.
    num_samples:    responses per prompt (GRPO/RLOO); the rows of one prompt are consecutive.
    cache_dtype:    KV cache dtype name ("bfloat16" halves its memory); None: the model compute dtype.
    unroll_layers:  decode layer by layer on per-layer copies of the weights and cache instead of
                    scanning the stacked layers (`Transformer.unrolled`): on XLA:CPU this saves a copy
                    of every layer's weights and cache slab per token (GPT-2-small: 1.5x faster) at the
                    price of one copy of the layer weights while sampling and a decode program that
                    grows with depth; a bf16 cache then saves less, as XLA:CPU converts each
                    layer's slab to f32 for its dots. None: on when the backend is CPU.
    """

    max_new_tokens: int
    pad_token_id: int
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    num_samples: int = 1
    cache_dtype: str | None = None
    unroll_layers: bool | None = None

    def __post_init__(self):
        # Accept any sequence of ids but store a tuple so the config stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"sampling.min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(
                f"sampling.temperature must be > 0, got {self.temperature}; for argmax decoding set "
                f"sampling.greedy=True (the temperature then only scales the returned log-probs)")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1] (1.0 turns it off), got {self.top_p}")
        if self.num_samples < 1:
            raise ValueError(f"sampling.num_samples must be >= 1, got {self.num_samples}")
        if self.pad_token_id < 0:
            raise ValueError(f"sampling.pad_token_id must be a token id >= 0, got {self.pad_token_id}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"sampling.stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")
        if self.cache_dtype is not None:
            to_dtype(self.cache_dtype)

    @property
    def truncates(self) -> bool:
        """Whether tokens may be drawn from something other than the full tempered distribution."""
        suppresses_stop = self.min_new_tokens > 0 and bool(self.stop_token_ids)
        return self.greedy or self.top_k > 0 or self.top_p < 1.0 or suppresses_stop


@flax.struct.dataclass
class SampleOutput:
    """Sampled responses; R = B * num_samples rows, the rows of one prompt consecutive.

    prompt_tokens, prompt_mask [R, Lq]: the prompts, repeated num_samples times.
    tokens [R, N] int32: response tokens, pad_token_id after the first stop token.
    logprobs [R, N] float32: log_softmax(logits / T) of each sampled token (0 where mask is 0).
    sampling_logprobs [R, N] float32: log-prob under the distribution actually sampled from (after
        top-k / top-p / min_new_tokens suppression; 0 under greedy decoding, a point mass); equal to
        `logprobs` when nothing truncates. 0 where mask is 0.
    mask [R, N] int32: 1 up to and including the first stop token.
    lengths [R] int32: response lengths (sum of mask).
    stopped [R] bool: the row produced a stop token (False: it ran to max_new_tokens).
    """

    prompt_tokens: Array
    prompt_mask: Array
    tokens: Array
    logprobs: Array
    sampling_logprobs: Array
    mask: Array
    lengths: Array
    stopped: Array


def truncation_metrics(output: SampleOutput) -> dict[str, Array]:
    """What truncated sampling does to the PPO ratio, averaged over response tokens.

    kept_mass: probability mass of the tempered distribution that top-k/top-p/min-tokens kept
        (1.0 when nothing truncates); the initial ratio of the full-distribution policy to the
        behaviour policy is kept_mass per token, not 1.
    log_ratio: mean of logprobs - sampling_logprobs = log kept_mass (<= 0).
    """
    mask = output.mask.astype(jnp.float32)
    count = jnp.maximum(mask.sum(), 1.0)
    log_ratio = (output.logprobs - output.sampling_logprobs) * mask
    return {
        "sampling/kept_mass": (jnp.exp(log_ratio) * mask).sum() / count,
        "sampling/log_ratio": log_ratio.sum() / count,
    }


# --------------------------------------------------------------------------------------------
# Token choice: pure functions of one step's logits.


def processed_logits(scaled: Array, step: Array, config: SamplingConfig) -> Array:
    """Tempered logits [R, V] with disallowed tokens set to -inf (min-tokens, top-k, top-p)."""
    vocab = scaled.shape[-1]
    neg_inf = jnp.asarray(-jnp.inf, scaled.dtype)
    out = scaled
    if config.min_new_tokens > 0 and config.stop_token_ids:
        is_stop = jnp.zeros((vocab,), bool).at[jnp.asarray(config.stop_token_ids)].set(True)
        out = jnp.where(is_stop[None, :] & (step < config.min_new_tokens), neg_inf, out)
    top_values = None
    if config.top_k > 0 and config.top_k < vocab:
        top_values = jax.lax.top_k(out, config.top_k)[0]  # [R, k], descending
        out = jnp.where(out < top_values[:, -1:], neg_inf, out)
    if config.top_p < 1.0:
        # Sorted candidates: only the k survivors when top-k ran (cheap), else the whole vocabulary.
        ordered = top_values if top_values is not None else -jnp.sort(-out, axis=-1)
        probs = jax.nn.softmax(ordered, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely candidates
        keep_count = jnp.sum(mass_before < config.top_p, axis=-1, keepdims=True)  # >= 1
        cutoff = jnp.take_along_axis(ordered, keep_count - 1, axis=-1)
        out = jnp.where(out < cutoff, neg_inf, out)
    return out


# Inverse-CDF draws: vocabulary split into blocks of this many tokens (see `draw_from_weights`).
_CDF_BLOCK = 256


def _inclusive_cumsum(x: Array) -> Array:
    """Cumulative sum over the last (short) axis as a matmul with a triangular matrix.

    XLA:CPU lowers `jnp.cumsum` to a slow scan; a [..., n] @ [n, n] product is fast everywhere.
    HIGHEST precision: TPU/GPU default matmul precision (bf16 / tf32) would blur the CDF.
    """
    n = x.shape[-1]
    return jnp.dot(x, jnp.triu(jnp.ones((n, n), x.dtype)), precision=jax.lax.Precision.HIGHEST)


def _argmax(x: Array) -> Array:
    """First index of the row maximum: x [R, V] -> [R] int32.

    Two plain reductions instead of `jnp.argmax`, whose (value, index) reduction XLA:CPU does not
    vectorise (it cost more than a whole sampling step over a 50k vocabulary).
    """
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    first = jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1)  # a NaN row (never equal to its max) stays in range


def _first_above(cdf: Array, target: Array, mass: Array) -> Array:
    """Per row, the first index with cdf > target and positive mass; if rounding leaves none, the
    last index with positive mass. cdf, mass [R, n]; target [R] -> [R] int32.

    Requiring positive mass makes it impossible to pick a token whose probability is exactly 0
    (top-k / top-p / min-tokens exclusions), whatever the rounding of the cumulative sums.
    """
    hit = (cdf > target[:, None]) & (mass > 0)
    last_positive = mass.shape[-1] - 1 - jnp.argmax((mass > 0)[:, ::-1], axis=-1)
    return jnp.where(hit.any(axis=-1), jnp.argmax(hit, axis=-1), last_positive).astype(jnp.int32)


def draw_from_weights(weights: Array, uniforms: Array) -> Array:
    """Exact categorical draw with probabilities proportional to weights [R, V] (>= 0, finite, some
    positive per row), by inverse CDF; uniforms [R] in [0, 1) -> token ids [R] int32. Tokens of
    weight 0 are never drawn.

    One uniform per row instead of V Gumbel variates (which cost far more than the model's decode
    step on CPU). The CDF is built in two levels, block masses then the chosen block, so every
    cumulative sum is short (a few hundred terms: float32 rounding stays ~1e-7).
    """
    rows, vocab = weights.shape
    num_blocks = -(-vocab // _CDF_BLOCK)
    weights = jnp.pad(weights, ((0, 0), (0, num_blocks * _CDF_BLOCK - vocab)))
    blocks = weights.reshape(rows, num_blocks, _CDF_BLOCK)
    block_mass = blocks.sum(axis=-1)
    block_cdf = _inclusive_cumsum(block_mass)
    target = uniforms * block_cdf[:, -1]
    block = _first_above(block_cdf, target, block_mass)
    mass_before_block = (jnp.take_along_axis(block_cdf, block[:, None], axis=1)
                         - jnp.take_along_axis(block_mass, block[:, None], axis=1))[:, 0]
    in_block = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [R, block]
    offset = _first_above(_inclusive_cumsum(in_block), target - mass_before_block, in_block)
    return block * _CDF_BLOCK + offset


@flax.struct.dataclass
class TokenChoice:
    """One step's choice for every row: tokens, logprobs, sampling_logprobs, each [R]."""

    tokens: Array
    logprobs: Array
    sampling_logprobs: Array


def response_uniforms(key: Array, rows: int, steps: int) -> Array:
    """The uniforms [rows, steps] in [0, 1) that drive sampling: entry (r, t) is drawn from
    fold_in(fold_in(key, r), t), so it depends on neither the batch size nor the sharding.

    Drawn once before decoding (cheap: one number per token) rather than inside the loop.
    """
    def one(row, step):
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, row), step), (), jnp.float32)

    return jax.vmap(jax.vmap(one, in_axes=(None, 0)), in_axes=(0, None))(jnp.arange(rows), jnp.arange(steps))


def _log_prob_of(logits: Array, tokens: Array, max_logit: Array, exp_sum: Array) -> Array:
    """log_softmax(logits)[tokens] from the row max [R] and sum(exp(logits - max)) [R]; the same
    arithmetic as `jax.nn.log_softmax`, without writing out the [R, V] result."""
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return picked - max_logit - jnp.log(exp_sum)


def choose_tokens(logits: Array, step: Array, uniforms: Array, config: SamplingConfig) -> TokenChoice:
    """Picks one token per row from logits [R, V] (float32) at response position `step`, using
    uniforms [R] (this step's column of `response_uniforms`)."""
    scaled = logits.astype(jnp.float32) / config.temperature
    allowed = processed_logits(scaled, step, config)
    # One exp pass over the vocabulary serves both the draw and the log-probs when nothing truncates.
    allowed_max = jnp.max(allowed, axis=-1)
    # Weights of the vocabulary padded with zeros to whole CDF blocks: padding inside the exp pass
    # saves `draw_from_weights` a separate pass that pads a copy.
    padded = jnp.pad(allowed, ((0, 0), (0, -allowed.shape[-1] % _CDF_BLOCK)), constant_values=-jnp.inf)
    weights = jnp.exp(padded - allowed_max[:, None])
    allowed_sum = weights.sum(axis=-1)
    if config.greedy:
        tokens = _argmax(allowed)
    else:
        tokens = draw_from_weights(weights, uniforms)
    if config.truncates:
        scaled_max = jnp.max(scaled, axis=-1)
        scaled_sum = jnp.exp(scaled - scaled_max[:, None]).sum(axis=-1)
        logprobs = _log_prob_of(scaled, tokens, scaled_max, scaled_sum)
    else:
        logprobs = _log_prob_of(scaled, tokens, allowed_max, allowed_sum)
    if config.greedy:
        sampling_logprobs = jnp.zeros_like(logprobs)  # a point mass
    elif config.truncates:
        sampling_logprobs = _log_prob_of(allowed, tokens, allowed_max, allowed_sum)
    else:
        sampling_logprobs = logprobs
    return TokenChoice(tokens=tokens, logprobs=logprobs, sampling_logprobs=sampling_logprobs)


# --------------------------------------------------------------------------------------------
# The decode loop.


@flax.struct.dataclass
class DecodeState:
    """Carry of the decode loop (R rows, N response slots, S cache slots).

    step []: response tokens already chosen; cache: KV cache (index = Lq + step - 1), or one per layer
    when the decode is unrolled; kv_mask [R, S];
    done [R]: row has stopped; the [R, N] buffers are filled column by column.
    """

    step: Array
    cache: KVCache | tuple[KVCache, ...]
    kv_mask: Array
    done: Array
    tokens: Array
    logprobs: Array
    sampling_logprobs: Array
    mask: Array


def _constrain(x: Array, logical_names: tuple[str | None, ...]) -> Array:
    """Pins an intermediate's sharding by logical names under the current mesh (no-op without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, sharding.logical_to_spec(logical_names, x.shape, mesh))


def _constrain_cache(cache: KVCache) -> KVCache:
    names = KV_CACHE_AXES[-cache.k.ndim:]  # a per-layer cache has no layers axis
    return cache.replace(k=_constrain(cache.k, names), v=_constrain(cache.v, names))


def _forward_last(module: CausalLM, tokens, positions, kv_mask, cache, last_index, layer_params=None):
    """Logits [B, V] at slot `last_index [B]` only: the prompt's [B, Lq, V] logits are never built.

    With `layer_params` (per-layer trees) the cache is a per-layer tuple and the layers are unrolled.
    """
    if layer_params is None:
        hidden, cache = module.transformer(tokens, positions, kv_mask, cache)
    else:
        hidden, cache = module.transformer.unrolled(tokens, positions, kv_mask, cache, layer_params)
    last_hidden = jnp.take_along_axis(hidden, last_index[:, None, None], axis=1)
    return module.project(last_hidden)[:, 0], cache


def _record(state: DecodeState, choice: TokenChoice, config: SamplingConfig) -> DecodeState:
    """Writes the step's choice into column `state.step` (masked for rows already done)."""
    active = ~state.done
    pad = jnp.asarray(config.pad_token_id, jnp.int32)
    tokens = jnp.where(active, choice.tokens, pad)
    is_stop = jnp.zeros_like(active)
    for stop_id in config.stop_token_ids:
        is_stop |= tokens == stop_id

    def put(buffer, column):
        return jax.lax.dynamic_update_slice(buffer, column[:, None].astype(buffer.dtype), (0, state.step))

    zero = jnp.zeros((), jnp.float32)
    return state.replace(
        step=state.step + 1,
        done=state.done | (active & is_stop),
        tokens=put(state.tokens, tokens),
        logprobs=put(state.logprobs, jnp.where(active, choice.logprobs, zero)),
        sampling_logprobs=put(state.sampling_logprobs, jnp.where(active, choice.sampling_logprobs, zero)),
        mask=put(state.mask, active.astype(jnp.int32)),
    )


def validate_inputs(model: CausalLM, config: SamplingConfig, prompt_shape: tuple[int, ...],
                    mask_shape: tuple[int, ...]) -> None:
    """Shape and id checks that need no device data (run before anything compiles)."""
    mc = model.config
    if len(prompt_shape) != 2:
        raise ValueError(f"prompt_tokens must be [batch, prompt_length], got shape {tuple(prompt_shape)}")
    if tuple(mask_shape) != tuple(prompt_shape):
        raise ValueError(
            f"prompt_mask shape {tuple(mask_shape)} must equal prompt_tokens shape {tuple(prompt_shape)}")
    if prompt_shape[1] < 1:
        raise ValueError("prompt_tokens has length 0: every row needs at least one real prompt token")
    for name, ids in (("pad_token_id", (config.pad_token_id,)), ("stop_token_ids", config.stop_token_ids)):
        bad = [t for t in ids if t >= mc.vocab_size]
        if bad:
            raise ValueError(f"sampling.{name} {bad} outside the model vocabulary (vocab_size={mc.vocab_size})")
    if len(set(config.stop_token_ids)) >= mc.vocab_size:
        raise ValueError("sampling.stop_token_ids covers the whole vocabulary: nothing else can be sampled")
    total = prompt_shape[1] + config.max_new_tokens
    if mc.family == "gpt2" and total > mc.max_position_embeddings:
        raise ValueError(
            f"prompt length {prompt_shape[1]} + sampling.max_new_tokens {config.max_new_tokens} = {total} "
            f"exceeds model.max_position_embeddings={mc.max_position_embeddings} (learned positions); "
            f"shorten the prompts or the responses")


def sample(params: Any, prompt_tokens: Array, prompt_mask: Array, key: Array, *, model: CausalLM,
           config: SamplingConfig) -> SampleOutput:
    """Samples `config.num_samples` responses per left-padded prompt. Pure and jittable.

    params: the CausalLM parameter tree; prompt_tokens, prompt_mask [B, Lq] (left-padded, every row
    with at least one real token); key: a typed PRNG key. Returns a SampleOutput with R = B * n rows.
    """
    validate_inputs(model, config, prompt_tokens.shape, prompt_mask.shape)
    mc = model.config
    batch, prompt_len = prompt_tokens.shape
    n, new = config.num_samples, config.max_new_tokens
    slots = prompt_len + new - 1
    prompt_tokens = prompt_tokens.astype(jnp.int32)
    prompt_mask = prompt_mask.astype(jnp.int32)

    # Prefill once per prompt (not per sample), into slots [0, Lq) of the cache.
    cache = _constrain_cache(init_cache(mc, batch, slots, config.cache_dtype))
    kv_mask = jnp.concatenate([prompt_mask, jnp.zeros((batch, new - 1), jnp.int32)], axis=1)
    logits, cache = model.apply({"params": params}, prompt_tokens, positions_from_mask(prompt_mask), kv_mask,
                                cache, last_token_index(prompt_mask), method=_forward_last)
    if n > 1:
        def repeat(x, axis=0):
            return jnp.repeat(x, n, axis=axis)

        prompt_tokens, prompt_mask, kv_mask, logits = map(repeat, (prompt_tokens, prompt_mask, kv_mask, logits))
        cache = _constrain_cache(cache.replace(k=repeat(cache.k, 1), v=repeat(cache.v, 1)))
    rows = batch * n
    prompt_lengths = prompt_mask.sum(axis=-1)
    unroll = config.unroll_layers if config.unroll_layers is not None else jax.default_backend() == "cpu"
    layer_params = split_layer_params(params) if unroll else None
    if unroll:
        cache = tuple(_constrain_cache(layer) for layer in split_cache(cache))
    uniforms = _constrain(response_uniforms(key, rows, new), ("batch", "length"))

    def choose(logits: Array, step: Array) -> TokenChoice:
        column = jax.lax.dynamic_index_in_dim(uniforms, step, axis=1, keepdims=False)
        return choose_tokens(logits, step, column, config)

    def zeros(dtype):
        return _constrain(jnp.zeros((rows, new), dtype), ("batch", "length"))

    state = DecodeState(
        step=jnp.zeros((), jnp.int32), cache=cache, kv_mask=kv_mask,
        done=jnp.zeros((rows,), bool), tokens=zeros(jnp.int32) + config.pad_token_id,
        logprobs=zeros(jnp.float32), sampling_logprobs=zeros(jnp.float32), mask=zeros(jnp.int32))
    state = _record(state, choose(logits, state.step), config)

    def keep_going(state: DecodeState) -> Array:
        return (state.step < new) & ~jnp.all(state.done)

    def decode_one(state: DecodeState) -> DecodeState:
        # Feed the token chosen last step into slot Lq + step - 1, at position prompt_len + step - 1.
        previous = jax.lax.dynamic_slice_in_dim(state.tokens, state.step - 1, 1, axis=1)
        slot = prompt_len + state.step - 1
        kv_mask = jax.lax.dynamic_update_slice(state.kv_mask, jnp.ones((rows, 1), jnp.int32), (0, slot))
        positions = (prompt_lengths + state.step - 1)[:, None]
        logits, cache = model.apply({"params": params}, previous, positions, kv_mask, state.cache,
                                    jnp.zeros((rows,), jnp.int32), layer_params, method=_forward_last)
        state = state.replace(cache=cache, kv_mask=kv_mask)
        return _record(state, choose(logits, state.step), config)

    state = jax.lax.while_loop(keep_going, decode_one, state)
    return SampleOutput(
        prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=state.tokens, logprobs=state.logprobs,
        sampling_logprobs=state.sampling_logprobs, mask=state.mask, lengths=state.mask.sum(axis=-1),
        stopped=state.done)


# --------------------------------------------------------------------------------------------
# Compiled, sharded entry point.


class Sampler:
    """`sample` jitted over a mesh: call as sampler(params, prompt_tokens, prompt_mask, key).

    Batch-major inputs and outputs are split over the batch mesh axes, params follow
    `param_shardings`, the key is replicated. One trace per input shape: `trace_count` counts them.
    """

    def __init__(self, model: CausalLM, config: SamplingConfig, mesh: Mesh, param_shardings: Any):
        self.model, self.config, self.mesh = model, config, mesh
        self.trace_count = 0
        batch = sharding.data_sharding(mesh)
        out_shardings = SampleOutput(**{f.name: batch for f in dataclasses.fields(SampleOutput)})

        def run(params, prompt_tokens, prompt_mask, key):
            self.trace_count += 1  # Python side effect: runs once per trace, never per call
            return sample(params, prompt_tokens, prompt_mask, key, model=model, config=config)

        self.jitted = jax.jit(run, in_shardings=(param_shardings, batch, batch, sharding.replicated(mesh)),
                              out_shardings=out_shardings)

    def _check(self, prompt_tokens, prompt_mask) -> None:
        validate_inputs(self.model, self.config, np.shape(prompt_tokens), np.shape(prompt_mask))
        divisor = sharding.batch_divisor(self.mesh)
        if np.shape(prompt_tokens)[0] % divisor:
            raise ValueError(
                f"prompt batch {np.shape(prompt_tokens)[0]} is not a multiple of {divisor}, the number of "
                f"ways the mesh splits the batch (data x fsdp = {dict(self.mesh.shape)}); pad the batch "
                f"or change the mesh")

    def __call__(self, params, prompt_tokens, prompt_mask, key) -> SampleOutput:
        self._check(prompt_tokens, prompt_mask)
        with sharding.mesh_context(self.mesh):
            return self.jitted(params, prompt_tokens, prompt_mask, key)

    def lower(self, params, prompt_tokens, prompt_mask, key):
        """The lowered program (for `.compile().memory_analysis()` and cost reports)."""
        self._check(prompt_tokens, prompt_mask)
        with sharding.mesh_context(self.mesh):
            return self.jitted.lower(params, prompt_tokens, prompt_mask, key)


def make_sampler(model: CausalLM, config: SamplingConfig, mesh: Mesh, param_shardings: Any) -> Sampler:
    """A compiled sampler for `model` on `mesh` (see `Sampler`)."""
    return Sampler(model, config, mesh, param_shardings)
