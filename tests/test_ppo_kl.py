"""KL estimators and coefficient controllers vs their definitions in float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.ppo.kl import KLControllerState, init_kl_controller, kl_penalty, update_kl_controller


def log_prob_pairs(seed, n=200):
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(2.0, n).astype(np.float32)
    ref_logp = -rng.exponential(2.0, n).astype(np.float32)
    return logp, ref_logp


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_estimators_match_their_definitions(kind):
    logp, ref_logp = log_prob_pairs(0)
    lp, rl = logp.astype(np.float64), ref_logp.astype(np.float64)
    expected = {
        "k1": lp - rl,
        "k2": 0.5 * (lp - rl) ** 2,
        "k3": np.exp(rl - lp) - (rl - lp) - 1,
    }[kind]
    np.testing.assert_allclose(kl_penalty(logp, ref_logp, kind), expected, rtol=2e-5, atol=1e-6)


def test_k3_is_nonnegative_for_all_inputs():
    # A grid of log-ratios from tiny to extreme, both signs, and random pairs.
    d = np.concatenate([np.sign(s) * np.logspace(-9, 1.9, 400) for s in (-1, 1)] + [[0.0]])
    base = np.float32(-3.0)
    k3 = np.asarray(kl_penalty(base + d.astype(np.float32), np.full(d.shape, base), "k3"))
    assert np.all(k3 >= 0) and not np.any(np.isnan(k3))
    logp, ref_logp = log_prob_pairs(1, n=5000)
    assert np.all(np.asarray(kl_penalty(logp, ref_logp, "k3")) >= 0)
    assert np.all(np.asarray(kl_penalty(logp, ref_logp, "k2")) >= 0)


def test_k3_is_accurate_for_tiny_log_ratios():
    # exp(-d) - 1 + d ~ d^2 / 2: naive float32 arithmetic would return 0 or noise here.
    d = np.array([1e-3, -1e-3, 3e-4], np.float32)
    k3 = kl_penalty(d, np.zeros_like(d), "k3")
    d64 = d.astype(np.float64)
    np.testing.assert_allclose(k3, np.expm1(-d64) + d64, rtol=1e-3)


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(jnp.zeros(2), jnp.zeros(2), "k4")


def test_adaptive_controller_reproduces_hand_computed_trajectory():
    init_coef, target, horizon, batch = 0.2, 6.0, 10000.0, 512
    observed = [8.0, 6.3, 4.0, 1.0, 6.0, 100.0]
    # By hand: err = clip(KL / 6 - 1, -0.2, 0.2); beta *= 1 + err * 512 / 10000.
    #   KL=8   -> err=+0.2  -> beta = 0.2 * 1.01024            = 0.202048
    #   KL=6.3 -> err=+0.05 -> beta = 0.202048 * 1.00256      = 0.20256524...
    #   KL=4   -> err=-1/3 clipped to -0.2 -> * 0.98976
    #   KL=1   -> err=-5/6 clipped to -0.2 -> * 0.98976
    #   KL=6   -> err=0     -> unchanged
    #   KL=100 -> err=+0.2  -> * 1.01024
    multipliers = [1.01024, 1.00256, 0.98976, 0.98976, 1.0, 1.01024]
    expected = init_coef * np.cumprod(np.array(multipliers, np.float64))
    assert expected[0] == pytest.approx(0.202048, abs=1e-12)
    assert expected[1] == pytest.approx(0.20256524288, abs=1e-11)

    state = init_kl_controller("adaptive", init_coef, target=target, horizon=horizon)
    update = jax.jit(update_kl_controller)
    trajectory = []
    for kl in observed:
        state = update(state, jnp.float32(kl), jnp.int32(batch))
        trajectory.append(float(state.coef))
    np.testing.assert_allclose(trajectory, expected, rtol=1e-6)


def test_fixed_controller_never_moves():
    state = init_kl_controller("fixed", 0.05)
    for kl in (0.0, 3.0, 1e6):
        state = update_kl_controller(state, kl, 512)
    assert float(state.coef) == pytest.approx(0.05)


def test_controller_state_is_arrays_only():
    state = init_kl_controller("adaptive", 0.1, target=6.0, horizon=10000.0)
    leaves = jax.tree.leaves(state)
    assert len(leaves) == 3 and all(isinstance(x, jax.Array) and x.shape == () for x in leaves)
    assert isinstance(state, KLControllerState) and state.kind == "adaptive"


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="pid", init_coef=0.1), "fixed' or 'adaptive"),
    (dict(kind="fixed", init_coef=-0.1), "init_coef"),
    (dict(kind="adaptive", init_coef=0.1, horizon=100.0), "target > 0"),
    (dict(kind="adaptive", init_coef=0.1, target=6.0), "horizon > 0"),
])
def test_controller_configuration_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        init_kl_controller(**kwargs)
