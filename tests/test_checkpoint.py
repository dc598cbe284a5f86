"""Checkpoints: round trips bit-exact (typed PRNG keys included) onto any mesh, retention of the
last k and the best, clear errors (nothing saved, wrong model shape, unwritable directory, disk
full mid-save), saves killed with SIGKILL that never break resume, and two-process saves."""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn
import pytest
from conftest import make_test_mesh
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from ppo_jax import checkpoint as ckpt
from ppo_jax.checkpoint import verify
from ppo_jax.models import CausalLM, ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[1]


@struct.dataclass
class TinyTrainState:
    """The shape of what the trainer saves: params, optimizer state, scalars and typed keys."""

    params: Any
    opt_state: Any
    kl_coef: jax.Array  # []
    step: jax.Array  # [] int32
    key: jax.Array  # [] typed key
    sample_keys: jax.Array  # [8] typed keys, batch-sharded


def _spec(leaf) -> P:
    """Sharding spec by rank: params split over fsdp x tensor, per-sample keys over the batch."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return P(("data", "fsdp")) if leaf.ndim == 1 else P()
    return {0: P(), 1: P("tensor"), 2: P("fsdp", "tensor")}[leaf.ndim]


def state_shardings(tree, mesh):
    return jax.tree.map(lambda x: NamedSharding(mesh, _spec(x)), tree)


def abstract_on(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


@functools.lru_cache(maxsize=None)
def _state_on_default_device(seed: int) -> TinyTrainState:
    return jax.jit(_build_state, static_argnums=0)(seed)  # one compile instead of ~50 eager ops


def _build_state(seed: int) -> TinyTrainState:
    k = jax.random.split(jax.random.key(seed), 6)
    params = {
        "embed": jax.random.normal(k[0], (16, 32)),
        "mlp": {"kernel": jax.random.normal(k[1], (32, 64)),
                "bias": jax.random.normal(k[2], (64,))},
    }
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)
    grads = jax.tree.map(lambda x: 0.1 * x, params)
    _, opt_state = tx.update(grads, opt_state, params)
    return TinyTrainState(
        params=params, opt_state=opt_state, kl_coef=jnp.float32(0.05 + seed),
        step=jnp.int32(7 + seed), key=k[3], sample_keys=jax.random.split(k[4], 8))


def make_state(mesh, seed: int = 0) -> TinyTrainState:
    """A TinyTrainState (~60 KB) with random values placed on `mesh`; optimizer moments non-zero.

    Built once per seed on one device (eager ops compile per sharding) and then moved.
    """
    state = _state_on_default_device(seed)
    return jax.device_put(state, state_shardings(state, mesh))


def leaves_as_numpy(tree) -> list[np.ndarray]:
    """Host copies of every leaf; typed keys as their raw key data (to compare bit-exactly)."""
    def host(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)
    return [host(x) for x in jax.tree.leaves(tree)]


def assert_trees_identical(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(leaves_as_numpy(actual), leaves_as_numpy(expected)):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(a, e)


def test_round_trip_is_bit_exact_with_typed_keys_and_extra(tmp_path):
    mesh = make_test_mesh((2, 2, 2))
    state = make_state(mesh)
    extra = {"data": {"epoch": 1, "position": 40, "shuffle_seed": 3}, "config": {"lr": 1e-5}}
    with ckpt.CheckpointManager(tmp_path / "run") as manager:
        assert manager.save(3, state, extra=extra)
        manager.wait()
        assert manager.all_steps() == [3] and manager.latest_step() == 3
        restored, restored_extra = manager.restore(
            abstract_state=abstract_on(state, state_shardings(state, mesh)))
    assert isinstance(restored, TinyTrainState)
    assert_trees_identical(restored, state)
    assert restored_extra == extra
    # Typed keys come back as typed keys that draw the same numbers.
    assert jax.dtypes.issubdtype(restored.key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.uniform(restored.key, (4,)),
                                  jax.random.uniform(state.key, (4,)))
    assert restored.sample_keys.sharding.is_equivalent_to(state.sample_keys.sharding, 1)


def _next_state(s: TinyTrainState) -> TinyTrainState:
    """Every leaf changes, as in a training step."""
    plus_one = lambda tree: jax.tree.map(lambda x: x + 1, tree)  # noqa: E731
    fold = lambda k: jax.random.fold_in(k, 1)  # noqa: E731
    return s.replace(params=plus_one(s.params), opt_state=plus_one(s.opt_state),
                     kl_coef=s.kl_coef * 2, step=s.step + 1, key=fold(s.key),
                     sample_keys=jax.vmap(fold)(s.sample_keys))


def test_arrays_may_be_donated_as_soon_as_save_returns(tmp_path):
    """The trainer donates its state to the next update right after `save`; the bytes on disk
    must be those at the time of the call, not whatever the buffers hold later."""
    mesh = make_test_mesh((2, 2, 2))
    state = make_state(mesh, seed=3)
    expected = leaves_as_numpy(state)
    shardings = state_shardings(state, mesh)
    donate_and_change = jax.jit(_next_state, donate_argnums=0, out_shardings=shardings)
    with ckpt.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, state, extra={})
        changed = donate_and_change(state)
        jax.block_until_ready(changed)
        # The big buffers were handed over (XLA:CPU keeps replicated scalars undonated).
        donated = jax.tree.leaves((state.params, state.opt_state[0].mu))
        assert all(leaf.is_deleted() for leaf in donated)
        manager.wait()
        restored, _ = manager.restore(abstract_state=abstract_on(changed, shardings))
    for got, want in zip(leaves_as_numpy(restored), expected):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("target_shape", [(1, 8, 1), "single_device"])
def test_restore_onto_a_different_mesh(tmp_path, target_shape):
    saved_mesh = make_test_mesh((2, 2, 2))
    state = make_state(saved_mesh, seed=1)
    kernel = state.params["mlp"]["kernel"]
    assert kernel.addressable_shards[0].data.shape == (16, 32)  # really sharded when saved
    with ckpt.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, state, extra={})
    if target_shape == "single_device":
        device = jax.devices()[3]
        shardings = jax.tree.map(lambda _: SingleDeviceSharding(device), state)
    else:
        shardings = state_shardings(state, make_test_mesh(target_shape))
    with ckpt.CheckpointManager(tmp_path / "run") as manager:
        restored, _ = manager.restore(abstract_state=abstract_on(state, shardings))
    assert_trees_identical(restored, state)
    for leaf, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    if target_shape == (1, 8, 1):
        assert restored.params["mlp"]["kernel"].addressable_shards[0].data.shape == (4, 64)


def test_keeps_the_last_k_and_the_best(tmp_path):
    mesh = make_test_mesh((1, 1, 1))
    state = make_state(mesh)
    rewards = {1: 0.1, 2: 0.9, 3: 0.2, 4: float("nan"), 5: 0.3, 6: None}
    with ckpt.CheckpointManager(tmp_path / "max", max_to_keep=2, best_metric="reward") as manager:
        for step, reward in rewards.items():
            metrics = None if reward is None else {"reward": reward, "kl": 0.01}
            assert manager.save(step, state, extra={"step": step}, metrics=metrics)
        manager.wait()
        assert manager.all_steps() == [2, 5, 6]
        assert manager.best_step() == 2
        assert manager.metrics(2) == {"reward": 0.9, "kl": 0.01}
    # The policy is re-read from disk by a new manager: the best survives later saves too.
    with ckpt.CheckpointManager(tmp_path / "max", max_to_keep=2, best_metric="reward") as manager:
        assert manager.all_steps() == [2, 5, 6]
        manager.save(7, state, extra={}, metrics={"reward": 0.5})
        manager.wait()
        assert manager.all_steps() == [2, 6, 7]

    losses = [0.5, 0.2, float("nan"), 0.4, 0.6]
    with ckpt.CheckpointManager(tmp_path / "min", max_to_keep=1, best_metric="loss",
                                best_mode="min") as manager:
        for step, loss in enumerate(losses, start=1):
            manager.save(step, state, extra={}, metrics={"loss": np.float32(loss)})
        manager.wait()
        assert manager.all_steps() == [2, 5] and manager.best_step() == 2

    with ckpt.CheckpointManager(tmp_path / "recent", max_to_keep=2) as manager:
        for step in range(1, 5):
            manager.save(step, state, extra={}, metrics={"reward": float(-step)})
        manager.wait()
        assert manager.all_steps() == [3, 4]


def test_save_interval_force_and_no_overwrite(tmp_path):
    state = make_state(make_test_mesh((1, 1, 1)))
    with ckpt.CheckpointManager(tmp_path / "run", save_interval_steps=3,
                                async_save=False) as manager:
        assert not manager.save(1, state, extra={})
        assert manager.save(3, state, extra={})
        assert not manager.save(4, state, extra={})
        assert manager.save(4, state, extra={}, force=True)  # e.g. a SIGTERM between intervals
        assert not manager.save(3, state, extra={})  # not newer than the latest: skipped
        with pytest.raises(ckpt.CheckpointError, match="step 4 already exists"):
            manager.save(4, state, extra={}, force=True)
        assert manager.all_steps() == [3, 4]


def test_restore_without_any_checkpoint_is_a_clear_error(tmp_path):
    state = make_state(make_test_mesh((1, 1, 1)))
    target = abstract_on(state, state_shardings(state, make_test_mesh((1, 1, 1))))
    with ckpt.CheckpointManager(tmp_path / "empty") as manager:
        with pytest.raises(ckpt.CheckpointNotFoundError, match="no complete checkpoint in .*empty"):
            manager.restore(abstract_state=target)
        manager.save(2, state, extra={})
        with pytest.raises(ckpt.CheckpointNotFoundError,
                           match=r"step 5 is not in .*available steps: \[2\]"):
            manager.restore(5, abstract_state=target)


def _lm_param_shapes(hidden: int):
    """[shape/dtype tree] of a tiny Llama's params, traced without compiling anything."""
    model = CausalLM(ModelConfig(arch="llama", vocab_size=64, hidden_size=hidden, num_layers=2,
                                 num_heads=2, intermediate_size=64, max_position_embeddings=32))
    tokens = jnp.zeros((1, 4), jnp.int32)

    def init():
        return nn.unbox(model.init(jax.random.key(0), tokens, tokens, tokens)["params"])

    return jax.eval_shape(init)


