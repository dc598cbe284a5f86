"""The action mask of multi-turn rows in the PPO math: which tokens the policy is trained on.

A multi-turn response interleaves the policy's tokens (actions) with the environment's
(observations). The training forward reads every real token as context (`mask`); everything the
policy is trained on reads the action tokens only (`action_mask`): log-probs, KL, rewards,
advantages and the losses. Shapes: B rows, L response positions, M turns.

GAE over actions only. `gae` already skips masked positions without a zero step (a skipped position
passes the recursion's carry through), so with the action mask as its mask the value and reward of
the next *action* token are the bootstrap, as if the observation tokens were not there: exactly
GAE over each row compressed to its action tokens, scattered back. Nothing is re-implemented here.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax.ppo.gae import AdvantageEstimate, gae
from ppo_jax.ppo.shaping import shape_rewards
from ppo_jax.ppo.stats import check_same_shape

Array = jax.Array


@flax.struct.dataclass
class TrainingMasks:
    """context [B, L]: every real token (the forward's mask, observations included); actions
    [B, L]: the policy's tokens (log-probs, KL, rewards, GAE, policy, value and entropy losses)."""

    context: Array
    actions: Array


def training_masks(mask: Array, action_mask: Array) -> TrainingMasks:
    """A rollout's `mask` and `action_mask` [B, L] as the trainer's masks; an action outside the real
    tokens is dropped (so the action mask is always a subset of the context)."""
    mask, action_mask = jnp.asarray(mask), jnp.asarray(action_mask)
    check_same_shape(mask=mask, action_mask=action_mask)
    context = (mask != 0).astype(jnp.int32)
    return TrainingMasks(context=context, actions=context * (action_mask != 0).astype(jnp.int32))


def turn_rewards_at_tokens(turn_rewards: Array, turn_ends: Array, length: int) -> Array:
    """Each turn's environment reward on its last action token: turn_rewards [B, M] float,
    turn_ends [B, M] int (column of the turn's last action token, -1: no such turn) -> [B, L]."""
    turn_rewards, turn_ends = jnp.asarray(turn_rewards), jnp.asarray(turn_ends)
    check_same_shape(turn_rewards=turn_rewards, turn_ends=turn_ends)
    dtype = jnp.promote_types(turn_rewards.dtype, jnp.float32)
    rows = jnp.arange(turn_ends.shape[0])[:, None]
    at = jnp.where(turn_ends >= 0, turn_ends, length)  # past the end: dropped
    return jnp.zeros((turn_ends.shape[0], length), dtype).at[rows, at].add(turn_rewards.astype(dtype), mode="drop")


def action_rewards(scores: Array, kl: Array, action_mask: Array, kl_coef: Array | float,
                   turn_rewards: Array | None = None, turn_ends: Array | None = None) -> Array:
    """Per-token rewards [B, L] of multi-turn rows: -kl_coef * kl on every action token, the score
    [B] on the last action token (`shape_rewards` with the action mask), plus each turn's
    environment reward on the turn's last action token when given; 0 on observations and padding."""
    rewards = shape_rewards(scores, kl, action_mask, kl_coef)
    if turn_rewards is None:
        return rewards
    placed = turn_rewards_at_tokens(turn_rewards, turn_ends, rewards.shape[1])
    return rewards + jnp.where(jnp.asarray(action_mask) != 0, placed, 0).astype(rewards.dtype)


def action_gae(rewards: Array, values: Array, action_mask: Array, gamma: float = 1.0,
               lam: float = 0.95) -> AdvantageEstimate:
    """GAE over the action tokens only: rewards, values, action_mask [B, L] -> advantages and
    returns [B, L], 0 on observations and padding (whatever rewards or values hold there)."""
    return gae(rewards, values, action_mask, gamma=gamma, lam=lam)
