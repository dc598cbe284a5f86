"""Layer layouts across checkpoints: a tree saved with stacked `layers` [L, ...] (the scanned loop)
restores into per-layer `layers_0 ... layers_{L-1}` (the unrolled loop) and back, bit-identical and
on the target's shardings (params, AdamW state, frozen trees); checksums verify across layouts and
keep their old values; any other difference is still a CheckpointMismatchError."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_test_mesh
from flax import struct
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from ppo_jax import checkpoint as ckpt
from ppo_jax.checkpoint import layout, verify
from ppo_jax.models import CausalLM, ModelConfig
from ppo_jax.models.init import init_params

STACKED, PER_LAYER = layout.STACKED, layout.PER_LAYER


@struct.dataclass
class TrainStateLike:
    """What a trainer saves: params, the AdamW state of those params, a step."""

    params: Any
    opt_state: Any
    step: jax.Array  # [] int32


def _config(num_layers: int = 3, hidden: int = 32, scan: bool = True) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=64, hidden_size=hidden, num_layers=num_layers, num_heads=2,
                       intermediate_size=64, max_position_embeddings=32, scan_layers=scan)


@functools.lru_cache(maxsize=None)
def _params(scan: bool, num_layers: int = 3, hidden: int = 32):
    """(params, shardings) of a tiny 3-layer Llama on the 2x2x2 mesh (fsdp and tensor both split)."""
    model = CausalLM(_config(num_layers, hidden, scan))
    return init_params(model, jax.random.key(0), make_test_mesh((2, 2, 2)))


def _train_state(params) -> TrainStateLike:
    """Params + AdamW state after one update (mu, nu non-zero, and distinct per layer)."""
    tx = optax.adamw(1e-3)

    @jax.jit
    def build(p):
        grads = jax.tree.map(lambda x: 0.1 * x + 0.01, p)
        _, opt_state = tx.update(grads, tx.init(p), p)
        return TrainStateLike(params=p, opt_state=opt_state, step=jnp.int32(7))

    return build(params)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def assert_identical(actual, expected, shardings=True):
    """Same structure, shapes, dtypes, bits and (by default) shardings."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert (a.shape, a.dtype) == (e.shape, e.dtype)
        if shardings:
            assert a.sharding == e.sharding, (a.sharding, e.sharding)
        if not isinstance(a, jax.ShapeDtypeStruct):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


@pytest.fixture(scope="module")
def states():
    """The same train state stacked and per layer (converted by the traceable `to_layout`, so the
    array path below is checked against an independent one), and each layout's own shardings as
    the model's init places them."""
    stacked = _train_state(_params(True)[0])
    per_layer_shardings = jax.tree.map(lambda x: x.sharding, _train_state(_params(False)[0]))
    per_layer = jax.jit(functools.partial(layout.to_layout, to=PER_LAYER),
                        out_shardings=per_layer_shardings)(stacked)
    return {STACKED: stacked, PER_LAYER: per_layer}


def test_detect():
    stacked, per_layer = _params(True)[0], _params(False)[0]
    assert layout.detect(stacked) == STACKED and layout.detect(per_layer) == PER_LAYER
    assert layout.detect({"w": jnp.ones(2)}) is None
    assert layout.detect_names(verify.checksums(per_layer)) == PER_LAYER
    with pytest.raises(ValueError, match="both stacked"):
        layout.detect({"a": stacked, "b": per_layer})


def test_abstract_conversion_gives_each_layouts_own_shardings():
    """Stacking prepends a replicated [L] axis: P(s..) -> P(None, s..), exactly the spec the scanned
    model's init gives (logical axis "layers" maps to no mesh axis); unstacking drops it."""
    stacked, per_layer = _abstract(_params(True)[0]), _abstract(_params(False)[0])
    assert_identical(layout.to_layout_abstract(stacked, PER_LAYER), per_layer)
    assert_identical(layout.to_layout_abstract(per_layer, STACKED), stacked)
    state = _abstract(_train_state(_params(True)[0]))
    there = layout.to_layout_abstract(state, PER_LAYER)
    assert layout.detect(there) == PER_LAYER
    assert_identical(layout.to_layout_abstract(there, STACKED), state)


def test_array_round_trip_is_exact_onto_target_shardings(states):
    stacked, per_layer = states[STACKED], states[PER_LAYER]
    assert isinstance(per_layer.opt_state[0], optax.ScaleByAdamState)
    q = per_layer.params["transformer"]["layers_2"]["attn"]["q"]["kernel"]
    np.testing.assert_array_equal(q, stacked.params["transformer"]["layers"]["attn"]["q"]["kernel"][2])
    there = layout.to_layout_arrays(stacked, PER_LAYER, _shardings(per_layer))
    assert_identical(there, per_layer)
    assert_identical(layout.to_layout_arrays(there, STACKED, _shardings(stacked), consume=True), stacked)
    assert there.step.is_deleted() is False  # leaves outside the layers are passed through, never deleted