def test_checkpoint_of_a_different_model_shape_names_the_path_and_shapes(tmp_path):
    sharding = SingleDeviceSharding(jax.devices()[0])
    saved_shapes = _lm_param_shapes(32)
    params = jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), sharding),
                          saved_shapes)
    with ckpt.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, {"policy": params}, extra={})
    wider = _lm_param_shapes(48)
    target = {"policy": jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), wider)}
    # The first leaf (in tree order) whose shape differs is the one the message must name.
    flat_saved = jax.tree_util.tree_flatten_with_path(saved_shapes)[0]
    flat_wider = jax.tree_util.tree_flatten_with_path(wider)[0]
    path, saved_leaf, wider_leaf = next(
        (p, a, b) for (p, a), (_, b) in zip(flat_saved, flat_wider) if a.shape != b.shape)
    name = "policy." + ".".join(str(k.key) for k in path)
    with ckpt.CheckpointManager(tmp_path / "run") as manager:
        with pytest.raises(ckpt.CheckpointMismatchError) as err:
            manager.restore(abstract_state=target)
    message = str(err.value)
    assert f"differs at `{name}`" in message
    assert f"expected shape {wider_leaf.shape}, found {saved_leaf.shape}" in message
    assert "different model" in message


def test_tree_structure_mismatch_names_the_entry(tmp_path):
    sharding = SingleDeviceSharding(jax.devices()[0])
    saved = {"policy": {"w": jnp.ones((4, 8)), "b": jnp.zeros(8)}, "key": jax.random.key(1)}
    with ckpt.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, saved, extra={})

        def sds(shape, dtype=jnp.float32):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        key_sds = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=sharding)
        missing = {"policy": {"w": sds((4, 8)), "b": sds((8,)), "scale": sds((8,))}, "key": key_sds}
        with pytest.raises(ckpt.CheckpointMismatchError, match="no entry `policy.scale`"):
            manager.restore(abstract_state=missing)
        unexpected = {"policy": {"w": sds((4, 8))}, "key": key_sds}
        with pytest.raises(ckpt.CheckpointMismatchError,
                           match="entry `policy.b` .*target does not have"):
            manager.restore(abstract_state=unexpected)
        two_keys = {"policy": {"w": sds((4, 8)), "b": sds((8,))},
                    "key": jax.ShapeDtypeStruct((2,), key_sds.dtype, sharding=sharding)}
        with pytest.raises(ckpt.CheckpointMismatchError,
                           match="`key`: expected a PRNG key array of shape"):
            manager.restore(abstract_state=two_keys)
        no_sharding = {"policy": {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32), "b": sds((8,))},
                       "key": key_sds}
        with pytest.raises(ValueError, match="`policy.w` has no sharding"):
            manager.restore(abstract_state=no_sharding)
        # The good target still restores after all those refusals.
        good = {"policy": {"w": sds((4, 8)), "b": sds((8,))}, "key": key_sds}
        restored, _ = manager.restore(abstract_state=good)
        assert_trees_identical(restored, saved)


