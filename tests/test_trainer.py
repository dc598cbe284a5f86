"""End-to-end PPO trainer: DESIGN.md §5 invariants from logged metrics of real steps, mesh
equivalence, no recompilation, learning on the toy task (GAE, GRPO, RLOO), and config validation."""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import TEST_XLA_FLAGS, make_test_mesh, train_and_check_nothing_moved

from ppo_jax.config import ConfigError
from tiny_configs import tiny_config  # noqa: F401 (re-exported for other tests)
from ppo_jax.rl.sampler_settings import sampling_config
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.trainer import PPOTrainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(config, tmp_path, mesh_shape=(1, 1, 1), iterations=None):
    if iterations is not None:
        config.train.iterations = iterations
    trainer = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh(mesh_shape))
    return trainer, trainer.train()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Two iterations on one device: the reference for the mesh-equivalence tests."""
    trainer, history = run(tiny_config(), tmp_path_factory.mktemp("base"), iterations=2)
    return trainer, history


def test_first_minibatch_ratio_is_one_and_rollout_logprobs_match(baseline):
    _, history = baseline
    for row in history:
        assert abs(row["first_minibatch/ratio"] - 1.0) < 1e-6
        assert row["first_minibatch/approxkl"] < 1e-12
        assert row["first_minibatch/clipfrac"] == 0.0
        # The sampler's log-probs and the training forward's are the same numbers.
        assert row["policy/rollout_logprob_diff_max"] < 1e-5
    # The policy did move after the first minibatch.
    assert history[0]["val/ratio"] != 1.0


def test_no_recompilation_after_first_iteration(baseline):
    trainer, _ = baseline
    assert trainer.trace_counts == {"experience": 1, "update": 1}
    assert trainer.sampler.trace_count == 1
    trainer.run_iteration()
    assert trainer.trace_counts == {"experience": 1, "update": 1}
    assert trainer.sampler.trace_count == 1


def test_learning_rate_zero_changes_nothing(tmp_path):
    config = tiny_config(**{"optim.policy_lr": 0.0, "optim.value_lr": 0.0, "train.iterations": 3})
    train_and_check_nothing_moved(PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1))))


# (The last: a dense model on a mesh with an expert axis, which shards its batch and weights like fsdp.)
@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4), (2, 1, 2, 2)],
                         ids=lambda s: "mesh" + "x".join(map(str, s)))
def test_meshes_give_the_same_metrics(baseline, mesh_shape, tmp_path):
    _, expected = baseline
    _, history = run(tiny_config(), tmp_path, mesh_shape, iterations=2)
    for want, got in zip(expected, history):
        for key, value in want.items():
            if key.startswith(("time/", "perf/")):
                continue
            np.testing.assert_allclose(got[key], value, rtol=2e-3, atol=2e-4, err_msg=key)


def test_continuous_engine_on_a_mesh_gives_the_static_runs_metrics(baseline, tmp_path):
    """The continuous engine samples the static engine's tokens (same key), so a PPO run on it logs
    the same numbers, here on 8 devices too, and reports how busy its decode slots were."""
    _, expected = baseline
    config = tiny_config(**{"rollout.engine": "continuous", "rollout.slots": 8})
    trainer, history = run(config, tmp_path, (2, 2, 2), iterations=2)
    for want, got in zip(expected, history):
        for key, value in want.items():
            if key.startswith(("time/", "perf/")):
                continue
            np.testing.assert_allclose(got[key], value, rtol=2e-3, atol=2e-4, err_msg=key)
        assert got["policy/rollout_logprob_diff_max"] < 1e-5
        assert 0.5 < got["perf/slot_occupancy"] <= 1.0 and 0.5 < want["perf/slot_occupancy"] <= 1.0
    assert trainer.sampler.trace_count == 1


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo"])
def test_toy_task_score_at_least_doubles(estimator, tmp_path):
    overrides = {"ppo.advantage_estimator": estimator, "optim.policy_lr": 3e-3, "optim.value_lr": 3e-3,
                 "ppo.kl_coef": 0.0, "ppo.epochs": 4, "ppo.num_minibatches": 1, "ppo.num_microbatches": 1}
    if estimator != "gae":
        overrides.update({"rollout.num_samples": 4, "rollout.batch_size": 8})
    config = tiny_config(**overrides)
    _, history = run(config, tmp_path, iterations=12)
    first = np.mean([h["objective/scores"] for h in history[:2]])
    last = np.mean([h["objective/scores"] for h in history[-2:]])
    assert last >= 2 * first and last > 0.15, (estimator, first, last)


def test_python_reward_function_passed_in_code(tmp_path):
    """A reward function given as a Python callable (not a config string) drives learning too."""

    def says_w9(prompts, responses):
        return [r.split().count("w9") / max(len(r.split()), 1) for r in responses]

    config = tiny_config(**{"reward.functions": "", "optim.policy_lr": 3e-3, "optim.value_lr": 3e-3,
                            "ppo.kl_coef": 0.0, "ppo.epochs": 4, "ppo.num_minibatches": 1,
                            "ppo.num_microbatches": 1, "train.iterations": 12})
    trainer = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)),
                         reward_functions=[(says_w9, 1.0)])
    history = trainer.train()
    first = np.mean([h["objective/scores"] for h in history[:2]])
    last = np.mean([h["objective/scores"] for h in history[-2:]])
    assert last >= 2 * first and last > 0.15, (first, last)


INVALID = [
    ({"rollout.batch_size": 33}, "not divisible by ppo.num_minibatches"),
    ({"ppo.num_microbatches": 3}, "not divisible by ppo.num_microbatches=3"),
    ({"rollout.temperature": 0.0}, "rollout.temperature must be > 0"),
    ({"optim.policy_lr": -1e-3}, "optim.policy_lr must be >= 0"),
    ({"optim.value_lr": 1e39}, "optim.value_lr must be >= 0 and at most float32's largest value"),
    ({"optim.b1": 1.5}, "optim.b1 must be in"),
    ({"ppo.clip_eps": 0.0}, "ppo.clip_eps must be > 0"),
    ({"rollout.response_length": 40}, "exceeds the model's max_position_embeddings=32"),
    ({"ppo.advantage_estimator": "grpo"}, "set rollout.num_samples >= 2"),
    ({"ppo.advantage_estimator": "ppo2"}, "ppo.advantage_estimator='ppo2'"),
    ({"reward.functions": ""}, "no reward: set reward.path"),
    ({"rollout.stop_token_ids": "99"}, "outside the vocabulary"),
    ({"value.init": "reward"}, "value.init='reward' needs reward.path"),
    ({"ppo.kl_estimator": "k4"}, "ppo.kl_estimator='k4'"),
    ({"data.truncation": "right"}, "data.truncation='right'"),
    ({"rollout.decode": "fast"}, "rollout.decode='fast'"),
    ({"rollout.engine": "vllm"}, "rollout.engine='vllm': use one of static, continuous"),
    ({"rollout.slots": 8}, "rollout.slots=8, rollout.prefill_prompts=0 are settings of the continuous engine"),
    ({"rollout.engine": "continuous", "rollout.slots": 64}, "rollout.slots=64 is more than the 32 rows"),
    ({"reward.overlong_buffer": 99}, "reward.overlong_buffer=99, reward.overlong_penalty=1.0: the buffer is 0 (off) to"),
]


def test_rollout_decode_chooses_the_sampler_loop():
    for decode, unroll in (("auto", None), ("scan", False), ("unrolled", True)):
        config = tiny_config(**{"rollout.decode": decode})
        assert sampling_config(Settings.from_config(config), (2,), 0).unroll_layers is unroll
    # The planner's override wins over the config.
    config = tiny_config(**{"rollout.decode": "unrolled"})
    assert sampling_config(Settings.from_config(config), (2,), 0, unroll_layers=False).unroll_layers is False


@pytest.mark.parametrize("overrides,message", INVALID, ids=[m for _, m in INVALID])
def test_invalid_config_fails_before_compiling_with_its_message(overrides, message, tmp_path):
    config = tiny_config(**overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PPOTrainer(config, str(tmp_path / "run"), mesh=make_test_mesh((1, 1, 1)))
    assert not (tmp_path / "run").exists()  # nothing written


def test_slots_not_divisible_by_devices(tmp_path):
    config = tiny_config(**{"rollout.engine": "continuous", "rollout.slots": 12})
    with pytest.raises(ConfigError, match="rollout.slots=12 is not a multiple of the 8 data-parallel devices"):
        PPOTrainer(config, str(tmp_path / "run"), mesh=make_test_mesh((8, 1, 1)))
    assert not (tmp_path / "run").exists()


def test_batch_not_divisible_by_devices(tmp_path):
    config = tiny_config(**{"rollout.batch_size": 4, "ppo.num_minibatches": 1, "ppo.num_microbatches": 1})
    with pytest.raises(ConfigError, match="8 data-parallel devices"):
        PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((8, 1, 1)))


def test_cli_writes_metrics_tensorboard_and_samples(tmp_path):
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ppo_jax.cli.train", f"--config={REPO}/configs/ppo_toy.py",
           f"--workdir={workdir}", "--config.train.iterations=2", "--config.train.sample_every=1",
           "--config.train.eval_every=2", "--config.train.progress=False",
           "--config.rollout.batch_size=8", "--config.rollout.response_length=4",
           "--config.data.prompt_length=8", "--config.ppo.epochs=1"]
    env = {**os.environ, "XLA_FLAGS": f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count=1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    for name in ("objective/scores", "objective/kl", "objective/kl_coef", "objective/entropy",
                 "objective/rlhf_reward", "objective/non_score_reward", "policy/approxkl_avg",
                 "policy/clipfrac_avg", "policy/entropy_avg", "loss/policy_avg", "loss/value_avg",
                 "val/clipfrac_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens",
                 "time/generate", "time/update", "perf/tokens_per_sec", "eval/scores"):
        assert name in rows[-1], name
    assert os.listdir(workdir / "tensorboard")
    samples = [json.loads(line) for line in open(workdir / "samples.jsonl")]
    assert {"prompt", "response", "score", "kl", "step"} <= set(samples[0])


def test_cli_rejects_a_misspelled_field(tmp_path):
    cmd = [sys.executable, "-m", "ppo_jax.cli.train", f"--config={REPO}/configs/ppo_toy.py",
           f"--workdir={tmp_path}", "--config.ppo.clip_epz=0.1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == ("error: unknown config field --config.ppo.clip_epz: ppo has no field 'clip_epz'; "
                                  "did you mean --config.ppo.clip_eps?")
    assert not any(tmp_path.iterdir())


def test_close_ends_the_metric_writers_thread(tmp_path):
    """A trainer stepped by hand (`run_iteration`, then `close`, as in a notebook) leaves no TensorBoard
    writer thread or open event file behind; `train` closing it too is harmless."""
    def writer_threads():
        return {t for t in threading.enumerate() if type(t).__name__ == "_EventLoggerThread" and t.is_alive()}

    before = writer_threads()
    trainer = PPOTrainer(tiny_config(), str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
    assert writer_threads() - before  # the trainer's TensorBoard writer runs one
    trainer.close()
    assert not writer_threads() - before
    trainer.close()  # twice: nothing left to end, no error
