"""The action mask in the PPO math (ppo/action_mask.py), against plain NumPy: GAE over the policy's
tokens only is GAE over each row compressed to its action tokens, scattered back; rewards land on
action tokens only; the trainer's masks."""

import numpy as np
import pytest

from ppo_jax.ppo.action_mask import action_gae, action_rewards, training_masks, turn_rewards_at_tokens


def _numpy_gae(rewards, values, gamma, lam):
    """Textbook GAE over one contiguous episode (1-D), terminal after the last step."""
    advantages, next_value, next_advantage = np.zeros_like(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[t], next_value = next_advantage, values[t]
    return advantages


def _interleaved(seed, rows=6, length=30):
    """Rows of action runs and observation runs (then padding), with nonzero rewards and values on
    every position: whatever sits on observations and padding must not count."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, length), np.int32)
    action = np.zeros((rows, length), np.int32)
    for r in range(rows):
        end = rng.integers(length // 2, length + 1)
        mask[r, :end] = 1
        column, is_action = 0, True
        while column < end:
            run = int(rng.integers(1, 6))
            action[r, column:min(column + run, end)] = is_action
            column, is_action = column + run, not is_action
    action[0] = mask[0]  # a row without observations
    return (rng.normal(size=(rows, length)).astype(np.float32), rng.normal(size=(rows, length)).astype(np.float32),
            mask, action)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)])
def test_gae_over_action_tokens_is_gae_of_the_compressed_rows(gamma, lam):
    """Compress each row to its action tokens, run GAE, scatter back: the value and reward of the
    next action token bootstrap each action, across any observation in between."""
    rewards, values, mask, action = _interleaved(seed=int(gamma * 10 + lam * 100))
    expected_adv = np.zeros_like(rewards)
    for r in range(len(rewards)):
        at = np.flatnonzero(action[r])
        expected_adv[r, at] = _numpy_gae(rewards[r, at].astype(np.float64), values[r, at].astype(np.float64),
                                         gamma, lam)
    out = action_gae(rewards, values, action, gamma=gamma, lam=lam)
    np.testing.assert_allclose(np.asarray(out.advantages), expected_adv, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.returns), np.where(action == 1, expected_adv + values, 0), atol=1e-5)
    # Over all real tokens (observations as steps) the answer differs: the mask matters.
    assert not np.allclose(np.asarray(action_gae(rewards, values, mask, gamma=gamma, lam=lam).advantages),
                           expected_adv, atol=1e-3)


def test_rewards_land_on_action_tokens():
    """-kl_coef * kl on every action token, the score on the last action token (not the last real
    token, which may be an observation), each turn's reward on its last action token."""
    rng = np.random.default_rng(0)
    _, _, mask, action = _interleaved(seed=3, rows=4, length=20)
    action[1, mask[1].sum() - 2:] = 0  # row 1 ends with an observation
    kl = rng.normal(size=mask.shape).astype(np.float32)
    scores = np.asarray([1.0, 2.0, -1.0, 0.5], np.float32)
    turn_ends = np.full((4, 3), -1)
    turn_rewards = rng.normal(size=(4, 3)).astype(np.float32)
    expected = np.where(action == 1, -0.1 * kl, 0)
    for r in range(4):
        at = np.flatnonzero(action[r])
        expected[r, at[-1]] += scores[r]
        # A turn ends where an action run ends; the first two runs of each row are turns.
        ends = [c for c in at if c + 1 >= mask.shape[1] or action[r, c + 1] == 0][:2]
        turn_ends[r, :len(ends)] = ends
        for t, c in enumerate(ends):
            expected[r, c] += turn_rewards[r, t]
    out = np.asarray(action_rewards(scores, kl, action, 0.1, turn_rewards, turn_ends))
    np.testing.assert_allclose(out, expected, atol=1e-6)
    assert action[1, mask[1].sum() - 1] == 0 and out[1, mask[1].sum() - 1] == 0
    placed = np.asarray(turn_rewards_at_tokens(turn_rewards, turn_ends, mask.shape[1]))
    assert (turn_ends < 0).any()  # turns that did not happen: their rewards are dropped
    np.testing.assert_allclose(placed.sum(), turn_rewards[turn_ends >= 0].sum(), atol=1e-5)


def test_training_masks():
    mask = np.asarray([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    action = np.asarray([[1, 0, 0, 1, 1], [1, 1, 0, 0, 0]])  # an action on padding is dropped
    masks = training_masks(mask, action)
    np.testing.assert_array_equal(np.asarray(masks.context), mask)
    np.testing.assert_array_equal(np.asarray(masks.actions), [[1, 0, 0, 1, 0], [1, 1, 0, 0, 0]])