def _old_leaf_checksum(x):
    """The checksum as version 1 first computed it (copied from verify.py before the position offset)."""
    words = verify._as_words(x)
    position = lax.iota(jnp.uint32, words.size).reshape(words.shape)
    weight = (position * jnp.uint32(verify._GOLDEN)) | jnp.uint32(1)
    return jnp.sum(words * weight, dtype=jnp.uint32)


def test_checksum_values_are_unchanged():
    tree = {"f32": jnp.arange(24, dtype=jnp.float32).reshape(2, 3, 4) / 7,
            "bf16": (jnp.arange(10, dtype=jnp.float32) / 3).astype(jnp.bfloat16),
            "i32": jnp.arange(-5, 6, dtype=jnp.int32), "b": jnp.arange(7) % 2 == 0,
            "u8": jnp.arange(9, dtype=jnp.uint8), "key": jax.random.key(3), "empty": jnp.zeros((0, 3))}
    assert verify.VERSION == 1
    old = {name: int(_old_leaf_checksum(x)) for name, x in tree.items()}
    assert verify.checksums(tree) == old
    # Computed before this change, so a checkpoint written then still verifies.
    assert {k: old[k] for k in ("b", "bf16", "f32", "i32", "key", "u8")} == {
        "b": 1788458064, "bf16": 747601458, "f32": 1638943399, "i32": 4225124878, "key": 3668339987,
        "u8": 339015968}


def test_checksums_on_the_host_are_those_of_the_devices_program():
    """NumPy (CPU trees: no program to trace) and the jitted program (accelerators, several
    processes) give the same numbers, whichever the dtype, the layout asked for or the sharding."""
    mesh = make_test_mesh((1, 8, 1))
    split = NamedSharding(mesh, P("fsdp"))
    tree = {"f32": jax.device_put(jnp.arange(48, dtype=jnp.float32).reshape(8, 6) / 7, split),
            "bf16": (jnp.arange(10, dtype=jnp.float32) / 3).astype(jnp.bfloat16), "i32": jnp.arange(-5, 6),
            "b": jnp.arange(7) % 2 == 0, "u8": jnp.arange(9, dtype=jnp.uint8), "key": jax.random.key(3),
            "empty": jnp.zeros((0, 3)), "numpy": np.arange(5, dtype=np.float16)}
    assert verify.checksums(tree, on_host=True) == verify.checksums(tree, on_host=False)
    assert len(set(verify.checksums(tree, on_host=True).values())) == len(tree)


@pytest.mark.parametrize("to", [STACKED, PER_LAYER])
def test_checksums_in_another_layout_are_the_same_on_the_host(states, to):
    for state in states.values():
        assert verify.checksums(state, to, on_host=True) == verify.checksums(state, to, on_host=False)


def test_checksums_verify_across_layouts(states):
    stacked, per_layer = states[STACKED], states[PER_LAYER]
    assert verify.checksums(stacked, PER_LAYER) == verify.checksums(per_layer)
    assert verify.checksums(per_layer, STACKED) == verify.checksums(stacked)
    assert verify.mismatches(per_layer, verify.record(stacked)) == []
    assert verify.mismatches(stacked, verify.record(per_layer)) == []
    # One changed word in layer 1 is seen in both directions, named in the recorded layout.
    path = ("transformer", "layers_1", "mlp", "up", "kernel")
    changed = per_layer.replace(params=_set(per_layer.params, path, lambda x: x.at[0, 0].add(1.0)))
    assert verify.mismatches(changed, verify.record(stacked)) == ["params.transformer.layers.mlp.up.kernel"]
    restacked = layout.to_layout_arrays(changed, STACKED, _shardings(stacked))
    assert verify.mismatches(restacked, verify.record(per_layer)) == ["params.transformer.layers_1.mlp.up.kernel"]


def _set(tree: dict, path: tuple[str, ...], fn):
    head, *rest = path
    return {**tree, head: _set(tree[head], tuple(rest), fn) if rest else fn(tree[head])}


@pytest.mark.parametrize("saved,target", [(STACKED, PER_LAYER), (PER_LAYER, STACKED)])
def test_a_checkpoint_restores_in_the_other_layout(tmp_path, states, saved, target, capfd):
    with ckpt.CheckpointManager(tmp_path / "run", async_save=False) as manager:
        manager.save(1, states[saved], extra={"data": 3})
        restored, extra = manager.restore(abstract_state=_abstract(states[target]))
        again = manager.restore_newest_valid(abstract_state=_abstract(states[target]))
    assert isinstance(restored, TrainStateLike) and extra == {"data": 3}
    assert_identical(restored, states[target])
    assert_identical(again.state, states[target])
    out = capfd.readouterr().out
    assert f"holds its layers {saved}, this run's compute.layer_loop runs them {target}" in out
    assert out.count("warning:") == 1  # said once per manager, however many trees it converts


@pytest.mark.parametrize("saved,target", [(STACKED, PER_LAYER), (PER_LAYER, STACKED)])
def test_a_frozen_tree_restores_in_the_other_layout(tmp_path, states, saved, target):
    with ckpt.CheckpointManager(tmp_path / "run", async_save=False) as manager:
        record = manager.save_frozen("reference", states[saved].params)
        tree = manager.restore_frozen("reference", _abstract(states[target].params), checksums=record)
        assert_identical(tree, states[target].params)
        # A record taken of the other layout's tree verifies too (what a LoRA resume compares).
        other = verify.record(states[target].params)
        assert_identical(manager.restore_frozen("reference", _abstract(states[target].params), checksums=other),
                         states[target].params)