def test_bad_save_arguments_fail_before_anything_is_written(tmp_path):
    state = make_state(make_test_mesh((1, 1, 1)))
    with ckpt.CheckpointManager(tmp_path / "run", best_metric="reward") as manager:
        with pytest.raises(TypeError, match=r"extra\['data'\]\['rng'\] \(ndarray\)"):
            manager.save(1, state, extra={"data": {"rng": np.zeros(3)}})
        with pytest.raises(KeyError, match="lack the tracked best metric 'reward'"):
            manager.save(1, state, extra={}, metrics={"loss": 1.0})
        with pytest.raises(TypeError, match="leaf `step` has type int, not jax.Array"):
            manager.save(1, {"step": 3}, extra={})
        with pytest.raises(ValueError, match="non-negative integer"):
            manager.save(-1, state, extra={})
        manager.wait()
        assert manager.all_steps() == []
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.isdigit()) == []
    with pytest.raises(ValueError, match="best_mode must be 'max' or 'min'"):
        ckpt.CheckpointManager(tmp_path / "other", best_mode="best")
    with pytest.raises(ValueError, match="max_to_keep must be an integer >= 1"):
        ckpt.CheckpointManager(tmp_path / "other", max_to_keep=0)


def test_unwritable_directory_is_a_clear_error(tmp_path):
    # chmod does not stop root (tests run as root); a path below a regular file fails for anyone.
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("a file where the workdir should be")
    with pytest.raises(ckpt.CheckpointSaveError,
                       match="cannot create or open the checkpoint directory .*not_a_directory"):
        ckpt.CheckpointManager(blocker / "checkpoints")


