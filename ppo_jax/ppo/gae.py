"""Generalised advantage estimation (Schulman et al. 2016) over padded response tokens.

Conventions
  B batch (episodes), L response positions. `mask [B, L]` is 1 on real response tokens (up to and
  including the stop token) and 0 elsewhere.

The recursion runs backwards over positions with `lax.scan(reverse=True)`:
  delta_t = r_t + gamma * V_next - V_t
  A_t     = delta_t + gamma * lam * A_next
where "next" means the next *real* position of the same row. A masked position neither contributes
(its advantage is 0 and it does not enter the recursion) nor bootstraps (its value is never used as
V_next). The last real token bootstraps from 0: an episode that stops is terminal, and a row that
never stops is truncated at L without a value bootstrap (the reference PPO-for-LLM recipe; missing
stop tokens are handled on the score instead, see `rewards.process_scores`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax.ppo.stats import check_same_shape

Array = jax.Array


@flax.struct.dataclass
class AdvantageEstimate:
    """advantages [B, L] and returns [B, L] (both 0 on padding). Unpacks like a tuple:
    `advantages, returns = gae(...)`."""

    advantages: Array
    returns: Array

    def __iter__(self):
        return iter((self.advantages, self.returns))


def gae(rewards: Array, values: Array, mask: Array, gamma: float = 1.0,
        lam: float = 0.95) -> AdvantageEstimate:
    """GAE advantages and returns (= advantages + values) for `[B, L]` rewards, values and mask.

    Args:
      rewards: [B, L] per-token rewards (already shaped: -beta*KL plus the score at the last token).
      values:  [B, L] value predictions V(s_t) for the state before each response token.
      mask:    [B, L] 1 on real response tokens.
      gamma, lam: discount and GAE lambda (Python floats or scalar arrays).
    Returns:
      AdvantageEstimate(advantages [B, L], returns [B, L]), float32, zero on masked positions.
    """
    rewards, values, mask = jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask)
    shape = check_same_shape(rewards=rewards, values=values, mask=mask)
    if len(shape) != 2:
        raise ValueError(f"gae expects [B, L] arrays, got rewards of shape {shape}")
    dtype = jnp.promote_types(jnp.result_type(rewards, values), jnp.float32)
    real = mask != 0
    gamma = jnp.asarray(gamma, dtype)
    lam = jnp.asarray(lam, dtype)

    def step(carry, inputs):
        next_value, next_advantage = carry  # of the next real position; 0 past the row's end
        reward, value, is_real = inputs
        delta = reward + gamma * next_value - value
        advantage = delta + gamma * lam * next_advantage
        # A masked position passes the carry through untouched: it is skipped, not a zero step.
        carry = (jnp.where(is_real, value, next_value), jnp.where(is_real, advantage, next_advantage))
        return carry, jnp.where(is_real, advantage, 0)

    # Scan over positions (time-major), every row in parallel.
    time_major = (
        jnp.swapaxes(rewards.astype(dtype), 0, 1),
        jnp.swapaxes(values.astype(dtype), 0, 1),
        jnp.swapaxes(real, 0, 1),
    )
    zeros = jnp.zeros(shape[:1], dtype)
    _, advantages = jax.lax.scan(step, (zeros, zeros), time_major, reverse=True)
    advantages = jnp.swapaxes(advantages, 0, 1)
    returns = jnp.where(real, advantages + values.astype(dtype), 0)
    return AdvantageEstimate(advantages=advantages, returns=returns)


def discounted_returns(rewards: Array, mask: Array, gamma: float = 1.0) -> Array:
    """G_t = sum over later real positions s >= t of gamma^(k) r_s (k counts real positions between),
    [B, L] -> [B, L], 0 on padding. GAE with V = 0 and lam = 1."""
    rewards = jnp.asarray(rewards)
    return gae(rewards, jnp.zeros_like(rewards), mask, gamma=gamma, lam=1.0).advantages
