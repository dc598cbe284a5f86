"""Clipped policy / value losses, entropy and KL loss vs float64 NumPy, gradients included."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.ppo import stats
from ppo_jax.ppo.losses import dense_kl_loss, entropy_from_logits, entropy_loss, kl_loss, policy_loss, value_loss


def reference_policy_loss_per_token(logp, old_logp, adv, clip_low, clip_high, dual_clip):
    """Float64, written from the definitions."""
    ratio = np.exp(logp.astype(np.float64) - old_logp.astype(np.float64))
    adv = adv.astype(np.float64)
    loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - clip_low, 1 + clip_high))
    if dual_clip is not None:
        loss = np.where(adv < 0, np.minimum(loss, -adv * dual_clip), loss)
    return loss, ratio


def banded_policy_batch(seed):
    """Every (ratio band x advantage sign) combination, far from the clip boundaries, plus padding.

    Ratios 0.5, 0.75 (below 1 - eps), 0.95, 1.05 (inside), 1.25 (between 1 + 0.2 and 1 + 0.28),
    1.5, 2.5 (above), 4.0 (above the dual-clip constant 3)."""
    rng = np.random.default_rng(seed)
    ratios = [0.5, 0.75, 0.95, 1.05, 1.25, 1.5, 2.5, 4.0]
    advs = [1.3, -0.7, 0.4, -2.1]
    pairs = np.array(list(itertools.product(ratios, advs)))  # 32 tokens
    old_logp = -rng.exponential(1.5, len(pairs)).astype(np.float32)
    logp = (old_logp + np.log(pairs[:, 0])).astype(np.float32)
    adv = pairs[:, 1].astype(np.float32)
    mask = np.ones(len(pairs), bool)
    mask[[3, 17]] = False  # padding: no loss, no gradient
    shape = (4, 8)
    return logp.reshape(shape), old_logp.reshape(shape), adv.reshape(shape), mask.reshape(shape)


def test_ratio_one_gives_minus_mean_advantage_and_no_clipping():
    rng = np.random.default_rng(0)
    logp = -rng.exponential(1.0, (3, 7)).astype(np.float32)
    adv = rng.normal(size=(3, 7)).astype(np.float32)
    mask = np.arange(7)[None, :] < np.array([[7], [4], [1]])
    loss, metrics = policy_loss(logp, logp, adv, mask, dual_clip=3.0)
    final = stats.finalize_metrics(metrics)
    np.testing.assert_allclose(loss, -adv[mask].astype(np.float64).mean(), rtol=1e-6)
    assert final["clipfrac"] == 0 and final["dual_clipfrac"] == 0
    assert final["approxkl"] == 0 and final["ratio"] == 1 and final["ratio_var"] == 0


@pytest.mark.parametrize("clip_high, dual_clip", [(None, None), (0.28, None), (None, 3.0), (0.28, 3.0)])
def test_policy_loss_and_metrics_match_numpy(clip_high, dual_clip):
    logp, old_logp, adv, mask = banded_policy_batch(1)
    loss, metrics = policy_loss(logp, old_logp, adv, mask, clip_eps=0.2, clip_eps_high=clip_high,
                                dual_clip=dual_clip)
    final = stats.finalize_metrics(metrics)
    high = 0.2 if clip_high is None else clip_high
    per_token, ratio = reference_policy_loss_per_token(logp, old_logp, adv, 0.2, high, dual_clip)
    a, r = adv.astype(np.float64), ratio
    clipped_used = -a * np.clip(r, 0.8, 1 + high) > -a * r
    log_ratio = logp.astype(np.float64) - old_logp
    np.testing.assert_allclose(loss, per_token[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(final["policy_loss"], per_token[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(final["clipfrac"], clipped_used[mask].mean(), rtol=1e-6)
    np.testing.assert_allclose(final["approxkl"], 0.5 * (log_ratio[mask] ** 2).mean(), rtol=1e-5)
    np.testing.assert_allclose(final["ratio"], r[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(final["ratio_var"], r[mask].var(), rtol=1e-4)
    if dual_clip is not None:
        dual = (a < 0) & (-a * r > -a * dual_clip)
        np.testing.assert_allclose(final["dual_clipfrac"], dual[mask].mean(), rtol=1e-6)
        assert dual[mask].any()
    assert 0 < final["clipfrac"] < 1


@pytest.mark.parametrize("clip_high, dual_clip", [(None, None), (0.28, None), (None, 3.0)])
def test_policy_gradient_vanishes_exactly_where_the_clip_binds(clip_high, dual_clip):
    logp, old_logp, adv, mask = banded_policy_batch(2)
    high = 0.2 if clip_high is None else clip_high
    grad = np.asarray(jax.grad(lambda lp: policy_loss(lp, old_logp, adv, mask, clip_eps=0.2,
                                                       clip_eps_high=clip_high,
                                                       dual_clip=dual_clip)[0])(jnp.asarray(logp)))
    ratio = np.exp(logp.astype(np.float64) - old_logp)
    a = adv.astype(np.float64)
    binds = ((a > 0) & (ratio > 1 + high)) | ((a < 0) & (ratio < 1 - 0.2))
    if dual_clip is not None:
        binds |= (a < 0) & (ratio > dual_clip)
    # Both advantage signs have binding and free tokens (the test covers both cases).
    for sign in (a > 0, a < 0):
        assert (binds & sign & mask).any() and (~binds & sign & mask).any()
    assert np.all(grad[binds | ~mask] == 0)
    free = ~binds & mask
    # d/dlogp of -A * ratio, token-normalised.
    np.testing.assert_allclose(grad[free], (-a * ratio)[free] / mask.sum(), rtol=1e-5)
    assert np.all(grad[free] != 0)


def reference_value_loss_per_token(values, old_values, returns, clip_range):
    v, old, ret = (x.astype(np.float64) for x in (values, old_values, returns))
    unclipped = (v - ret) ** 2
    clipped = (old + np.clip(v - old, -clip_range, clip_range) - ret) ** 2
    return 0.5 * np.maximum(unclipped, clipped), unclipped, clipped


def banded_value_batch(seed):
    """Value moves inside and outside the clip range, returns on every side; no near-ties."""
    rng = np.random.default_rng(seed)
    moves = [-0.5, -0.1, 0.1, 0.5]
    offsets = [-1.0, -0.3, 0.05, 0.3, 1.0]
    pairs = np.array(list(itertools.product(moves, offsets)))  # 20 tokens
    old = rng.normal(size=len(pairs)).astype(np.float32)
    values = (old + pairs[:, 0]).astype(np.float32)
    returns = (old + pairs[:, 1]).astype(np.float32)
    mask = np.ones(len(pairs), bool)
    mask[[2, 11]] = False
    return values.reshape(4, 5), old.reshape(4, 5), returns.reshape(4, 5), mask.reshape(4, 5)


def test_value_loss_and_metrics_match_numpy():
    values, old, returns, mask = banded_value_batch(3)
    loss, metrics = value_loss(values, old, returns, mask, clip_range=0.2)
    final = stats.finalize_metrics(metrics)
    per_token, unclipped, clipped = reference_value_loss_per_token(values, old, returns, 0.2)
    np.testing.assert_allclose(loss, per_token[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(final["value_loss"], per_token[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(final["value_clipfrac"], (clipped > unclipped)[mask].mean(), rtol=1e-6)
    np.testing.assert_allclose(final["values"], values[mask].astype(np.float64).mean(), rtol=1e-5)
    assert 0 < final["value_clipfrac"] < 1
    loss_unclipped, _ = value_loss(values, old, returns, mask, clip_range=None)
    np.testing.assert_allclose(loss_unclipped, 0.5 * unclipped[mask].mean(), rtol=1e-5)


def test_value_gradient_vanishes_exactly_where_the_clip_binds():
    values, old, returns, mask = banded_value_batch(4)
    grad = np.asarray(jax.grad(lambda v: value_loss(v, old, returns, mask, clip_range=0.2)[0])(
        jnp.asarray(values)))
    _, unclipped, clipped = reference_value_loss_per_token(values, old, returns, 0.2)
    outside = np.abs(values.astype(np.float64) - old) > 0.2
    binds = outside & (clipped > unclipped)
    assert binds[mask].any() and (outside & ~binds & mask).any()  # both cases outside the range
    assert np.all(grad[binds | ~mask] == 0)
    free = ~binds & mask
    expected = (values.astype(np.float64) - returns) / mask.sum()  # d/dv 0.5 (v - R)^2
    np.testing.assert_allclose(grad[free], expected[free], rtol=1e-4)
    assert np.all(grad[free] != 0)


def test_microbatches_with_minibatch_token_count_add_up_to_the_full_batch():
    rng = np.random.default_rng(5)
    shape = (6, 8)
    logp = -rng.exponential(1.0, shape).astype(np.float32)
    old_logp = (logp + rng.normal(0, 0.3, shape)).astype(np.float32)
    adv = rng.normal(size=shape).astype(np.float32)
    values = rng.normal(size=shape).astype(np.float32)
    old_values = (values + rng.normal(0, 0.3, shape)).astype(np.float32)
    returns = rng.normal(size=shape).astype(np.float32)
    # Microbatches of two rows hold 9, 5 and 11 real tokens.
    mask = np.arange(8)[None, :] < np.array([[8], [1], [5], [0], [3], [8]])
    batch = (old_logp, adv, old_values, returns, mask)

    def total(lp, v, old_lp, a, old_v, ret, m, num_tokens):
        pg, pg_metrics = policy_loss(lp, old_lp, a, m, num_tokens=num_tokens)
        vf, vf_metrics = value_loss(v, old_v, ret, m, num_tokens=num_tokens)
        return pg + vf, {**pg_metrics, **vf_metrics}

    grad_fn = jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True))
    (full_loss, full_metrics), (full_glp, full_gv) = grad_fn(logp, values, *batch, mask.sum())

    loss_sum, own_sum, glp, gv, pooled = 0.0, 0.0, [], [], None
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6)):
        part = [x[rows] for x in batch]
        (loss, metrics), (g1, g2) = grad_fn(logp[rows], values[rows], *part, mask.sum())
        loss_sum += loss
        glp.append(g1)
        gv.append(g2)
        pooled = metrics if pooled is None else stats.add_metrics(pooled, metrics)
        # Normalising each microbatch by its own token count instead gives a different (wrong) sum.
        own_sum += grad_fn(logp[rows], values[rows], *part, part[-1].sum())[0][0]
    np.testing.assert_allclose(loss_sum, full_loss, rtol=1e-5)
    np.testing.assert_allclose(np.concatenate(glp), full_glp, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(np.concatenate(gv), full_gv, rtol=1e-5, atol=1e-8)
    full_final, pooled_final = stats.finalize_metrics(full_metrics), stats.finalize_metrics(pooled)
    for key in full_final:
        np.testing.assert_allclose(pooled_final[key], full_final[key], rtol=1e-4, atol=1e-7,
                                   err_msg=key)
    # The default normaliser is the call's own token count: the full batch is its own minibatch.
    np.testing.assert_allclose(grad_fn(logp, values, *batch, None)[0][0], full_loss, rtol=1e-6)
    assert abs(own_sum - full_loss) > 1e-3


def reference_entropy(logits):
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    probs = np.exp(log_probs)
    return -np.where(probs > 0, probs * np.where(probs > 0, log_probs, 0), 0).sum(-1)


def test_entropy_matches_numpy_and_is_stable_for_extreme_logits():
    rng = np.random.default_rng(6)
    logits = (3 * rng.normal(size=(3, 4, 256))).astype(np.float32)
    logits[1] *= 1e4  # nearly one-hot, huge magnitudes
    logits[2, :, 100:] = -np.inf  # banned tokens
    logits[0, 0] = 0.0  # uniform: entropy log V
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], bool)
    entropy = np.asarray(entropy_from_logits(logits, mask))
    expected = np.where(mask, reference_entropy(logits), 0)
    np.testing.assert_allclose(entropy, expected, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(entropy[0, 0], np.log(256), rtol=1e-6)
    grad = jax.jit(jax.grad(lambda x: entropy_loss(x, mask)[0]))(logits)
    assert np.all(np.isfinite(np.asarray(grad)))


def test_entropy_loss_is_negative_token_mean_entropy():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(2, 3, 16)).astype(np.float32)
    mask = np.array([[1, 1, 0], [1, 0, 0]], bool)
    loss, metrics = entropy_loss(logits, mask, num_tokens=10)
    per_token = reference_entropy(logits)
    np.testing.assert_allclose(loss, -per_token[mask].sum() / 10, rtol=1e-5)
    np.testing.assert_allclose(metrics["entropy"].mean(), per_token[mask].mean(), rtol=1e-5)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_loss_value_and_gradient(kind):
    rng = np.random.default_rng(8)
    logp = -rng.exponential(1.0, (3, 5)).astype(np.float32)
    ref_logp = (logp + rng.normal(0, 0.5, (3, 5))).astype(np.float32)
    mask = np.arange(5)[None, :] < np.array([[5], [2], [3]])
    d = logp.astype(np.float64) - ref_logp
    per_token = {"k1": d, "k2": 0.5 * d**2, "k3": np.exp(-d) - 1 + d}[kind]
    d_per_token = {"k1": np.ones_like(d), "k2": d, "k3": 1 - np.exp(-d)}[kind]
    loss, metrics = kl_loss(logp, ref_logp, mask, kind)
    np.testing.assert_allclose(loss, per_token[mask].mean(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["kl_loss"].mean(), per_token[mask].mean(), rtol=1e-5,
                               atol=1e-7)
    g_logp, g_ref = jax.grad(lambda a, b: kl_loss(a, b, mask, kind)[0], argnums=(0, 1))(
        jnp.asarray(logp), jnp.asarray(ref_logp))
    np.testing.assert_allclose(g_logp, np.where(mask, d_per_token, 0) / mask.sum(), rtol=1e-4,
                               atol=1e-7)
    assert np.all(np.asarray(g_ref) == 0)  # the reference is a constant


def test_loss_argument_errors_are_specific():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(x, x, jnp.zeros((2, 4)), x)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(x, x, x, x, dual_clip=0.5)
    with pytest.raises(ValueError, match="clip_eps"):
        policy_loss(x, x, x, x, clip_eps=1.5)
    with pytest.raises(ValueError, match="clip_range"):
        value_loss(x, x, x, x, clip_range=-1.0)


def numpy_dense_kl(logits, ref_logits):
    """Per-position KL(softmax(logits) || softmax(ref_logits)) over the last axis, float64."""
    def log_softmax(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    logp, ref_logp = log_softmax(logits), log_softmax(ref_logits)
    return (np.exp(logp) * (logp - ref_logp)).sum(-1), logp, ref_logp


def test_dense_kl_loss_is_the_whole_vocabulary_kl_with_its_analytic_gradient():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, (3, 4, 7)).astype(np.float32)
    ref_logits = (logits + rng.normal(0, 1, logits.shape)).astype(np.float32)
    mask = (np.arange(4)[None, :] < np.array([[4], [1], [3]])).astype(np.float32)
    per_token, logp, ref_logp = numpy_dense_kl(logits, ref_logits)
    loss, metrics = dense_kl_loss(logits, ref_logits, mask, num_tokens=11)
    np.testing.assert_allclose(loss, (per_token * mask).sum() / 11, rtol=1e-5)
    np.testing.assert_allclose(stats.finalize_metrics(metrics)["dense_kl"], per_token[mask > 0].mean(), rtol=1e-5)
    # d KL / d logits_v = p_v (log p_v - log q_v - KL), per position; the reference gets no gradient.
    expected = np.exp(logp) * (logp - ref_logp - per_token[..., None]) * mask[..., None] / 11
    g, g_ref = jax.grad(lambda a, b: dense_kl_loss(a, b, mask, num_tokens=11)[0], argnums=(0, 1))(
        jnp.asarray(logits), jnp.asarray(ref_logits))
    np.testing.assert_allclose(g, expected, rtol=1e-4, atol=1e-7)
    assert not np.any(np.asarray(g_ref))


def test_dense_kl_sees_and_restores_a_stop_margin_the_sampled_estimators_barely_see():
    """docs/demo.md, "The spike": where the reference stops with p = 0.9999 and the policy's stop
    probability has eroded to 0.99, the sampled token is still the stop token. Its sampled estimates
    are tiny (k1 = log 0.99/0.9999 ~ -0.01, k3 ~ 5e-5) while the policy puts 100x the reference's mass
    on everything else: the whole-vocabulary KL is ~0.036 nats. As a loss, k3's pull on the stop
    logit is (1 - e^{-d})(1 - p) ~ 1e-4; the dense term's is p (log p/q - KL) ~ 0.046, hundreds of
    times stronger, and both push the stop logit up."""
    vocab, stop = 50, 0

    def logits_with_stop_prob(p):
        rest = np.log((1 - p) / (vocab - 1))
        return np.where(np.arange(vocab) == stop, np.log(p), rest).astype(np.float32)[None, None, :]

    logits, ref_logits = logits_with_stop_prob(0.99), logits_with_stop_prob(0.9999)
    mask = np.ones((1, 1), np.float32)
    per_token, _, _ = numpy_dense_kl(logits, ref_logits)
    dense, _ = dense_kl_loss(logits, ref_logits, mask)
    np.testing.assert_allclose(dense, per_token[0, 0], rtol=1e-4)
    assert 0.03 < float(dense) < 0.04

    def sampled_k3(lg):
        logp = jax.nn.log_softmax(lg)[..., stop]
        ref_logp = jax.nn.log_softmax(jnp.asarray(ref_logits))[..., stop]
        return kl_loss(logp, ref_logp, mask, "k3")[0]

    assert float(sampled_k3(jnp.asarray(logits))) < 1e-4
    pull_dense = -float(jax.grad(lambda lg: dense_kl_loss(lg, ref_logits, mask)[0])(jnp.asarray(logits))[0, 0, stop])
    pull_k3 = -float(jax.grad(sampled_k3)(jnp.asarray(logits))[0, 0, stop])
    assert pull_dense > 0 and pull_k3 > 0  # both raise the stop logit (descent direction)
    np.testing.assert_allclose(pull_dense, 0.99 * (np.log(0.99 / 0.9999) - per_token[0, 0]) * -1, rtol=1e-3)
    assert pull_dense > 100 * pull_k3
