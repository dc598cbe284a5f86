"""Trainers of equal inputs share their jitted programs (rl/shared_programs.py); any input that differs
builds its own."""

import dataclasses
import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import make_test_mesh
from tiny_configs import tiny_config

from ppo_jax.rl import build
from ppo_jax.models import CausalLM, ModelConfig, init_params
from ppo_jax.models.transformer import positions_from_mask
from ppo_jax.program_cache import ProgramCache, value_key
from ppo_jax.rl.shared_programs import shared_optimizers, shared_steps
from ppo_jax.rl.trainer import PPOTrainer


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    trainer = PPOTrainer(tiny_config(**{"train.iterations": 1}), str(tmp_path_factory.mktemp("first")),
                         mesh=make_test_mesh((1, 1, 1)))
    trainer.train()
    return trainer


def steps_args(trainer, **changes):
    """`shared_steps`' arguments as `trainer` passed them, `changes` replacing some."""
    args = dict(s=trainer.settings, mesh=trainer.mesh, sizes=trainer.sizes, hp=trainer.hp, modules=trainer.modules,
                policy_tx=trainer.policy_tx, value_tx=trainer.value_tx, state_shardings=trainer.state_shardings,
                frozen_shardings=trainer.frozen_shardings, stop_ids=trainer.stop_ids,
                pad_id=int(trainer.tokenizer.pad_token_id), sampler_mesh=trainer.meshes.sampler)
    return {**args, **changes}


