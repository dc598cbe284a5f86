"""Token choice: pure functions of one decode step's logits [R, V] -> one token per row, its log-prob
under the tempered distribution and under the distribution actually sampled from (`choose_tokens`).

Randomness. Output row r draws one uniform per step from `fold_in(fold_in(key, r), step)` and turns
it into a token by inverse CDF (`response_uniforms`, `draw_from_weights`), so a row's tokens depend
only on the key, its row index and its own logits: the same key gives the same tokens on every mesh
shape, and a row's tokens do not change when other rows stop or when the batch grows.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax.sampling.config import SamplingConfig

Array = jax.Array


def processed_logits(scaled: Array, step: Array, config: SamplingConfig) -> Array:
    """Tempered logits [R, V] with disallowed tokens set to -inf (min-tokens, top-k, top-p); step: []
    (every row at the same response position) or [R] (each row's own, a slot-based decode)."""
    vocab = scaled.shape[-1]
    neg_inf = jnp.asarray(-jnp.inf, scaled.dtype)
    out = scaled
    if config.min_new_tokens > 0 and config.stop_token_ids:
        is_stop = jnp.zeros((vocab,), bool).at[jnp.asarray(config.stop_token_ids)].set(True)
        early = jnp.asarray(step)[..., None] < config.min_new_tokens  # [1] or [R, 1]
        out = jnp.where(is_stop[None, :] & early, neg_inf, out)
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
    """Picks one token per row from logits [R, V] (float32) at response position `step` ([], or [R]
    per row), using uniforms [R] (each row's entry of `response_uniforms` at that position)."""
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