@contextlib.contextmanager
def file_size_limit(max_bytes: int):
    """Writes past `max_bytes` in any file fail with EFBIG, as on a full disk; root included."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write, keep running
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path, async_save):
    sharding = SingleDeviceSharding(jax.devices()[0])
    small = {"w": jnp.arange(1024, dtype=jnp.float32)}
    big = {"w": jax.random.uniform(jax.random.key(0), (1 << 20,))}  # 4 MB, incompressible
    directory = tmp_path / "run"
    # max_to_keep=1: step 1 is scheduled for deletion by the save of step 2 and must survive.
    with ckpt.CheckpointManager(directory, max_to_keep=1, async_save=async_save) as manager:
        manager.save(1, small, extra={"step": 1})
        manager.wait()
        with file_size_limit(256 * 1024):
            with pytest.raises(ckpt.CheckpointSaveError) as err:
                manager.save(2, big, extra={"step": 2})
                manager.wait()
        message = str(err.value)
        assert "saving checkpoint step 2" in message and "File too large" in message
        assert "committed checkpoints [1] are intact and resume uses step 1" in message
        assert manager.all_steps() == [1]
        target = {"w": jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=sharding)}
        restored, extra = manager.restore(abstract_state=target)
        assert_trees_identical(restored, small)
        assert extra == {"step": 1}
        # Space is back: saving carries on in the same manager.
        assert manager.save(3, small, extra={"step": 3})
        manager.wait()
        assert manager.all_steps() == [3]
    with ckpt.CheckpointManager(directory) as manager:
        assert manager.latest_step() == 3


def test_frozen_trees_round_trip_onto_another_mesh(tmp_path):
    saved_mesh = make_test_mesh((2, 2, 2))
    params = make_state(saved_mesh, seed=2).params
    with ckpt.CheckpointManager(tmp_path / "run") as manager:
        assert not manager.has_frozen("reference")
        manager.save_frozen("reference", params)
        manager.wait()
        assert manager.has_frozen("reference")
        with pytest.raises(ckpt.CheckpointError, match="'reference' already exists"):
            manager.save_frozen("reference", params)
        with pytest.raises(ValueError, match="frozen tree name"):
            manager.save_frozen("../escape", params)
        assert manager.all_steps() == []  # frozen/ is not mistaken for a step
    other = state_shardings(params, make_test_mesh((1, 2, 4)))
    with ckpt.CheckpointManager(tmp_path / "run") as manager:
        restored = manager.restore_frozen("reference", abstract_on(params, other))
        assert_trees_identical(restored, params)
        assert restored["mlp"]["kernel"].sharding.is_equivalent_to(other["mlp"]["kernel"], 2)
        with pytest.raises(ckpt.CheckpointNotFoundError,
                           match=r"no frozen tree 'reward'.*\['reference'\]"):
            manager.restore_frozen("reward", abstract_on(params, other))
        wrong = dict(abstract_on(params, other),
                     embed=jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=other["embed"]))
        with pytest.raises(ckpt.CheckpointMismatchError,
                           match=r"`embed`: expected shape \(16, 64\), found \(16, 32\)"):
            manager.restore_frozen("reference", wrong)


# --------------------------------------------------------------------------- damaged files


def _largest_array_file(step_dir: Path) -> Path:
    """The biggest data file of a step's state (where the parameters' bytes are)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    path.write_bytes(bytes(data))


