"""The four kinds of rollout source (`rl/rollout_source.py`: whole and segmented samples, whole and
segmented episodes) crossed with what a run does beside training: evaluation, the sample logs, LoRA,
packed rows, and a resume with batches in flight.

Evaluation is its own path (a whole rollout of the current weights from the evaluation source); it
must take nothing from the training pipeline. So a run that evaluates and logs samples every
iteration, stopped by a real SIGTERM and resumed, trains exactly as one that does neither: every
training metric and the final adapters bit for bit."""

import json
import os

import jax
import numpy as np
import pytest
from conftest import make_test_mesh
from test_reliability import _toy_reward_then_sigterm_at
from tiny_configs import tiny_config

from ppo_jax import reward_functions as reward_fns
from ppo_jax.rl.trainer import PPOTrainer

PARTIAL = {"rollout.engine": "continuous", "rollout.partial_rollouts": True, "rollout.off_policy_steps": 2}
EPISODES = {"environment.name": "stateful_scripted_test_env", "environment.max_turns": 3,
            "environment.max_observation_tokens": 3, "rollout.response_length": 20,
            "policy.model.max_position_embeddings": 64}
KINDS = {
    "whole_samples": {"rollout.off_policy_steps": 1},
    "segmented_samples": PARTIAL,
    "whole_episodes": {**EPISODES, "rollout.off_policy_steps": 1},
    "segmented_episodes": {**EPISODES, **PARTIAL},
}
# LoRA adapters on the policy and packed rows in every kind.
COMMON = {"policy.lora.rank": 4, "policy.lora.alpha": 8.0, "policy.lora.targets": "o,fc,proj",
          "ppo.packing": "on", "rollout.batch_size": 16, "train.iterations": 2}
TOY = [(reward_fns.toy_target_count, 1.0)]


def trainer(workdir, kind, reward_functions, **overrides):
    import scripted_envs  # noqa: F401 (registers the test environments)

    config = tiny_config(**{**COMMON, **KINDS[kind], **overrides})
    return PPOTrainer(config, str(workdir), reward_functions=reward_functions, mesh=make_test_mesh((1, 1, 1)))


def training_metrics(row):
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/", "eval/"))}


@pytest.mark.parametrize("kind", list(KINDS))
def test_evaluation_and_samples_take_nothing_from_the_training_rollouts_and_resume(kind, tmp_path):
    straight = trainer(tmp_path / "straight", kind, TOY)
    expected = straight.train()
    expected_policy = jax.device_get(straight.state.policy)
    straight.close()

    side = {"train.eval_every": 1, "train.eval_batches": 1, "train.sample_every": 1}
    # The reward's first call scores iteration 1's batch: the run stops after iteration 1 (and its
    # evaluation) with the next batch in flight.
    first = trainer(tmp_path / "run", kind, [(_toy_reward_then_sigterm_at(1), 1.0)], **side)
    done = first.train()
    first.close()
    assert first.stopped_by == "SIGTERM" and len(done) == 1
    resumed = trainer(tmp_path / "run", kind, TOY, **side)
    assert resumed.resumed_from == 1 and len(resumed.rollouts.in_flight) == 1
    rest = resumed.train()
    resumed.close()

    history = done + rest
    assert [training_metrics(r) for r in history] == [training_metrics(r) for r in expected]  # bit for bit
    for a, b in zip(jax.tree.leaves(expected_policy), jax.tree.leaves(jax.device_get(resumed.state.policy))):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(r["eval/scores"]) and r["eval/length_mean"] > 0 for r in history)
    with open(os.path.join(tmp_path / "run", "samples.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert sorted(set(steps)) == [1, 2]
