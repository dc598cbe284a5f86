"""Rollout corrections: how the update corrects for a batch sampled by other weights or other numerics
than the ones it trains (`ppo.off_policy_ratio`), and the metrics that say how far apart they are.

Two things can make the sampler's distribution pi_behaviour differ from the trainer's pi_train (the
recomputed log-probs of the weights about to be updated): staleness (rollout.off_policy_steps = k:
the batch was sampled k updates ago) and numerics (a bf16 sampler, another mesh layout, top-k / top-p
truncation). Per token the log ratio is log w_t = log pi_train(y_t) - log pi_behaviour(y_t)
(numerator: the trainer's; denominator: the distribution the token was drawn from).

    "" (none)               ratio to pi_train, no weight: the batch treated as on-policy
    behaviour               ratio to pi_behaviour itself: PPO's clip bounds the step from the sampler
    truncated_is            token TIS: weight min(w_t, cap) per token (Yao et al. 2025's TIS; IMPALA's
                            truncated policy-gradient weight; decoupled PPO's behaviour weight, capped)
    sequence_truncated_is   sequence TIS: weight min(prod_t w_t, cap) on every token of the row
    masked_is               token MIS: weight w_t where 1/cap <= w_t <= cap, else 0 (the token dropped)
    sequence_masked_is      sequence MIS: weight prod_t w_t on every token of a row whose product is in
                            [1/cap, cap]; rows outside are dropped whole
    auto                    none on-policy; off-policy (k >= 1) truncated_is, sequence_truncated_is for
                            GSPO's sequence-level objective (docs/off_policy.md: which reference does what)

Every weighting correction keeps the PPO ratio to pi_train (ratio exactly 1 on the first minibatch)
and multiplies each token's advantage by its weight, a constant of the update (no gradient). The
weight is >= 0, so weighting the advantage weights the token's clipped (and dual-clipped) policy loss;
the value targets, the KL term and the entropy are not weighted.

Shapes: B rows, Lr response length.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ppo_jax import ppo

Array = jax.Array

# ppo.off_policy_ratio's corrections that weight the policy gradient (the others: "" and "behaviour").
WEIGHTING = ("truncated_is", "sequence_truncated_is", "masked_is", "sequence_masked_is")
CORRECTIONS = ("behaviour",) + WEIGHTING
# ppo.off_policy_ratio: "auto" (off-policy truncated_is, on-policy none), "none", or one of CORRECTIONS.
OFF_POLICY_RATIOS = ("auto", "none") + CORRECTIONS


def off_policy_ratio(setting: str, off_policy_steps: int, policy_objective: str = "ppo") -> str:
    """ppo.off_policy_ratio -> the correction the steps apply ("" = none). "auto" is no correction
    on-policy, and off-policy the one docs/off_policy.md recommends: token TIS (the first minibatch's
    ratio stays 1, the staleness goes into capped weights; `behaviour` would start the ratio at
    pi_train / pi_sampler, e.g. the kept mass under top-k, where PPO's clip stops the gradient of
    negative advantages), or sequence TIS for GSPO, whose one clipped ratio per response takes one
    weight per response."""
    if setting == "auto":
        if not off_policy_steps:
            return ""
        return "sequence_truncated_is" if policy_objective == "gspo" else "truncated_is"
    return "" if setting == "none" else setting


@dataclasses.dataclass(frozen=True)
class Correction:
    """What the experience step takes from a correction."""

    ratio_logprobs: Array  # [B, Lr] the PPO ratio's denominator (log-probs), 0 off the mask
    pg_weights: Array  # [B, Lr] each token's policy-gradient weight (1: none), a constant of the update
    metrics: dict[str, Array]


@dataclasses.dataclass(frozen=True)
class Weights:
    """A weighting correction's weights and which tokens it changed."""

    weights: Array  # [B, Lr]
    truncated: Array  # [B, Lr] bool: the weight was capped (TIS)
    dropped: Array  # [B, Lr] bool: the weight was set to 0 (MIS)


def importance_weights(kind: str, log_w: Array, cap: float) -> Weights:
    """log_w [B, Lr]: log(pi_train / pi_behaviour) per token, 0 off the mask -> the weights of
    correction `kind` (one of WEIGHTING). Sequence kinds use the row's summed log ratio (the ratio of
    the sequence's probabilities) for every token of the row."""
    if kind.startswith("sequence_"):
        log_w = jnp.broadcast_to(log_w.sum(-1, keepdims=True), log_w.shape)
    ratio = jnp.exp(log_w)  # may be inf for a long sequence: min() caps it, where() drops it (never inf * 0)
    none = jnp.zeros(ratio.shape, bool)
    if kind.endswith("truncated_is"):
        return Weights(jnp.minimum(ratio, cap), ratio > cap, none)
    keep = (ratio >= 1.0 / cap) & (ratio <= cap)
    return Weights(jnp.where(keep, ratio, 0.0), none, ~keep)


