"""Advantage estimators behind one interface: PPO's GAE and its critic-free cousins.

Conventions
  B batch, L response positions, n = group_size samples per prompt. For the group estimators the n
  samples of one prompt are n consecutive rows of the batch (rows g*n ... g*n + n - 1).

What each estimator reads (the others may be passed and are ignored):
  gae           rewards (or scores + kl + kl_coef), values, mask, gamma, lam, whiten
  grpo          scores, mask, group_size (+ kl, kl_coef when KL is in the reward), whiten
  rloo          scores, mask, group_size (+ kl, kl_coef when KL is in the reward), whiten
  reinforce_pp  rewards (or scores + kl + kl_coef), mask, gamma
Token-level estimators (gae, reinforce_pp) use `rewards [B, L]` when given — already shaped, maybe
whitened — and otherwise shape them with `rewards.shape_rewards(scores, kl, mask, kl_coef)`.
Sequence-level estimators (grpo, rloo) use the sequence reward R = score - kl_coef * sum_t kl_t
(just the score when kl is None or kl_coef is 0; pass kl=None when KL is a loss term instead).

Definitions
  gae:          `gae.gae`; advantages optionally whitened over real tokens; returns = GAE
                advantages (unwhitened) + values, the value-loss target.
  grpo:         A_i = (R_i - mean_g R) / (std_g R + 1e-4), std with Bessel's correction (n - 1), as
                in DeepSeekMath and TRL; the same A_i on every real token of row i. With
                divide_by_std=False, A_i = R_i - mean_g R: Dr. GRPO (Liu et al. 2025, "Understanding
                R1-Zero-Like Training: A Critical Perspective", eq. 3), which drops the division because
                it up-weights the groups whose rewards barely differ (too easy or too hard prompts).
  rloo:         A_i = R_i - (sum_{j != i in g} R_j) / (n - 1) (Kool et al. 2019; Ahmadian et al.
                2024); on every real token of row i.
  reinforce_pp: G_t = discounted sum of the per-token rewards from t on (REINFORCE++, Hu 2025);
                A = whiten(G) over all real tokens of the batch (always: that is the method).
  `whiten=True` whitens the final advantages over the batch's real tokens (mean 0, variance 1); for
  reinforce_pp it is already done. `whiten=None` (default) means each method's own convention:
  True for gae, False for grpo and rloo. For critic-free estimators `returns` holds the Monte-Carlo return
  (R_i on every real token for grpo/rloo, G_t for reinforce_pp): there is no value model to regress.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ppo_jax.ppo.gae import AdvantageEstimate, discounted_returns, gae
from ppo_jax.ppo.shaping import shape_rewards
from ppo_jax.ppo.stats import masked_sum, masked_whiten

Array = jax.Array

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp")
GRPO_STD_EPS = 1e-4
# What each method does when `whiten` is not given: PPO whitens GAE advantages; GRPO and RLOO are
# defined without a batch whitening (their group baseline already centres the advantages).
WHITEN_BY_DEFAULT = {"gae": True, "grpo": False, "rloo": False, "reinforce_pp": True}


def _require(name: str, **arguments) -> None:
    for argument, value in arguments.items():
        if value is None:
            raise ValueError(f"advantage estimator {name!r} needs {argument}, got None")


def _token_rewards(name, rewards, scores, kl, kl_coef, mask) -> Array:
    if rewards is not None:
        return jnp.asarray(rewards)
    _require(name, rewards_or_scores=scores, kl=kl, kl_coef=kl_coef)
    return shape_rewards(scores, kl, mask, kl_coef)


def sequence_rewards(scores: Array, mask: Array, kl: Array | None = None,
                     kl_coef: Array | float | None = None) -> Array:
    """R = score - kl_coef * sum of kl over real tokens, [B] (just the score without kl). -> [B]."""
    scores = jnp.asarray(scores)
    scores = scores.astype(jnp.promote_types(scores.dtype, jnp.float32))
    if kl is None or kl_coef is None:
        return scores
    return scores - jnp.asarray(kl_coef, scores.dtype) * masked_sum(kl, mask, axis=-1)


def _grouped(x: Array, group_size: int) -> Array:
    """[B] -> [B / n, n]; a clear error if n does not divide B."""
    if group_size is None or group_size < 2:
        raise ValueError(f"group estimators need group_size >= 2 samples per prompt, got {group_size}")
    if x.shape[0] % group_size:
        raise ValueError(f"batch of {x.shape[0]} rows is not a whole number of groups of "
                         f"group_size={group_size}; make the batch size a multiple of group_size")
    return x.reshape(-1, group_size)


def grpo_advantages(sequence_reward: Array, group_size: int, divide_by_std: bool = True) -> Array:
    """Group-normalised sequence rewards, [B] -> [B] (divide_by_std=False: centred only, Dr. GRPO)."""
    grouped = _grouped(sequence_reward, group_size)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    if not divide_by_std:
        return centred.reshape(-1)
    std = grouped.std(axis=1, ddof=1, keepdims=True)
    return (centred / (std + GRPO_STD_EPS)).reshape(-1)


def rloo_advantages(sequence_reward: Array, group_size: int) -> Array:
    """Reward minus the mean reward of the other n - 1 samples of the same prompt, [B] -> [B]."""
    grouped = _grouped(sequence_reward, group_size)
    leave_one_out = (grouped.sum(axis=1, keepdims=True) - grouped) / (group_size - 1)
    return (grouped - leave_one_out).reshape(-1)


def _broadcast_to_tokens(per_sequence: Array, mask: Array) -> Array:
    return jnp.where(jnp.asarray(mask) != 0, per_sequence[:, None], 0)


def estimate_advantages(name: str = "gae", *, rewards: Array | None = None,
                        values: Array | None = None, mask: Array, scores: Array | None = None,
                        kl: Array | None = None, kl_coef: Array | float | None = None,
                        group_size: int | None = None, gamma: float = 1.0, lam: float = 0.95,
                        whiten: bool | None = None, divide_by_std: bool = True) -> AdvantageEstimate:
    """Advantages [B, L] and returns [B, L] (0 on padding) by estimator `name` (see module doc).

    Unpacks like a tuple: `advantages, returns = estimate_advantages(...)`. divide_by_std: grpo's
    division by the group's standard deviation (False: Dr. GRPO); the other estimators ignore it.
    """
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; use one of {', '.join(ESTIMATORS)}")
    whiten = WHITEN_BY_DEFAULT[name] if whiten is None else whiten
    mask = jnp.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"mask must be [B, L], got shape {mask.shape}")

    if name == "gae":
        _require(name, values=values)
        token_rewards = _token_rewards(name, rewards, scores, kl, kl_coef, mask)
        estimate = gae(token_rewards, values, mask, gamma=gamma, lam=lam)
        advantages = estimate.advantages
        if whiten:
            advantages = masked_whiten(advantages, mask)
        return AdvantageEstimate(advantages=advantages, returns=estimate.returns)

    if name == "reinforce_pp":
        token_rewards = _token_rewards(name, rewards, scores, kl, kl_coef, mask)
        returns = discounted_returns(token_rewards, mask, gamma=gamma)
        return AdvantageEstimate(advantages=masked_whiten(returns, mask), returns=returns)

    _require(name, scores=scores)
    if jnp.shape(scores) != mask.shape[:1]:
        raise ValueError(f"scores must be [B] = {mask.shape[:1]}, got shape {jnp.shape(scores)}")
    sequence_reward = sequence_rewards(scores, mask, kl, kl_coef)
    per_sequence = (grpo_advantages(sequence_reward, group_size, divide_by_std) if name == "grpo"
                    else rloo_advantages(sequence_reward, group_size))
    advantages = _broadcast_to_tokens(per_sequence, mask)
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return AdvantageEstimate(advantages=advantages,
                             returns=_broadcast_to_tokens(sequence_reward, mask))
