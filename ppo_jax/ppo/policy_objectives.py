"""Policy objectives beside PPO's clipped token ratio (`losses.policy_loss`): GSPO's sequence ratio and
CISPO's clipped, stopped importance weight. (KL-Cov, the covariance-selected KL penalty, is entropy
control: `ppo/entropy_control.py`.)

Each is a per-token loss l_it over the real tokens, reduced like every loss here: sum(l / num_tokens)
(`losses.token_normalised`; num_tokens [] or per token [B, L], `ppo/aggregation.py`), so microbatches
add up to the minibatch. Each returns (loss [], metrics) with the metrics of `losses.ratio_metrics`
(policy_loss, clipfrac, approxkl, ratio: the ratio the objective clips).

Conventions: B rows (or packed rows), L positions; logp [B, L] differentiated, old_logp and
advantages [B, L] constants, mask [B, L] 1 on the tokens trained on; segment_ids [B, L] for packed
rows (`ppo/sequences.py`), None for padded ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ppo_jax.ppo.losses import ratio_metrics, token_normalised
from ppo_jax.ppo.sequences import sequence_mean
from ppo_jax.ppo.stats import check_same_shape

Array = jax.Array

# ppo.policy_objective: "ppo" is `losses.policy_loss`; "kl_cov" is `entropy_control.kl_cov_loss`.
OBJECTIVES = ("ppo", "gspo", "gspo_token", "cispo", "kl_cov")


def _float_constants(logp, old_logp, advantages, mask):
    check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    dtype = jnp.promote_types(jnp.result_type(logp, old_logp, advantages), jnp.float32)
    mask = jnp.asarray(mask).astype(dtype)
    return (jnp.asarray(logp).astype(dtype), jax.lax.stop_gradient(jnp.asarray(old_logp).astype(dtype)),
            jax.lax.stop_gradient(jnp.asarray(advantages).astype(dtype)), mask)


def gspo_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *, clip_eps: float,
              clip_eps_high: float | None = None, token_level: bool = False, segment_ids: Array | None = None,
              num_tokens: Array | float | None = None) -> tuple[Array, dict]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), eq. (5)-(7), and GSPO-token,
    eq. (13)-(14).

    The length-normalised sequence ratio of sequence i (eq. 7)
        s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|) = exp(mean over its tokens of logp - old_logp)
    is clipped per sequence:  l_it = -min(s_i A_it, clip(s_i, 1 - eps, 1 + eps_high) A_it)  on every
    token of the sequence; with one advantage per sequence and the sequence_mean aggregation this is
    eq. (5), -(1/G) sum_i min(s_i A_i, clip(s_i) A_i). Its gradient reaches every token through s_i,
    each with weight s_i / |y_i|.

    token_level (GSPO-token): s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)], equal to s_i in value, so the
    loss and the clipping are GSPO's, while each token's gradient is s_i * grad log pi(y_it) times its
    own advantage A_it (eq. 14): per-token advantages are allowed.

    clip_eps, clip_eps_high: the paper's ranges are small (3e-4 and 4e-4) because s_i is a geometric
    mean. Args and returns: see the module docstring; `ratio` reports s_i at every token.
    """
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if not (0 < clip_eps < 1) or not clip_eps_high > 0:
        raise ValueError(f"GSPO clips the sequence ratio to [1 - clip_eps, 1 + clip_eps_high]: need 0 < clip_eps < 1 "
                         f"and clip_eps_high > 0, got {clip_eps} and {clip_eps_high}")
    logp, old_logp, advantages, mask = _float_constants(logp, old_logp, advantages, mask)
    log_ratio = logp - old_logp
    sequence_log_ratio = sequence_mean(log_ratio, mask, segment_ids)  # log s_i at every token of sequence i
    if token_level:
        sequence_log_ratio = jax.lax.stop_gradient(sequence_log_ratio) + logp - jax.lax.stop_gradient(logp)
    ratio = jnp.exp(sequence_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps_high)
    per_token = jnp.maximum(unclipped, clipped)
    metrics = ratio_metrics(per_token, clipped > unclipped, log_ratio, ratio, mask)
    return token_normalised(per_token, mask, num_tokens), metrics


def cispo_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *, clip_eps_low: float,
               clip_eps_high: float, num_tokens: Array | float | None = None) -> tuple[Array, dict]:
    """CISPO (MiniMax-M1, MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with
    Lightning Attention"), eq. (4)-(5):

        J = 1 / sum_i |o_i| * sum_i sum_t sg(r_hat_it) A_it log pi(o_it),
        r_hat = clip(r, 1 - eps_low, 1 + eps_high),  r = pi / pi_old

    so l_it = -sg(r_hat_it) A_it logp_it: the importance weight is clipped and carries no gradient,
    and every token keeps the policy gradient r_hat * A * grad log pi (PPO's clip zeroes it where the
    clip binds). The paper's normaliser is token_mean. clip_eps_low >= 1 leaves no lower bound (the
    paper's choice: the ratio is > 0 anyway). `clipfrac` is the share of weights the clip changed;
    `ratio` reports r. Args and returns: see the module docstring.
    """
    if not (clip_eps_low > 0 and clip_eps_high > 0):
        raise ValueError(f"CISPO clips the weight to [1 - clip_eps_low, 1 + clip_eps_high]: both must be > 0, got "
                         f"{clip_eps_low} and {clip_eps_high}")
    logp, old_logp, advantages, mask = _float_constants(logp, old_logp, advantages, mask)
    log_ratio = logp - old_logp
    ratio = jnp.exp(log_ratio)
    weight = jnp.clip(ratio, max(1.0 - clip_eps_low, 0.0), 1.0 + clip_eps_high)
    per_token = -jax.lax.stop_gradient(weight) * advantages * logp
    metrics = ratio_metrics(per_token, weight != ratio, log_ratio, ratio, mask)
    return token_normalised(per_token, mask, num_tokens), metrics
