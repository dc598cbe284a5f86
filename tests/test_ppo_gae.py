"""GAE vs plain float64 Python loops."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from ppo_jax.ppo.gae import discounted_returns, gae


def reference_gae_padded(rewards, values, mask, gamma, lam):
    """The textbook loop of the reference PPO-for-LLM implementations: zero rewards and values on
    padding, walk back over every position, bootstrap 0 after the last position. Prefix masks only."""
    rewards = np.where(mask, rewards, 0).astype(np.float64)
    values = np.where(mask, values, 0).astype(np.float64)
    batch, length = rewards.shape
    advantages = np.zeros((batch, length))
    last_gae = np.zeros(batch)
    for t in reversed(range(length)):
        next_values = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        advantages[:, t] = last_gae
    advantages = np.where(mask, advantages, 0)
    return advantages, np.where(mask, advantages + values, 0)


def reference_gae_skipping(rewards, values, mask, gamma, lam):
    """Row by row over the real positions only (any mask, holes included)."""
    advantages = np.zeros(rewards.shape)
    for row in range(rewards.shape[0]):
        real = np.flatnonzero(mask[row])
        last_gae = 0.0
        for k in reversed(range(len(real))):
            t = real[k]
            next_value = float(values[row, real[k + 1]]) if k + 1 < len(real) else 0.0
            delta = float(rewards[row, t]) + gamma * next_value - float(values[row, t])
            last_gae = delta + gamma * lam * last_gae
            advantages[row, t] = last_gae
    returns = np.where(mask, advantages + values.astype(np.float64), 0)
    return advantages, returns


def random_episode_batch(seed, batch=12, length=10):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(0, 0.5, (batch, length)).astype(np.float32)
    values = rng.normal(0, 0.5, (batch, length)).astype(np.float32)
    lengths = rng.integers(1, length, batch)
    lengths[:3] = [length, length, 0]  # rows that never stop, an empty row; the rest end early
    mask = np.arange(length)[None, :] < lengths[:, None]
    # Padding holds garbage that must not leak in (values after the stop token are never bootstrapped).
    rewards = np.where(mask, rewards, np.nan).astype(np.float32)
    values = np.where(mask, values, 1e6).astype(np.float32)
    return rewards, values, mask


@pytest.fixture(scope="module")
def jitted_gae():
    return jax.jit(gae)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.95), (0.9, 0.5), (1.0, 1.0), (0.7, 0.0)])
def test_gae_matches_python_loop_on_rows_that_stop_early_and_never(jitted_gae, gamma, lam):
    rewards, values, mask = random_episode_batch(seed=int(gamma * 100 + lam * 10))
    advantages, returns = jitted_gae(rewards, values, mask, gamma, lam)
    ref_advantages, ref_returns = reference_gae_padded(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(advantages, ref_advantages, rtol=0, atol=1e-6)
    np.testing.assert_allclose(returns, ref_returns, rtol=0, atol=1e-6)
    assert np.all(np.asarray(advantages)[~mask] == 0)
    # The two references agree on prefix masks (a sanity check of the references themselves).
    np.testing.assert_allclose(reference_gae_skipping(rewards, values, mask, gamma, lam)[0],
                               ref_advantages, atol=1e-12)


def test_gae_skips_holes_in_the_mask(jitted_gae):
    rng = np.random.default_rng(7)
    rewards = rng.normal(0, 0.5, (8, 10)).astype(np.float32)
    values = rng.normal(0, 0.5, (8, 10)).astype(np.float32)
    mask = rng.random((8, 10)) < 0.6
    advantages, returns = jitted_gae(rewards, values, mask, 0.95, 0.9)
    ref_advantages, ref_returns = reference_gae_skipping(rewards, values, mask, 0.95, 0.9)
    np.testing.assert_allclose(advantages, ref_advantages, rtol=0, atol=1e-6)
    np.testing.assert_allclose(returns, ref_returns, rtol=0, atol=1e-6)


def test_default_gamma_lambda_are_1_and_0_95():
    rewards, values, mask = random_episode_batch(seed=3, batch=4, length=6)
    advantages, _ = gae(rewards, values, mask)
    np.testing.assert_allclose(advantages, reference_gae_padded(rewards, values, mask, 1.0, 0.95)[0],
                               atol=1e-6)


def test_discounted_returns_are_reward_to_go():
    rewards, _, mask = random_episode_batch(seed=4, batch=5, length=7)
    gamma = 0.9
    expected = np.zeros(rewards.shape)
    for row in range(rewards.shape[0]):
        for t in np.flatnonzero(mask[row]):
            later = [s for s in np.flatnonzero(mask[row]) if s >= t]
            expected[row, t] = sum(gamma ** k * float(rewards[row, s]) for k, s in enumerate(later))
    np.testing.assert_allclose(discounted_returns(rewards, mask, gamma), expected, atol=1e-6)


def test_gae_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="values has shape"):
        gae(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        gae(np.zeros(3), np.zeros(3), np.ones(3))


def test_ppo_package_imports_no_model_or_mesh_code():
    code = ("import sys, ppo_jax.ppo; "
            "bad = [m for m in sys.modules if m.startswith(('ppo_jax.models', 'ppo_jax.sharding'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=os.path.dirname(os.path.dirname(__file__)))
