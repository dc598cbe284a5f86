"""The KV cache's per-row write (`models.attention._write_cache` with a start per row: the multi-turn
and continuous decodes, where every row is at its own slot), against a NumPy loop."""

import jax
import numpy as np
import pytest
from conftest import make_test_mesh

from ppo_jax import sharding
from ppo_jax.models.attention import _write_cache


def _rows_written_by_numpy(cache, new, starts):
    """Row b's T new slots at starts[b].. (a start past S - T clamped to it, as dynamic_update_slice
    clamps), one row at a time."""
    out, length = cache.copy(), new.shape[2]
    for b, start in enumerate(starts):
        start = min(max(int(start), 0), cache.shape[2] - length)
        out[b, :, start:start + length] = new[b]
    return out


@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("mesh_shape", [None, (4, 2, 1)], ids=["one device", "8 devices"])
def test_each_rows_keys_and_values_are_written_at_its_own_slot(length, mesh_shape):
    """Keys and values [B, K, T, Dh] written at each row's own slot: what a NumPy loop writes, on one
    device and with the rows and heads split over 8."""
    rows, heads, slots, dh = 8, 2, 12, 4
    rng = np.random.default_rng(length)
    cache = tuple(rng.normal(size=(rows, heads, slots, dh)).astype(np.float32) for _ in range(2))
    k, v = (rng.normal(size=(rows, heads, length, dh)).astype(np.float32) for _ in range(2))
    starts = np.array([0, 5, 11, 9, 3, slots - length, 7, 2], np.int32)  # 11 and 9: past S - T when T = 3

    def write(cache, k, v, starts):
        return _write_cache(cache, k, v, None, starts)[0]

    if mesh_shape is None:
        written = jax.jit(write)(cache, k, v, starts)
    else:
        with sharding.mesh_context(make_test_mesh(mesh_shape)):
            written = jax.jit(write)(cache, k, v, starts)
    np.testing.assert_array_equal(np.asarray(written[0]), _rows_written_by_numpy(cache[0], k, starts))
    np.testing.assert_array_equal(np.asarray(written[1]), _rows_written_by_numpy(cache[1], v, starts))