def _two_steps(tmp_path, mesh):
    directory = tmp_path / "run"
    with ckpt.CheckpointManager(directory) as manager:
        for step in (1, 2):
            manager.save(step, make_state(mesh, seed=step), extra={"step": step}, force=True)
    return directory


DAMAGE = {
    # Random float bytes do not compress: a flipped byte decodes to a different number, no error.
    "flipped_bytes": (lambda d: _flip_bytes(_largest_array_file(d)),
                      r"differ from the checksums written when it was saved \(first: `"),
    "truncated": (lambda d: _largest_array_file(d).write_bytes(_largest_array_file(d).read_bytes()[:100]),
                  "is damaged: OUT_OF_RANGE: Error reading"),
    "emptied": (lambda d: _largest_array_file(d).write_bytes(b""), "is damaged: OUT_OF_RANGE: Error reading"),
    "no_metadata": (lambda d: (d / "state" / "_METADATA").unlink(), "its state/_METADATA file is missing"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_step_is_refused_and_resume_falls_back_to_the_previous_one(tmp_path, damage, capfd):
    mesh = make_test_mesh((1, 1, 1))
    directory = _two_steps(tmp_path, mesh)
    corrupt, message = DAMAGE[damage]
    corrupt(directory / "2")
    state = make_state(mesh, seed=2)
    target = abstract_on(state, state_shardings(state, mesh))
    with ckpt.CheckpointManager(directory) as manager:
        with pytest.raises(ckpt.CheckpointCorruptError, match="checkpoint step 2 in .* " + message):
            manager.restore(2, abstract_state=target)
        restored = manager.restore_newest_valid(abstract_state=target)
        assert restored.step == 1 and restored.extra == {"step": 1}
        assert_trees_identical(restored.state, make_state(mesh, seed=1))
        assert len(restored.skipped) == 1 and "step 2" in restored.skipped[0]
        assert restored.skipped[0].endswith(f"(moved to {directory / '2.corrupt'}); resuming from step 1")
        # The damaged step is kept for inspection but never read again; step 2 can be saved anew.
        assert (directory / "2.corrupt").is_dir() and manager.all_steps() == [1]
        manager.save(2, make_state(mesh, seed=2), extra={"step": 2}, force=True)
        manager.wait()
        assert manager.restore_newest_valid(abstract_state=target).step == 2
    assert "Traceback" not in capfd.readouterr().err  # no abandoned-read tracebacks (TensorStore specs)


def test_every_step_damaged_is_one_clear_error(tmp_path):
    mesh = make_test_mesh((1, 1, 1))
    directory = _two_steps(tmp_path, mesh)
    for step in ("1", "2"):
        _flip_bytes(_largest_array_file(directory / step))
    state = make_state(mesh)
    with ckpt.CheckpointManager(directory) as manager:
        with pytest.raises(ckpt.CheckpointCorruptError, match=r"no checkpoint in .* is intact: checkpoint step 2 .*"
                                                              r"checkpoint step 1 .*Start the run in a new workdir"):
            manager.restore_newest_valid(abstract_state=abstract_on(state, state_shardings(state, mesh)))


def _warnings(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("warning:")]


@pytest.mark.parametrize("junk", ["stray_file", "empty"])
def test_a_step_directory_holding_no_checkpoint_is_set_aside_with_one_warning(tmp_path, junk, capsys):
    """`99/x` (or an empty `99/`): named like a step, nothing Orbax wrote. It used to stop every
    resume ("its metadata failed to load"); now it is renamed like a damaged step and resume goes on."""
    mesh = make_test_mesh((1, 1, 1))
    directory = _two_steps(tmp_path, mesh)
    (directory / "99").mkdir()
    if junk == "stray_file":
        (directory / "99" / "x").write_text("not a checkpoint")
    state = make_state(mesh, seed=2)
    target = abstract_on(state, state_shardings(state, mesh))
    capsys.readouterr()
    with ckpt.CheckpointManager(directory) as manager:
        assert manager.all_steps() == [1, 2] and manager.latest_step() == 2
        restored = manager.restore_newest_valid(abstract_state=target)
        assert restored.step == 2 and restored.skipped == ()
        assert_trees_identical(restored.state, state)
    [warning] = _warnings(capsys.readouterr().out)
    assert f"{directory / '99'} is named like a checkpoint step but holds none" in warning
    assert "no _CHECKPOINT_METADATA file, no state/ directory" in warning
    assert f"moved to {directory / '99.corrupt'}" in warning
    assert not (directory / "99").exists()  # kept, renamed: nothing a user put there is deleted
    assert sorted(p.name for p in (directory / "99.corrupt").iterdir()) == (["x"] if junk == "stray_file" else [])
    with ckpt.CheckpointManager(directory) as manager:  # said once: the next open finds nothing to say
        assert manager.all_steps() == [1, 2]
    assert _warnings(capsys.readouterr().out) == []


def test_only_step_directories_holding_no_checkpoint_means_no_checkpoint(tmp_path, capsys):
    """With no real step beside it, the stray directory leaves nothing to resume: trainers start
    fresh (they resume only when `all_steps()` is not empty)."""
    directory = tmp_path / "run"
    (directory / "7").mkdir(parents=True)
    (directory / "7" / "notes.txt").write_text("mine")
    with ckpt.CheckpointManager(directory) as manager:
        assert manager.all_steps() == [] and manager.latest_step() is None
    assert len(_warnings(capsys.readouterr().out)) == 1
    assert (directory / "7.corrupt" / "notes.txt").read_text() == "mine"


def test_checksums_are_the_same_on_every_mesh_and_see_one_changed_word():
    state = make_state(make_test_mesh((1, 1, 1)))
    sums = verify.checksums(state)
    assert sums == verify.checksums(make_state(make_test_mesh((2, 2, 2))))
    assert sums == verify.checksums(make_state(make_test_mesh((1, 8, 1))))
    params = state.params
    nudged = dict(params, embed=params["embed"].at[3, 5].set(jnp.nextafter(params["embed"][3, 5], 1.0)))
    assert verify.mismatches({"params": nudged}, verify.record({"params": params})) == ["params.embed"]
    swapped = dict(params, mlp=dict(params["mlp"], bias=params["mlp"]["bias"][::-1]))
    assert verify.mismatches(swapped, verify.record(params)) == ["mlp.bias"]


def test_a_frozen_tree_must_match_its_recorded_checksums(tmp_path):
    mesh = make_test_mesh((1, 1, 1))
    params = make_state(mesh, seed=2).params
    other = make_state(mesh, seed=3).params
    target = abstract_on(params, state_shardings(params, mesh))
    with ckpt.CheckpointManager(tmp_path / "run") as manager:
        record = manager.save_frozen("reference", params)
        manager.wait()
        assert_trees_identical(manager.restore_frozen("reference", target, checksums=record), params)
        with pytest.raises(ckpt.CheckpointCorruptError, match="frozen tree 'reference' .* differ from the checksums"):
            manager.restore_frozen("reference", target, checksums=verify.record(other))
        moved = manager.set_aside_frozen("reference", ".stale")
        assert moved.name == "reference.stale" and not manager.has_frozen("reference")
        manager.save_frozen("reference", other)  # a fresh one in its place


# --------------------------------------------------------------------------- killed mid-save

_CHILD = textwrap.dedent("""
    import pathlib, sys, time
    import jax, jax.numpy as jnp
    from ppo_jax.checkpoint import CheckpointManager

    directory, mode, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    def state(step):  # random, so compression cannot shrink the write
        return {"w": jax.random.uniform(jax.random.key(step), (size,)), "step": jnp.int32(step)}
    manager = CheckpointManager(directory, max_to_keep=3)
    for step in (1, 2):
        manager.save(step, state(step), extra={"step": step})
    manager.wait()
    if mode == "before_commit":
        # Stall at the step's commit (the rename of its finished tmp directory, after each item
        # committed inside it): the kill then lands once every byte is written but before the
        # step counts as saved, the last moment a crash can strike.
        from orbax.checkpoint._src.path import atomicity
        commit = atomicity.AtomicRenameTemporaryPath.finalize
        async def stall_at_step_commit(self):
            if self.get_final().name != "3":
                return await commit(self)
            marker = pathlib.Path(directory).parent / "stalled"
            marker.with_suffix(".tmp").write_text(str(self))
            marker.with_suffix(".tmp").rename(marker)  # appears whole
            time.sleep(600)
        atomicity.AtomicRenameTemporaryPath.finalize = stall_at_step_commit
    next_state = state(3)
    jax.block_until_ready(next_state)
    print("saving step 3", flush=True)
    manager.save(3, next_state, extra={"step": 3})
    manager.wait()
    print("step 3 committed", flush=True)
""")


def _run_and_kill_mid_save(tmp_path: Path, mode: str, size: int) -> Path:
    """Starts a child that saves steps 1, 2 and 3; SIGKILLs it while step 3 is being saved."""
    directory = tmp_path / "run"
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT),
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    with open(tmp_path / "child.log", "w") as log:
        child = subprocess.Popen([sys.executable, str(script), str(directory), mode, str(size)],
                                 cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=log,
                                 text=True)
        tmp_step = directory / "3.orbax-checkpoint-tmp"
        deadline = time.monotonic() + 120
        try:
            while time.monotonic() < deadline and child.poll() is None:
                if mode == "before_commit" and (tmp_path / "stalled").exists():
                    break
                if mode == "while_writing" and tmp_step.exists():
                    break
                time.sleep(0.001)
            child.kill()  # SIGKILL: no handler, no cleanup
        finally:
            child.wait(timeout=60)
    output = child.stdout.read()
    log_tail = (tmp_path / "child.log").read_text()[-3000:]
    assert "saving step 3" in output, f"child did not reach the save of step 3:\n{log_tail}"
    assert child.returncode == -signal.SIGKILL, f"child ended on its own:\n{output}\n{log_tail}"
    return directory


@pytest.mark.parametrize("mode,size", [("before_commit", 1 << 16), ("while_writing", 1 << 24)])
def test_save_killed_mid_way_never_breaks_resume(tmp_path, mode, size):
    # while_writing: 64 MB of random floats take ~0.5 s to write, the poll reacts within ~1 ms;
    # a late kill (step 3 already committed) is retried in a fresh directory.
    for attempt in range(3):
        attempt_dir = tmp_path / f"attempt{attempt}"
        attempt_dir.mkdir()
        directory = _run_and_kill_mid_save(attempt_dir, mode, size)
        if not (directory / "3").exists():
            break
    entries = sorted(p.name for p in directory.iterdir())
    assert "3" not in entries, f"could not kill the child before its commit: {entries}"
    assert {"1", "2", "3.orbax-checkpoint-tmp"} <= set(entries), entries
    if mode == "before_commit":  # every item was written and committed inside the step's tmp dir
        items = sorted(p.name for p in (directory / "3.orbax-checkpoint-tmp").iterdir())
        assert {"state", "extra"} <= set(items) and "commit_success.txt" not in items, items

    def expected(step):
        return {"w": jax.random.uniform(jax.random.key(step), (size,)), "step": jnp.int32(step)}

    sharding = SingleDeviceSharding(jax.devices()[0])
    target = {"w": jax.ShapeDtypeStruct((size,), jnp.float32, sharding=sharding),
              "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding)}
    with ckpt.CheckpointManager(directory, max_to_keep=3) as manager:
        assert manager.all_steps() == [1, 2] and manager.latest_step() == 2
        restored, extra = manager.restore(abstract_state=target)  # the newest complete step
        assert extra == {"step": 2}
        assert_trees_identical(restored, expected(2))
        # The resumed run saves step 3 again over the leftovers.
        assert manager.save(3, expected(3), extra={"step": 3})
        manager.wait()
        assert manager.all_steps() == [1, 2, 3]
        restored, extra = manager.restore(abstract_state=target)
        assert_trees_identical(restored, expected(3))
        assert extra == {"step": 3}
    assert sorted(p.name for p in directory.iterdir() if "tmp" in p.name) == []


def test_only_partial_saves_means_no_checkpoint(tmp_path):
    """A first save killed mid-way: restore says there is none and names the partial save."""
    directory = tmp_path / "run"
    (directory / "1.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    sharding = SingleDeviceSharding(jax.devices()[0])
    with ckpt.CheckpointManager(directory) as manager:
        assert manager.all_steps() == []
        with pytest.raises(ckpt.CheckpointNotFoundError,
                           match=r"incomplete saves, ignored: 1\.orbax-checkpoint-tmp"):
            target = {"w": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=sharding)}
            manager.restore(abstract_state=target)


# --------------------------------------------------------------------------- two processes

_PROCESS = textwrap.dedent("""
    import sys
    process_id, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from ppo_jax.checkpoint import CheckpointManager

    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))  # 2 devices per process
    host = np.arange(32, dtype=np.float32).reshape(8, 4)
    by_rows, by_cols = NamedSharding(mesh, P("x")), NamedSharding(mesh, P(None, "x"))
    w = jax.make_array_from_callback(host.shape, by_rows, lambda index: host[index])
    state = {"w": w, "step": jax.device_put(np.int32(5), NamedSharding(mesh, P()))}
    manager = CheckpointManager(directory)  # every process makes the same calls
    manager.save(5, state, extra={"processes": 2})
    manager.save_frozen("reference", {"w": w})
    manager.wait()
    target = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=by_cols),
              "step": jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, P()))}
    restored, extra = manager.restore(abstract_state=target)
    frozen = manager.restore_frozen("reference", {"w": target["w"]})
    for array in (restored["w"], frozen["w"]):
        for shard in array.addressable_shards:  # this process's columns, read back
            np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index])
    assert extra == {"processes": 2} and int(restored["step"]) == 5
    manager.close()
    print("process", process_id, "ok", flush=True)
""")


def test_two_processes_save_collectively_and_restore_anywhere(tmp_path):
    """Each process writes only its own shards (Orbax's collective save; no host-0 gather); the
    checkpoint restores in both processes on a new sharding and in one process on 8 devices."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "process.py"
    script.write_text(_PROCESS)
    directory = tmp_path / "run"
    (directory / "99").mkdir(parents=True)  # holds no checkpoint: set aside by process 0 alone
    (directory / "99" / "x").write_text("not a checkpoint")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT))
    env.pop("XLA_FLAGS", None)  # jax_num_cpu_devices=2 in the children instead
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    children = []
    for i, log in enumerate(logs):
        with open(log, "w") as out:
            children.append(subprocess.Popen(
                [sys.executable, str(script), str(i), str(port), str(directory)],
                cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT))
    try:
        for child in children:
            child.wait(timeout=180)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    for i, (child, log) in enumerate(zip(children, logs)):
        text = log.read_text()
        assert child.returncode == 0 and f"process {i} ok" in text, text[-3000:]
    assert sum(len(_warnings(log.read_text())) for log in logs) == 1
    assert (directory / "99.corrupt" / "x").is_file() and not (directory / "99").exists()
    # Both processes wrote their own part of the array data.
    written = {p.name for p in (directory / "5" / "state").iterdir()}
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= written, written

    mesh = make_test_mesh((1, 8, 1))
    by_fsdp = NamedSharding(mesh, P("fsdp"))
    target = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=by_fsdp),
              "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))}
    with ckpt.CheckpointManager(directory) as manager:
        restored, extra = manager.restore(abstract_state=target)
    np.testing.assert_array_equal(restored["w"], np.arange(32, dtype=np.float32).reshape(8, 4))
    assert int(restored["step"]) == 5 and extra == {"processes": 2}