def mismatch_kl(log_w: Array, mask: Array) -> Array:
    """[] the masked mean of the k3 estimate of KL(pi_behaviour || pi_train) per token, under the
    behaviour's samples: exp(log_w) - 1 - log_w >= 0 (expm1: no cancellation near 0)."""
    return ppo.masked_mean(jnp.expm1(log_w) - log_w, mask)


def off_policy_correction(kind: str, cap: float, logp: Array, behaviour_logp: Array, mask: Array) -> Correction:
    """The correction `kind` ("" for none, or one of CORRECTIONS) of a batch: logp [B, Lr] the
    trainer's recomputed log-probs (the weights about to be updated), behaviour_logp [B, Lr] the
    sampler's (of the distribution sampled), mask [B, Lr] float. Metrics: `rollout/mismatch_kl`
    always; with a correction the per-token ratio's mean and max; with a weighting one the shares of
    tokens truncated and dropped."""
    log_w = (logp - behaviour_logp) * mask
    metrics = {"rollout/mismatch_kl": mismatch_kl(log_w, mask)}
    ones = jnp.ones_like(logp)
    if not kind:
        return Correction(logp, ones, metrics)
    ratio = jnp.exp(log_w)
    metrics.update({"off_policy/is_weight_mean": ppo.masked_mean(ratio, mask),
                    "off_policy/is_weight_max": (ratio * mask).max()})
    if kind == "behaviour":
        return Correction(behaviour_logp * mask, ones, metrics)
    w = importance_weights(kind, log_w, cap)
    metrics.update({"rollout/truncated_frac": ppo.masked_mean(w.truncated.astype(jnp.float32), mask),
                    "rollout/masked_frac": ppo.masked_mean(w.dropped.astype(jnp.float32), mask)})
    if kind.startswith("sequence_"):
        metrics.update(sequence_weight_metrics(w.weights, mask))
    return Correction(logp, jax.lax.stop_gradient(w.weights * mask), metrics)


def sequence_weight_metrics(weights: Array, mask: Array) -> dict[str, Array]:
    """`off_policy/sequence_weight_mean` / `_min` / `_max`: the weight a sequence-level correction gives
    each row (the same on every token of the row: capped, or 0 where the row is dropped), over the rows
    with a response token. weights [B, Lr], mask [B, Lr] float."""
    rows = mask.sum(-1) > 0
    row_weight = jnp.where(mask > 0, weights, 0.0).max(-1)  # the row's one weight (>= 0)
    count = jnp.maximum(rows.sum(), 1)
    return {"off_policy/sequence_weight_mean": jnp.where(rows, row_weight, 0.0).sum() / count,
            "off_policy/sequence_weight_min": jnp.where(rows.any(), jnp.where(rows, row_weight, jnp.inf).min(), 0.0),
            "off_policy/sequence_weight_max": jnp.where(rows, row_weight, 0.0).max()}


def policy_lag_metrics(step: Array, policy_version: Array | None, token_policy_version: Array | None = None,
                       mask: Array | None = None) -> dict[str, Array]:
    """`rollout/policy_lag_mean`, `rollout/policy_lag_max`: the updates between the weights that
    sampled each row (policy_version [B], the train step they were synced at) and the weights being
    updated (step []); nothing for a rollout with no version. With partial rollouts a row's tokens may
    come from several versions: token_policy_version [B, Lr] then gives each token's, and the lag is
    reduced over the tokens of `mask` [B, Lr] (the action tokens)."""
    if token_policy_version is not None:
        mask = mask.astype(jnp.float32)
        lag = (step - token_policy_version).astype(jnp.float32)
        return {"rollout/policy_lag_mean": ppo.masked_mean(lag, mask),
                # lags are >= 0 on the mask; off it a version is -1 (nothing chosen there)
                "rollout/policy_lag_max": jnp.where(mask > 0, lag, 0.0).max()}
    if policy_version is None:
        return {}
    lag = (step - policy_version).astype(jnp.float32)
    return {"rollout/policy_lag_mean": lag.mean(), "rollout/policy_lag_max": lag.max()}
