"""Masked statistics and exact token-weighted reductions vs float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_test_mesh
from jax.sharding import PartitionSpec as P

from ppo_jax.ppo import stats
from ppo_jax.ppo.stats import Moments, SumCount


def random_batch(seed, shape=(6, 9)):
    """x with garbage (NaN, inf, huge) in the padding, and a mask with rows of every length."""
    rng = np.random.default_rng(seed)
    x = rng.normal(1.5, 2.0, shape).astype(np.float32)
    lengths = rng.integers(0, shape[1] + 1, shape[0])
    lengths[0], lengths[1] = shape[1], 0  # a row that never stops, an empty row
    mask = np.arange(shape[1])[None, :] < lengths[:, None]
    garbage = rng.choice(np.array([np.nan, np.inf, -np.inf, 1e30], np.float32), shape)
    return np.where(mask, x, garbage).astype(np.float32), mask


def real_values(x, mask):
    return x[mask].astype(np.float64)


def test_masked_mean_var_match_numpy_on_real_tokens_only():
    x, mask = random_batch(0)
    ref = real_values(x, mask)
    np.testing.assert_allclose(stats.masked_sum(x, mask), ref.sum(), rtol=1e-6)
    np.testing.assert_allclose(stats.masked_mean(x, mask), ref.mean(), rtol=1e-6)
    np.testing.assert_allclose(stats.masked_var(x, mask), ref.var(), rtol=1e-5)
    np.testing.assert_allclose(stats.masked_var(x, mask, unbiased=True), ref.var(ddof=1), rtol=1e-5)
    assert stats.masked_count(x, mask) == mask.sum()


def test_masked_mean_var_along_an_axis():
    x, mask = random_batch(1)
    means = stats.masked_mean(x, mask, axis=1)
    variances = stats.masked_var(x, mask, axis=1)
    for row in range(x.shape[0]):
        real = x[row][mask[row]].astype(np.float64)
        expected_mean = real.mean() if real.size else 0.0  # empty row: 0, not NaN
        expected_var = real.var() if real.size else 0.0
        np.testing.assert_allclose(means[row], expected_mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(variances[row], expected_var, rtol=1e-4, atol=1e-6)


def test_empty_mask_gives_zero_not_nan():
    x = jnp.ones((2, 3))
    mask = jnp.zeros((2, 3))
    assert stats.masked_mean(x, mask) == 0
    assert stats.masked_var(x, mask) == 0
    assert jnp.all(stats.masked_whiten(x, mask) == 0)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whitening_ignores_padded_positions(shift_mean):
    x, mask = random_batch(2)
    ref = real_values(x, mask)
    expected = (ref - ref.mean()) / np.sqrt(ref.var() + 1e-8)
    if not shift_mean:
        expected += ref.mean()
    whitened = np.asarray(stats.masked_whiten(x, mask, shift_mean=shift_mean))
    np.testing.assert_allclose(whitened[mask], expected, rtol=1e-5, atol=1e-5)
    assert np.all(whitened[~mask] == 0)
    # Whatever sits in the padding, the result is the same.
    other_padding = np.where(mask, x, -7.0).astype(np.float32)
    np.testing.assert_array_equal(stats.masked_whiten(other_padding, mask, shift_mean=shift_mean),
                                  whitened)


def split_rows_unevenly(x, mask):
    """Three microbatches of 1, 2 and 3 rows: their real-token counts differ."""
    bounds = [(0, 1), (1, 3), (3, 6)]
    return [(x[a:b], mask[a:b]) for a, b in bounds]


def test_sum_count_over_microbatches_equals_full_batch():
    x, mask = random_batch(3)
    parts = split_rows_unevenly(x, mask)
    pooled = SumCount.zeros()
    for part_x, part_mask in parts:
        pooled = pooled + SumCount.of(part_x, part_mask)
    ref = real_values(x, mask)
    np.testing.assert_allclose(pooled.mean(), ref.mean(), rtol=1e-6)
    assert pooled.count == mask.sum()
    # The naive mean of microbatch means is a different number: the test above can fail.
    naive = np.mean([real_values(px, pm).mean() for px, pm in parts if pm.any()])
    assert abs(naive - ref.mean()) > 1e-3


def test_moments_over_microbatches_equal_full_batch_variance():
    rng = np.random.default_rng(4)
    # Ratios close to 1 with a tiny spread: the regime where E[x^2] - E[x]^2 cancels without a shift.
    ratio = (1.0 + 1e-3 * rng.normal(size=(6, 9))).astype(np.float32)
    _, mask = random_batch(4)
    pooled = None
    for part_x, part_mask in split_rows_unevenly(ratio, mask):
        moments = Moments.of(part_x, part_mask, shift=1.0)
        pooled = moments if pooled is None else pooled + moments
    ref = real_values(ratio, mask)
    np.testing.assert_allclose(pooled.mean(), ref.mean(), rtol=1e-7)
    np.testing.assert_allclose(pooled.var(), ref.var(), rtol=1e-3)


def test_metric_dicts_pool_and_finalize():
    x, mask = random_batch(5)
    parts = split_rows_unevenly(x, mask)
    pooled = None
    for part_x, part_mask in parts:
        metrics = {"m": SumCount.of(part_x, part_mask), "r": Moments.of(part_x, part_mask)}
        pooled = metrics if pooled is None else stats.add_metrics(pooled, metrics)
    final = stats.finalize_metrics(pooled)
    ref = real_values(x, mask)
    assert set(final) == {"m", "r", "r_var"}
    np.testing.assert_allclose(final["m"], ref.mean(), rtol=1e-6)
    np.testing.assert_allclose(final["r"], ref.mean(), rtol=1e-6)
    np.testing.assert_allclose(final["r_var"], ref.var(), rtol=1e-4)
    with pytest.raises(ValueError, match="different keys"):
        stats.add_metrics({"a": SumCount.zeros()}, {"b": SumCount.zeros()})


def test_sum_count_psum_across_devices_equals_full_batch():
    mesh = make_test_mesh((8, 1, 1))
    rng = np.random.default_rng(6)
    x = rng.normal(size=(8, 5)).astype(np.float32)
    mask = rng.random((8, 5)) < np.linspace(0.1, 0.9, 8)[:, None]  # uneven counts per device

    def per_device(x, mask):
        return jax.lax.psum(SumCount.of(x, mask), "data")

    pooled = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P("data")),
                                   out_specs=P()))(x, mask)
    ref = real_values(x, mask)
    np.testing.assert_allclose(pooled.mean(), ref.mean(), rtol=1e-6)
    assert pooled.count == mask.sum()


def test_shape_mismatch_names_the_arguments():
    with pytest.raises(ValueError, match="values has shape"):
        stats.check_same_shape(rewards=jnp.zeros((2, 3)), values=jnp.zeros((2, 4)))
