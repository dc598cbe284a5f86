"""PPO losses over padded response tokens, token-weighted so that microbatches add up exactly.

Conventions
  B batch, L response positions, V vocabulary; `mask [B, L]` is 1 on real response tokens.

Reduction. Every loss is  sum over this call's real tokens of the per-token loss / num_tokens.
`num_tokens` defaults to this call's own token count (a plain token mean). For gradient accumulation
pass the token count of the whole minibatch (all microbatches, all devices): the microbatch losses
(and their gradients) then add up to the full-minibatch loss exactly, however unevenly the real
tokens fall into microbatches. `num_tokens` may also be per token, [B, L]: each token's own
denominator (the other loss aggregations, `ppo/aggregation.py`); the loss is then sum(l / d).

Metrics. Every loss returns `(loss, metrics)`; each metric is a `stats.SumCount` (token sum and token
count over this call's real tokens, independent of num_tokens) or a `stats.Moments` (adds a sum of
squares, for a variance). Pool microbatches with `stats.add_metrics` (or `+`, or `jax.lax.psum`
inside shard_map) and read them once with `stats.finalize_metrics`, which gives token means (and
`<key>_var` for Moments). Names:
  policy_loss:  policy_loss (mean per-token clipped loss), clipfrac, dual_clipfrac (only with
                dual_clip), approxkl (mean of 0.5 * log_ratio^2), ratio (Moments -> ratio, ratio_var)
  value_loss:   value_loss, value_clipfrac, values (mean prediction)
  entropy_loss: entropy
  kl_loss:      kl_loss
  dense_kl_loss: dense_kl
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ppo_jax.ppo.kl import kl_penalty
from ppo_jax.ppo.stats import Moments, SumCount, check_same_shape, masked_count, masked_sum

Array = jax.Array


def token_normalised(per_token: Array, mask: Array, num_tokens: Array | float | None) -> Array:
    """sum(per_token over real tokens) / num_tokens (default: the real-token count), 0 if empty;
    num_tokens [B, L] (per-token denominators, `ppo/aggregation.py`): sum(per_token / num_tokens)."""
    if num_tokens is not None and jnp.ndim(num_tokens):
        return masked_sum(per_token / jnp.maximum(jnp.asarray(num_tokens, per_token.dtype), 1), mask)
    total = masked_sum(per_token, mask)
    denominator = masked_count(per_token, mask) if num_tokens is None else jnp.asarray(num_tokens,
                                                                                       total.dtype)
    return total / jnp.maximum(denominator, 1)


def ratio_metrics(per_token: Array, clipped: Array, log_ratio: Array, ratio: Array, mask: Array) -> dict:
    """The metrics every policy objective reports: its per-token loss, where its clip binds, the
    approximate KL 0.5 * log_ratio^2 and the ratio it clips (Moments: mean and variance)."""
    return dict(policy_loss=SumCount.of(per_token, mask), clipfrac=SumCount.of(clipped, mask),
                approxkl=SumCount.of(0.5 * jnp.square(log_ratio), mask), ratio=Moments.of(ratio, mask, shift=1.0))


def _as_float(*arrays: Array) -> list[Array]:
    dtype = jnp.promote_types(jnp.result_type(*arrays), jnp.float32)
    return [jnp.asarray(a).astype(dtype) for a in arrays]


def policy_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
                clip_eps: float = 0.2, clip_eps_high: float | None = None,
                dual_clip: float | None = None,
                num_tokens: Array | float | None = None) -> tuple[Array, dict]:
    """Clipped surrogate policy loss (Schulman et al. 2017), with asymmetric and dual clip options.

    Per token, with ratio = exp(logp - old_logp) and A the advantage:
      loss = max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))
    and with dual_clip = c > 1 (Ye et al. 2020), for A < 0 the loss is also capped at -A * c, so a
    huge ratio on a negative-advantage token cannot blow up the update.

    Args:
      logp:       [B, L] log-probs of the sampled tokens under the current policy (differentiated).
      old_logp:   [B, L] log-probs at rollout time (treated as constants).
      advantages: [B, L] (treated as constants).
      mask:       [B, L] 1 on real tokens.
      clip_eps:   epsilon (the lower one when clip_eps_high is set).
      clip_eps_high: upper epsilon ("clip-higher"); defaults to clip_eps.
      dual_clip:  the constant c > 1 of dual clip, or None.
      num_tokens: the loss normaliser (see module docstring); default: mask.sum().
    Returns:
      (loss [], metrics) — see the module docstring for the metric names.
    """
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if not (0 < clip_eps < 1):
        raise ValueError(f"clip_eps must be in (0, 1) (the ratio is clipped to [1 - clip_eps, ...]), "
                         f"got {clip_eps}")
    if not clip_eps_high > 0:
        raise ValueError(f"clip_eps_high must be > 0, got {clip_eps_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be None or a constant > 1 (e.g. 3.0), got {dual_clip}")
    check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    logp, old_logp, advantages = _as_float(logp, old_logp, advantages)
    old_logp = jax.lax.stop_gradient(old_logp)
    advantages = jax.lax.stop_gradient(advantages)

    log_ratio = logp - old_logp
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps_high)
    per_token = jnp.maximum(unclipped, clipped)
    metrics = {}
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_binds = (advantages < 0) & (per_token > cap)
        per_token = jnp.where(dual_binds, cap, per_token)
        metrics["dual_clipfrac"] = SumCount.of(dual_binds, mask)

    metrics.update(ratio_metrics(per_token, clipped > unclipped, log_ratio, ratio, mask))
    return token_normalised(per_token, mask, num_tokens), metrics


def value_loss(values: Array, old_values: Array, returns: Array, mask: Array, *,
               clip_range: float | None = 0.2,
               num_tokens: Array | float | None = None) -> tuple[Array, dict]:
    """Clipped value loss 0.5 * max((v - R)^2, (v_clipped - R)^2), v_clipped = old + clip(v - old).

    values [B, L] (differentiated), old_values [B, L] and returns [B, L] (constants), mask [B, L].
    clip_range=None disables clipping (0.5 * (v - R)^2). Returns (loss [], metrics).
    """
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"clip_range (value clipping) must be None or > 0, got {clip_range}")
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    values, old_values, returns = _as_float(values, old_values, returns)
    old_values = jax.lax.stop_gradient(old_values)
    returns = jax.lax.stop_gradient(returns)

    unclipped = jnp.square(values - returns)
    if clip_range is None:
        per_token = 0.5 * unclipped
        value_clipped = jnp.zeros(values.shape, bool)
    else:
        # clip(v, old - c, old + c) is v itself inside the range (old + clip(v - old) may round).
        clipped_values = jnp.clip(values, old_values - clip_range, old_values + clip_range)
        clipped = jnp.square(clipped_values - returns)
        per_token = 0.5 * jnp.maximum(unclipped, clipped)
        value_clipped = clipped > unclipped
    loss = token_normalised(per_token, mask, num_tokens)
    metrics = dict(
        value_loss=SumCount.of(per_token, mask),
        value_clipfrac=SumCount.of(value_clipped, mask),
        values=SumCount.of(values, mask),
    )
    return loss, metrics


def entropy_from_logits(logits: Array, mask: Array | None = None) -> Array:
    """Per-token entropy of softmax(logits), [B, L, V] -> [B, L] float32, 0 on masked positions.

    Computed from log_softmax (no exp of raw logits, no log of underflowed probabilities), so it is
    stable for large vocabularies and logits; -inf logits (banned tokens) contribute 0.
    """
    logits = jnp.asarray(logits)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    probs = jnp.exp(log_probs)
    # p * log p -> 0 as p -> 0; the inner where keeps -inf out of the product (and its gradient).
    safe_log_probs = jnp.where(probs > 0, log_probs, 0)
    entropy = -jnp.sum(probs * safe_log_probs, axis=-1)
    if mask is None:
        return entropy
    check_same_shape(logits_without_vocab=entropy, mask=jnp.asarray(mask))
    return jnp.where(jnp.asarray(mask) != 0, entropy, 0)


def entropy_loss(logits: Array, mask: Array, *,
                 num_tokens: Array | float | None = None) -> tuple[Array, dict]:
    """Negative token-mean entropy: add `entropy_coef * loss` to the total loss to reward exploration.

    logits [B, L, V], mask [B, L]. Returns (loss [] = -sum(H) / num_tokens, {"entropy": SumCount}).
    """
    entropy = entropy_from_logits(logits, mask)
    return -token_normalised(entropy, mask, num_tokens), {"entropy": SumCount.of(entropy, mask)}


def kl_loss(logp: Array, ref_logp: Array, mask: Array, kind: str = "k3",
            num_tokens: Array | float | None = None) -> tuple[Array, dict]:
    """KL to the reference as a loss term (for KL kept out of the reward), token-normalised.

    logp [B, L] (differentiated), ref_logp [B, L] (constant), mask [B, L]; kind "k1" | "k2" | "k3".
    Note: the gradient of k1 is grad(logp), zero in expectation on-policy, so k1 does not pull the
    policy toward the reference as a loss; k2 and k3 do (k3 is the usual choice, as in GRPO).
    Returns (loss [], {"kl_loss": SumCount}).
    """
    check_same_shape(logp=logp, ref_logp=ref_logp, mask=mask)
    per_token = kl_penalty(logp, jax.lax.stop_gradient(jnp.asarray(ref_logp)), kind)
    return token_normalised(per_token, mask, num_tokens), {"kl_loss": SumCount.of(per_token, mask)}


def dense_kl_loss(logits: Array, ref_logits: Array, mask: Array,
                  num_tokens: Array | float | None = None) -> tuple[Array, dict]:
    """The exact KL(pi || pi_ref) over the whole vocabulary at each visited position, token-normalised.

    logits [B, L, V] (differentiated), ref_logits [B, L, V] (constant), mask [B, L].
    Per position: sum_v pi(v) (log pi(v) - log pi_ref(v)).

    Why beside the sampled-token estimators: they see one token per position. Where the reference
    is nearly certain (it stops, or ends the sentence, with p ~ 1) the sampled token is that token,
    whose log-ratio barely moves while the policy moves mass onto the rest of the vocabulary
    (p 0.9999 -> 0.99 is a log-ratio of 0.01, a KL of about 0.035 nats). This term sees all of it and
    pulls the mass back at every visited position, every update.
    Returns (loss [], {"dense_kl": SumCount}).
    """
    check_same_shape(logits=logits, ref_logits=ref_logits)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ref_logp = jax.nn.log_softmax(jax.lax.stop_gradient(ref_logits).astype(jnp.float32), axis=-1)
    per_token = jnp.sum(jnp.exp(logp) * (logp - ref_logp), axis=-1)
    return token_normalised(per_token, mask, num_tokens), {"dense_kl": SumCount.of(per_token, mask)}