def test_a_damaged_tree_is_still_refused_across_layouts(tmp_path, states):
    with ckpt.CheckpointManager(tmp_path / "run", async_save=False) as manager:
        record = manager.save_frozen("reference", states[STACKED].params)
        wrong = dict(record, leaves={**record["leaves"], "transformer.layers.ln_1.scale": 1})
        with pytest.raises(ckpt.CheckpointCorruptError, match="transformer.layers.ln_1.scale"):
            manager.restore_frozen("reference", _abstract(states[PER_LAYER].params), checksums=wrong)


@pytest.mark.parametrize("num_layers,hidden,message", [
    (2, 32, r"\(layers stacked\) differs at `policy.transformer.layers.attn.k.kernel`: expected shape "
            r"\(2, 32, 2, 16\), found \(3, 32, 2, 16\)"),
    (3, 48, r"differs at `policy.transformer.embed.embedding`: expected shape \(64, 48\), found \(64, 32\)"),
], ids=["num_layers", "hidden_size"])
def test_another_model_is_still_a_mismatch(tmp_path, num_layers, hidden, message):
    """Saved stacked (3 layers, hidden 32), restored per layer into another model."""
    with ckpt.CheckpointManager(tmp_path / "run", async_save=False) as manager:
        manager.save(1, {"policy": _params(True)[0]}, extra={})
        target = {"policy": _abstract(_params(False, num_layers, hidden)[0])}
        with pytest.raises(ckpt.CheckpointMismatchError, match=message) as err:
            manager.restore(abstract_state=target)
    assert "different model" in str(err.value)


def test_layers_that_do_not_stack_are_a_clear_error():
    per_layer = _abstract(_params(False)[0])
    layers = dict(per_layer["transformer"])
    layers["layers_5"] = layers.pop("layers_2")
    with pytest.raises(ValueError, match="layers_0 ... layers_2, found layers_0, layers_1, layers_5"):
        layout.to_layout_abstract({**per_layer, "transformer": layers}, STACKED)


def test_init_draws_the_same_params_in_either_layout():
    """So a random-init tree rebuilt from the seed (a LoRA base, a reference) verifies whichever loop
    the run that recorded it used."""
    stacked, per_layer = _params(True)[0], _params(False)[0]
    assert verify.mismatches(per_layer, verify.record(stacked)) == []


# The fewest programs and steps that still run every phase (sampling, experience, a PPO update).
SMALL_PPO = {"rollout.batch_size": 8, "rollout.forward_microbatch": 8, "ppo.epochs": 1, "ppo.num_minibatches": 1,
             "ppo.num_microbatches": 1}


def test_ppo_trained_unrolled_resumes_scanned(tmp_path, capfd):
    """One iteration with per-layer params (the GPU default), the second resumed with stacked ones
    (the CPU default), against two uninterrupted scanned iterations. Not bit-identical: the two
    loops round differently in iteration 1 (the conversion itself is exact, tests above); measured
    max |difference| over the whole final state 4.7e-9 (float32 params of scale ~0.02-1)."""
    from tiny_configs import tiny_config

    from ppo_jax.rl.trainer import PPOTrainer

    def trainer(workdir, loop, iterations):
        config = tiny_config(**{"compute.layer_loop": loop, "train.iterations": iterations, **SMALL_PPO})
        return PPOTrainer(config, str(workdir), mesh=make_test_mesh((1, 1, 1)))

    first = trainer(tmp_path / "resumed", "unrolled", 1)
    first.train()
    first.close()
    resumed = trainer(tmp_path / "resumed", "scan", 2)
    assert resumed.resumed_from == 1
    assert "holds its layers per_layer, this run's compute.layer_loop runs them stacked" in capfd.readouterr().out
    got = resumed.train()[-1]
    baseline = trainer(tmp_path / "baseline", "scan", 2)
    want = baseline.train()[-1]
    # The KL (~0.004) and the policy loss (-mean of whitened advantages, ~0) are differences of
    # log-probs of size ~5, so float32 rounds them by ~5 * 1.2e-7 in absolute terms whatever their
    # size: measured 1.8e-7 on the KL and 1.4e-7 on the loss (2-core CPU, 2026-11-25), so atol 1e-6,
    # the bound the whole state is held to below.
    for name in ("objective/scores", "objective/kl", "loss/policy_avg", "val/ratio"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    diffs = [float(np.max(np.abs(a - b), initial=0.0)) for a, b in zip(_floats(resumed.state), _floats(baseline.state))]
    print("max |resumed - uninterrupted| over the state:", max(diffs))
    assert max(diffs) < 1e-6
    resumed.close()
    baseline.close()


def _floats(tree) -> list[np.ndarray]:
    """Host float64 copies of every leaf (typed keys as their key data)."""
    def host(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x, np.float64)
    return [host(x) for x in jax.tree.leaves(jax.device_get(tree))]