def test_a_second_trainer_of_equal_settings_traces_nothing(first, tmp_path):
    second = PPOTrainer(tiny_config(**{"train.iterations": 1}), str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
    assert second.steps is first.steps and second.policy_tx is first.policy_tx
    sampler_traces = second.sampler.trace_count
    history = second.train()
    assert second.trace_counts == {"experience": 1, "update": 1} and second.sampler.trace_count == sampler_traces
    assert abs(history[0]["first_minibatch/ratio"] - 1.0) < 1e-6  # its own state through the shared programs


def test_trainers_that_differ_only_in_the_loop_share_programs(first, tmp_path):
    """Iterations, logging, samples and checkpoints are no program's input: a longer run with its own
    loop settings traces nothing, and trains its own state through the shared programs."""
    loop = {"train.iterations": 2, "train.log_every": 2, "train.sample_every": 1, "train.checkpoint_every": 1}
    longer = PPOTrainer(tiny_config(**loop), str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
    assert longer.steps is first.steps and longer.policy_tx is first.policy_tx
    sampler_traces = longer.sampler.trace_count
    history = longer.train()
    assert longer.trace_counts == {"experience": 1, "update": 1} and longer.sampler.trace_count == sampler_traces
    assert len(history) == 2 and all(abs(row["first_minibatch/ratio"] - 1.0) < 1e-6 for row in history)
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [2]  # log_every=2
    assert sorted(d for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()) == ["1", "2"]  # checkpoint_every=1


def test_a_decaying_schedule_keys_its_length(first):
    """A constant learning rate never reads the run's length, so its optimizers are shared across
    lengths; a linear or cosine decay spans the run's optimizer steps, so its optimizers (and the update
    built on them) are not, and each decays over its own run."""
    settings = first.settings
    longer = lambda s: dataclasses.replace(s, train=dataclasses.replace(s.train, iterations=5))  # noqa: E731
    assert shared_optimizers(longer(settings)) == shared_optimizers(settings)
    linear = dataclasses.replace(settings, optim=dataclasses.replace(settings.optim, schedule="linear"))
    short_tx, long_tx = shared_optimizers(linear)[0], shared_optimizers(longer(linear))[0]
    assert short_tx is not long_tx
    # The learning rate each applies at the last step of the short run (4 optimizer steps: 1 iteration
    # of 2 epochs x 2 minibatches), against its first (Adam's step on constant gradients is the rate):
    # linear to 0 over 4 steps, 1 - 3/4; over the longer run's 20, 1 - 3/20.
    params = {"w": np.zeros(3, np.float32)}

    def step_sizes(tx, steps):
        state, sizes = tx.init(params), []
        for _ in range(steps):
            update, state = tx.update({"w": np.ones(3, np.float32)}, state, params)
            sizes.append(float(np.abs(update["w"][0])))
        return sizes

    short, long = step_sizes(short_tx, 4), step_sizes(long_tx, 4)
    np.testing.assert_allclose([short[-1] / short[0], long[-1] / long[0]], [0.25, 0.85], rtol=1e-4)
    assert shared_steps(**steps_args(first, s=linear, policy_tx=short_tx)) is not shared_steps(
        **steps_args(first, s=longer(linear), policy_tx=long_tx))


def test_another_setting_builds_its_own_programs(first, tmp_path):
    other = PPOTrainer(tiny_config(**{"train.iterations": 1, "ppo.clip_eps": 0.1}), str(tmp_path),
                       mesh=make_test_mesh((1, 1, 1)))
    assert other.steps is not first.steps
    other.train()
    assert other.trace_counts == {"experience": 1, "update": 1}


def test_every_input_of_the_programs_is_in_the_key(first):
    settings = first.settings
    one_device = make_test_mesh((1, 1, 1))
    two_devices = make_test_mesh((2, 1, 1))
    rebuilt = shared_steps(**steps_args(first, mesh=one_device, sampler_mesh=one_device))
    assert rebuilt is first.steps  # equal meshes built apart are the same key
    changes = {
        "s": dataclasses.replace(settings, ppo=dataclasses.replace(settings.ppo, vf_coef=0.5)),
        "mesh": two_devices, "sampler_mesh": two_devices,
        "sizes": dataclasses.replace(first.sizes, rollout_rows=first.sizes.rollout_rows // 2),
        "hp": dataclasses.replace(first.hp, clip_eps=0.3),
        "modules": dataclasses.replace(first.modules, reward=first.modules.value),
        "policy_tx": build.make_optimizers(settings)[0],
        "value_tx": build.make_optimizers(settings)[1],
        "state_shardings": jax.tree.map(lambda _: jax.sharding.NamedSharding(two_devices, jax.P()),
                                        first.state_shardings),
        "frozen_shardings": jax.tree.map(lambda _: jax.sharding.NamedSharding(two_devices, jax.P()),
                                         first.frozen_shardings),
        "stop_ids": [*first.stop_ids, 7],
        "pad_id": int(first.tokenizer.pad_token_id) + 1,
    }
    for name, value in changes.items():  # building jits nothing yet: each costs no trace
        assert shared_steps(**steps_args(first, **{name: value})) is not first.steps, name
        assert shared_steps(**steps_args(first)) is first.steps


def test_the_cache_keeps_the_last_ones_and_builds_what_it_cannot_key():
    cache, built = ProgramCache(capacity=2), []

    def make(tag):
        return lambda: built.append(tag) or tag

    for tag in ("a", "b", "a", "c", "b"):  # "b" was the least recently used when "c" came
        cache.get(value_key(tag), make(tag))
    assert built == ["a", "b", "c", "b"]  # five lookups, one of them a hit
    assert value_key(["unhashable", {1: [2]}], object()) is not None  # lists and dicts are pytrees
    assert value_key(bytearray(b"x")) is None
    cache.get(value_key(bytearray(b"x")), make("x"))
    cache.get(value_key(bytearray(b"x")), make("x"))
    assert built[-2:] == ["x", "x"]


@pytest.mark.parametrize("scan_layers", [True, False])
def test_one_init_program_serves_every_seed_with_flax_own_draws(scan_layers):
    # The seed is the shared init program's argument: a key baked into it would hand the second seed
    # the first seed's weights. Per-layer blocks draw as the scanned model does (models/init.py).
    config = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=2,
                         max_position_embeddings=32, scan_layers=scan_layers)
    mesh = make_test_mesh((1, 1, 1))
    first, _ = init_params(CausalLM(config), jax.random.key(1), mesh)
    second, _ = init_params(CausalLM(config), jax.random.key(2), mesh)
    tokens = np.zeros((1, 8), np.int32)
    mask = np.ones((1, 8), np.int32)
    scanned = CausalLM(config.replace(scan_layers=True))
    # flax's init, jitted as every init is
    flax_draws = jax.jit(lambda: nn.unbox(scanned.init(jax.random.key(2), tokens, positions_from_mask(mask),
                                                       mask)["params"]))()
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])  # noqa: E731
    # per-layer: the same values; to round-off (another program, another fusion of the draws)
    np.testing.assert_allclose(np.sort(flat(second)), np.sort(flat(flax_draws)), rtol=1e-6, atol=1e-7)
    assert not np.allclose(np.sort(flat(first)), np.sort(flat(second)), rtol=1e-3)
