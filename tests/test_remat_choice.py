"""compute.remat="auto" on a GPU (rl/remat_choice.py): the update is compiled without remat first and
kept where XLA's buffer assignment fits the devices' free memory, else compiled with full remat. The
GPU is stood in for on CPU: the rule that says "this is a GPU run" and the devices' free memory are
replaced, everything else is the trainer's own path."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_configs import tiny_config

from ppo_jax import sharding
from ppo_jax.rl import remat_choice
from ppo_jax.rl.trainer import PPOTrainer


def test_the_first_candidate_that_fits_is_kept_and_the_others_are_not_compiled():
    n = 512
    traces = []

    def outer(x):  # an [n, n] temporary (a sort cannot be fused away): n * n * 4 bytes
        traces.append("outer")
        return jnp.sum(jnp.sort(jnp.outer(x, x).ravel())) * 0.5

    def factored(x):  # the same value without it
        traces.append("factored")
        return 0.5 * jnp.sum(x) ** 2

    x = jnp.arange(n, dtype=jnp.float32) / n
    candidates = (("outer", jax.jit(outer)), ("factored", jax.jit(factored)))
    roomy = remat_choice.MemoryChosenUpdate(candidates, free_bytes=lambda: 1 << 30, log=lambda _: None)
    np.testing.assert_allclose(roomy(x), 0.5 * float(np.sum(np.asarray(x))) ** 2, rtol=1e-5)
    assert roomy.chosen == "outer" and traces == ["outer"]  # fits: the second never compiled
    assert roomy.allocated["outer"] >= n * n * 4

    traces.clear()
    tight = remat_choice.MemoryChosenUpdate(candidates, free_bytes=lambda: n * n * 4, log=lambda _: None)
    tight(x)
    assert tight.chosen == "factored" and "outer" in tight.report and "factored" in tight.report

    unknown = remat_choice.MemoryChosenUpdate(candidates, free_bytes=lambda: None, log=lambda _: None)
    traces.clear()
    unknown(x)
    assert unknown.chosen == "factored" and traces in ([], ["factored"])  # no memory figure: the safe one


def _device(process, limit, used):
    stats = None if limit is None else {"bytes_limit": limit, "bytes_in_use": used}
    return types.SimpleNamespace(process_index=process, memory_stats=lambda: stats)


def test_free_memory_is_the_smallest_of_every_device_of_every_process():
    """Every process gets the same figure, so a choice or refusal made from it is the same everywhere."""
    devices = [_device(0, 100, 30), _device(0, 100, 60), _device(1, 100, 0)]  # process 1's: not this one's
    assert sharding.free_device_bytes(devices, gather=lambda mine: np.stack([mine, np.int64(25)])) == 25
    assert sharding.free_device_bytes(devices, gather=lambda mine: np.stack([mine, np.int64(90)])) == 40
    assert sharding.free_device_bytes([_device(0, None, 0)]) is None  # a CPU reports nothing


def test_the_rule_is_for_gpu_runs_whose_model_sets_no_remat():
    assert remat_choice.applies("auto", "gpu", model_sets_remat=False)
    assert not remat_choice.applies("auto", "gpu", model_sets_remat=True)
    assert not remat_choice.applies("full", "gpu", model_sets_remat=False)
    assert not remat_choice.applies("auto", "cpu", model_sets_remat=False)


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """The trainer's path on CPU as on a GPU with `free["bytes"]` free per device."""
    free = {"bytes": 1 << 40}
    monkeypatch.setattr(remat_choice, "applies", lambda *args, **kwargs: True)
    monkeypatch.setattr(sharding, "free_device_bytes", lambda devices: free["bytes"])
    return free


def test_the_trainer_drops_remat_where_the_update_fits_and_learns_the_same(tmp_path, as_on_a_gpu):
    def run(name):
        trainer = PPOTrainer(tiny_config(**{"train.iterations": 2, "compute.remat": "full"}), str(tmp_path / name))
        trainer.train()
        out = trainer.steps.update_jit, jax.device_get(trainer.state.policy)
        trainer.close()
        return out

    roomy, roomy_policy = run("roomy")
    as_on_a_gpu["bytes"] = 1  # nothing fits
    tight, tight_policy = run("tight")
    assert roomy.chosen == "none" and tight.chosen == "full"
    # Without remat the backward pass keeps the layers' activations: more bytes, and the same update.
    assert roomy.allocated["none"] > tight.allocated["full"]
    for a, b in zip(jax.tree.leaves(roomy_policy), jax.tree.leaves(tight_policy)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
