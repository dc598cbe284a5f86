"""Advantage estimators (gae, grpo, rloo, reinforce_pp) vs hand-computed values and NumPy loops."""

import numpy as np
import pytest

from ppo_jax.ppo.advantages import estimate_advantages
from ppo_jax.ppo.shaping import shape_rewards

# Two prompts x three samples; rows of a group are consecutive.
SCORES = np.array([1.0, 2.0, 3.0, 0.0, 0.0, 6.0], np.float32)
LENGTHS = np.array([2, 1, 3, 1, 2, 3])
MASK = np.arange(4)[None, :] < LENGTHS[:, None]


def broadcast(per_row):
    return np.where(MASK, np.asarray(per_row, np.float64)[:, None], 0)


def test_grpo_equals_hand_computed_group_normalisation():
    # Group 1 (1, 2, 3): mean 2, sample std 1.  Group 2 (0, 0, 6): mean 2, sample std sqrt(12).
    expected = [-1 / (1 + 1e-4), 0.0, 1 / (1 + 1e-4),
                -2 / (np.sqrt(12) + 1e-4), -2 / (np.sqrt(12) + 1e-4), 4 / (np.sqrt(12) + 1e-4)]
    adv, returns = estimate_advantages("grpo", scores=SCORES, mask=MASK, group_size=3)
    np.testing.assert_allclose(adv, broadcast(expected), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(returns, broadcast(SCORES), rtol=1e-6)


def test_rloo_equals_hand_computed_leave_one_out_baseline():
    # Group 1 (1, 2, 3): baselines 2.5, 2, 1.5.  Group 2 (0, 0, 6): baselines 3, 3, 0.
    expected = [-1.5, 0.0, 1.5, -3.0, -3.0, 6.0]
    adv, _ = estimate_advantages("rloo", scores=SCORES, mask=MASK, group_size=3)
    np.testing.assert_allclose(adv, broadcast(expected), rtol=1e-6)


def test_group_estimators_subtract_kl_from_the_sequence_reward():
    kl = np.ones((6, 4), np.float32)  # one nat per real token, so sum(kl) = length
    # R = score - 0.5 * length = (0, 1.5, 1.5, -0.5, -1, 4.5)
    # RLOO baselines: (0.75+0.75, ...) -> group 1: 1.5, 0.75, 0.75; group 2: 1.75, 2, -0.75
    expected = [-1.5, 0.75, 0.75, -2.25, -3.0, 5.25]
    adv, returns = estimate_advantages("rloo", scores=SCORES, mask=MASK, kl=kl, kl_coef=0.5,
                                       group_size=3)
    np.testing.assert_allclose(adv, broadcast(expected), rtol=1e-6)
    np.testing.assert_allclose(returns, broadcast([0, 1.5, 1.5, -0.5, -1, 4.5]), rtol=1e-6)
    # GRPO on the same R: group 1 (0, 1.5, 1.5): mean 1, sample std sqrt(0.75).
    adv, _ = estimate_advantages("grpo", scores=SCORES, mask=MASK, kl=kl, kl_coef=0.5, group_size=3)
    std1 = np.sqrt(0.75) + 1e-4
    np.testing.assert_allclose(np.asarray(adv)[:3, 0], [-1 / std1, 0.5 / std1, 0.5 / std1], rtol=1e-6)


def test_group_advantages_can_be_whitened_over_real_tokens():
    adv, _ = estimate_advantages("rloo", scores=SCORES, mask=MASK, group_size=3, whiten=True)
    raw = broadcast([-1.5, 0.0, 1.5, -3.0, -3.0, 6.0])[MASK]
    np.testing.assert_allclose(np.asarray(adv)[MASK], (raw - raw.mean()) / np.sqrt(raw.var() + 1e-8),
                               rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(adv)[~MASK] == 0)


def numpy_gae(rewards, values, mask, gamma, lam):
    advantages = np.zeros(rewards.shape)
    for row in range(rewards.shape[0]):
        last, next_value = 0.0, 0.0
        for t in reversed(np.flatnonzero(mask[row])):
            delta = rewards[row, t] + gamma * next_value - values[row, t]
            last = delta + gamma * lam * last
            advantages[row, t] = last
            next_value = values[row, t]
    return advantages


def numpy_whiten(x, mask):
    real = x[mask]
    return np.where(mask, (x - real.mean()) / np.sqrt(real.var() + 1e-8), 0)


def episode_batch(seed):
    rng = np.random.default_rng(seed)
    mask = np.arange(6)[None, :] < np.array([6, 2, 4, 6, 1, 3])[:, None]
    scores = rng.normal(size=6).astype(np.float32)
    kl = np.where(mask, rng.normal(0, 0.3, (6, 6)), 0).astype(np.float32)
    values = rng.normal(size=(6, 6)).astype(np.float32)
    return scores, kl, values, mask


@pytest.mark.parametrize("whiten", [True, False])
def test_gae_estimator_whitens_advantages_and_keeps_raw_returns(whiten):
    scores, kl, values, mask = episode_batch(0)
    rewards = np.asarray(shape_rewards(scores, kl, mask, 0.1))
    adv, returns = estimate_advantages("gae", rewards=rewards, values=values, mask=mask, gamma=0.99,
                                       lam=0.9, whiten=whiten)
    raw = numpy_gae(rewards.astype(np.float64), values.astype(np.float64), mask, 0.99, 0.9)
    np.testing.assert_allclose(adv, numpy_whiten(raw, mask) if whiten else raw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(returns, np.where(mask, raw + values, 0), rtol=1e-5, atol=1e-6)
    # Without rewards it shapes them from scores, kl and kl_coef.
    adv_from_scores, _ = estimate_advantages("gae", values=values, mask=mask, scores=scores, kl=kl,
                                             kl_coef=0.1, gamma=0.99, lam=0.9, whiten=whiten)
    np.testing.assert_allclose(adv_from_scores, adv, rtol=1e-6, atol=1e-6)


def test_gae_estimator_whitens_by_default():
    scores, kl, values, mask = episode_batch(1)
    adv, _ = estimate_advantages("gae", values=values, mask=mask, scores=scores, kl=kl, kl_coef=0.1)
    assert abs(float(np.asarray(adv)[mask].mean())) < 1e-5
    np.testing.assert_allclose(np.asarray(adv)[mask].std(), 1.0, rtol=1e-4)


def test_reinforce_pp_is_batch_normalised_discounted_return_without_values():
    scores, kl, _, mask = episode_batch(2)
    beta, gamma = 0.05, 0.95
    rewards = np.zeros(mask.shape)
    for row in range(6):
        real = np.flatnonzero(mask[row])
        rewards[row, real] = -beta * kl[row, real]
        rewards[row, real[-1]] += scores[row]
    returns = np.zeros(mask.shape)
    for row in range(6):
        running = 0.0
        for t in reversed(np.flatnonzero(mask[row])):
            running = rewards[row, t] + gamma * running
            returns[row, t] = running
    adv, out_returns = estimate_advantages("reinforce_pp", mask=mask, scores=scores, kl=kl,
                                           kl_coef=beta, gamma=gamma)
    np.testing.assert_allclose(out_returns, returns, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(adv, numpy_whiten(returns, mask), rtol=1e-5, atol=1e-5)


def test_critic_free_estimators_do_not_need_values():
    for name in ("grpo", "rloo", "reinforce_pp"):
        adv, _ = estimate_advantages(name, values=None, mask=MASK, scores=SCORES,
                                     kl=np.zeros((6, 4), np.float32), kl_coef=0.1, group_size=3)
        assert np.all(np.isfinite(np.asarray(adv)))


@pytest.mark.parametrize("name, kwargs, message", [
    ("ppo", dict(), "gae, grpo, rloo, reinforce_pp"),
    ("gae", dict(scores=SCORES, kl=np.zeros((6, 4)), kl_coef=0.1), "needs values"),
    ("grpo", dict(scores=SCORES, group_size=4), "multiple of group_size"),
    ("rloo", dict(scores=SCORES, group_size=1), "group_size >= 2"),
    ("rloo", dict(group_size=3), "needs scores"),
    ("grpo", dict(scores=SCORES[:4], group_size=2), r"scores must be \[B\]"),
])
def test_estimator_errors_are_specific(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        estimate_advantages(name, mask=MASK, **kwargs)
