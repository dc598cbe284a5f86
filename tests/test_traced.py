"""Microbatch loops trace their body once (`ppo_jax/traced.py`): the PPO update's gradient accumulation,
the supervised trainers' and the packed forwards' `map_used` run the body's Python (a model's forward
and its differentiation) one time, not once for the output shapes and again for the loop. Checked with
a body that counts its Python runs, against sums written in NumPy.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ppo_jax.models.packing import map_used
from ppo_jax.rl.update import accumulate
from ppo_jax.supervised.train_state import accumulate_gradients
from ppo_jax.traced import trace_once

ITEMS = np.arange(24, dtype=np.float32).reshape(4, 3, 2)  # [K, ...]: 4 microbatches


def _counted(fn):
    calls = []

    def body(*args):
        calls.append(1)
        return fn(*args)

    return body, calls


def test_the_update_accumulation_traces_its_microbatch_gradient_once():
    scale = np.float32(1.5)

    @jax.jit
    def run(items, w):
        def grads_of(item):  # closes over w, a value of the enclosing trace
            return {"g": jnp.sum(item) * w}, {"n": jnp.float32(item.shape[0])}

        scanned, scanned_calls = _counted(grads_of)
        looped, looped_calls = _counted(grads_of)
        out = accumulate(scanned, items), accumulate(looped, items, used=jnp.int32(3))
        assert len(scanned_calls) == 1 and len(looped_calls) == 1  # one trace per loop, not two
        return out

    (grads, metrics), (grads3, metrics3) = run(ITEMS, scale)
    np.testing.assert_allclose(grads["g"], ITEMS.sum() * scale)
    assert float(metrics["n"]) == 4 * 3
    np.testing.assert_allclose(grads3["g"], ITEMS[:3].sum() * scale)  # the first `used` microbatches only
    assert float(metrics3["n"]) == 3 * 3


def test_the_supervised_accumulation_traces_its_loss_gradient_once():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    calls = []

    def loss_fn(w, mb):
        calls.append(1)
        return jnp.sum(mb * w), {"rows": jnp.float32(mb.shape[0])}

    loss, metrics, grads = jax.jit(lambda w, mbs: accumulate_gradients(loss_fn, w, mbs, replicated))(
        np.float32(2.0), ITEMS)
    assert len(calls) == 1
    np.testing.assert_allclose(loss, 2.0 * ITEMS.sum())
    np.testing.assert_allclose(grads, ITEMS.sum())  # d/dw of sum(mb * w)
    assert float(metrics["rows"]) == 4 * 3


def test_map_used_traces_its_forward_once_and_leaves_the_unused_microbatches_zero():
    body, calls = _counted(lambda x: (x * 2.0).sum(-1))
    out = jax.jit(lambda items, used: map_used(body, used, items))(ITEMS, jnp.int32(2))
    assert len(calls) == 1
    expected = (ITEMS * 2.0).sum(-1)
    expected[2:] = 0
    np.testing.assert_array_equal(out, expected)


def test_a_traced_function_gives_its_shapes_and_its_values():
    traced = trace_once(lambda a, b: {"sum": a + b, "rows": a.shape[0]}, ITEMS[0], ITEMS[1])
    assert traced.shapes["sum"].shape == (3, 2) and traced.shapes["sum"].dtype == jnp.float32
    out = traced(ITEMS[2], ITEMS[3])
    np.testing.assert_array_equal(out["sum"], ITEMS[2] + ITEMS[3])
    assert int(out["rows"]) == 3
    zeros = traced.zeros((5,))
    assert zeros["sum"].shape == (5, 3, 2) and not np.any(zeros["sum"])
