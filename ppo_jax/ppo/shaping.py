"""From reward-model scores to per-token rewards.

Conventions
  B batch, L response positions; `mask [B, L]` is 1 on real response tokens (up to and including
  the stop token), `stopped [B]` is True where the response contains a stop token.

Order of score processing in `process_scores` (why: normalisation puts the reward model on the
scale the user reasons in; clipping tames reward-model outliers; the missing-stop rule is a value the
user chose deliberately, so it is applied last and never clipped away):
  1. score = gain * score + bias
  2. score = clip(score, -clip, clip)                 if clip is set
  3. missing stop: "replace" -> score = missing_stop_value      (the -1 "EOS trick")
                   "penalty" -> score = score - missing_stop_value
                   "none"    -> unchanged
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ppo_jax.ppo.stats import last_token_index

from ppo_jax.ppo.stats import check_same_shape, masked_whiten

Array = jax.Array

MISSING_STOP_MODES = ("none", "replace", "penalty")


def process_scores(scores: Array, stopped: Array, *, missing_stop: str = "none",
                   missing_stop_value: float = -1.0, gain: float = 1.0, bias: float = 0.0,
                   clip: float | None = None) -> Array:
    """Normalise, clip and apply missing-stop handling to sequence scores. [B], [B] -> [B] float32.

    With missing_stop="replace", responses without a stop token get `missing_stop_value` as score
    (e.g. -1). With missing_stop="penalty", `missing_stop_value` is subtracted from their score, so
    pass a positive penalty (e.g. 1.0).
    """
    if missing_stop not in MISSING_STOP_MODES:
        raise ValueError(f"unknown missing_stop {missing_stop!r}; use one of "
                         f"{', '.join(MISSING_STOP_MODES)}")
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be None or > 0 (scores are clipped to [-clip, clip]), got {clip}")
    scores, stopped = jnp.asarray(scores), jnp.asarray(stopped)
    check_same_shape(scores=scores, stopped=stopped)
    if scores.ndim != 1:
        raise ValueError(f"scores must be [B], got shape {scores.shape}")
    scores = scores.astype(jnp.promote_types(scores.dtype, jnp.float32)) * gain + bias
    if clip is not None:
        scores = jnp.clip(scores, -clip, clip)
    stopped = stopped.astype(bool)
    if missing_stop == "replace":
        scores = jnp.where(stopped, scores, jnp.asarray(missing_stop_value, scores.dtype))
    elif missing_stop == "penalty":
        scores = jnp.where(stopped, scores, scores - missing_stop_value)
    return scores


def shape_rewards(scores: Array, kl: Array, mask: Array, kl_coef: Array | float) -> Array:
    """Per-token rewards: -kl_coef * kl on every real token, plus the score on the last real token.

    scores [B], kl [B, L] (per-token estimates, e.g. `kl_penalty`), mask [B, L], kl_coef scalar.
    Returns [B, L] float32, 0 on padding; a row with no real token gets nothing (its score is dropped).
    """
    scores, kl, mask = jnp.asarray(scores), jnp.asarray(kl), jnp.asarray(mask)
    check_same_shape(kl=kl, mask=mask)
    if kl.ndim != 2 or scores.shape != kl.shape[:1]:
        raise ValueError(f"shape_rewards expects scores [B] and kl, mask [B, L]; got scores "
                         f"{scores.shape}, kl {kl.shape}")
    dtype = jnp.promote_types(jnp.result_type(scores, kl), jnp.float32)
    real = mask != 0
    rewards = jnp.where(real, -jnp.asarray(kl_coef, dtype) * kl.astype(dtype), 0)
    last = last_token_index(mask)
    at_last = jnp.arange(kl.shape[1])[None, :] == last[:, None]  # all False for an empty row
    return rewards + jnp.where(at_last, scores.astype(dtype)[:, None], 0)


def whiten_rewards(rewards: Array, mask: Array, shift_mean: bool = False) -> Array:
    """Optional reward whitening over real tokens (scale only by default, as in the reference PPO
    implementations, so the sign of the mean reward survives). [B, L] -> [B, L], 0 on padding."""
    return masked_whiten(rewards, mask, shift_mean=shift_mean)


def overlong_penalty(lengths: Array, stopped: Array, *, max_length: int, buffer: int,
                     penalty: float) -> Array:
    """The soft overlong punishment of DAPO (Yu et al. 2025, §3.4): what to subtract from each score.
    lengths [B] (response tokens, the stop token included), stopped [B] -> [B] float32.

    0 up to `max_length - buffer` tokens, then rising linearly to `penalty` at `max_length`; a row cut
    at the budget without a stop token gets the whole `penalty`. Why: when only the unfinished rows are
    punished, the reward has a cliff at the budget, and a proxy that likes longer answers pulls the
    policy to its edge, where a small change of the per-token stop probability tips many rows over at
    once (docs/demo.md, "The spike"). The ramp turns the cliff into a slope the policy feels first.
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"the overlong buffer must be in 1..{max_length} tokens, got {buffer}")
    lengths = jnp.asarray(lengths, jnp.float32)
    excess = jnp.clip((lengths - (max_length - buffer)) / buffer, 0.0, 1.0)
    return penalty * jnp.where(jnp.asarray(stopped).astype(bool), excess, 1.0)
