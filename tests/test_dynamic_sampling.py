"""DAPO's dynamic sampling (rl/dynamic_sampling.py): groups whose rewards are all equal are dropped
and the batch refilled with more prompts' groups, on both engines, on- and off-policy, resumed bit
for bit."""

import numpy as np
import pytest
from conftest import make_test_mesh
from test_reliability import _toy_reward_then_sigterm_at
from tiny_configs import tiny_config

from ppo_jax import sharding
from ppo_jax.config import ConfigError
from ppo_jax.rl.dynamic_sampling import choose_groups, varying_groups
from ppo_jax.rl.trainer import PPOTrainer


def test_varying_groups_and_the_choice_follow_the_papers_rule():
    """A NumPy transcription: a group is kept iff its rewards' standard deviation is not 0 (DAPO's
    0 < |{o_i : is_equivalent(a, o_i)}| < G); the batch takes the kept groups in sampling order, and
    short of B the first batch's dropped ones."""
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 2, 16).astype(np.float32) * (rng.random(16) < 0.4) for _ in range(3)]
    varying = [varying_groups(p, 4) for p in parts]
    for p, v in zip(parts, varying):
        np.testing.assert_array_equal(v, p.reshape(-1, 4).std(axis=1) > 0)
    want, dropped_first = [], []
    for i, v in enumerate(varying):
        for g in range(len(v)):
            if v[g] and len(want) < 4:
                want.append((i, g))
            if not v[g] and i == 0:
                dropped_first.append((0, g))
    choice = choose_groups(varying, 4)
    assert choice.groups == want + dropped_first[:4 - len(want)]
    assert choice.sampled_groups == 12 and choice.dropped_groups == sum(int((~v).sum()) for v in varying)
    few = choose_groups([np.array([False, True, False, False])], 4)  # nothing more sampled: refilled
    assert few.groups == [(0, 1), (0, 0), (0, 2), (0, 3)] and few.refilled_with_dropped == 3


def has_w7(prompts, responses):
    """1 when the response says "w7": about a third of the tiny policy's groups of 4 are all 0."""
    return [float("w7" in r.split()) for r in responses]


BASE = {"ppo.advantage_estimator": "grpo", "rollout.num_samples": 4, "rollout.batch_size": 8,
        "train.iterations": 3, "dynamic_sampling.enabled": True, "dynamic_sampling.max_extra_batches": 2}
ENGINES = {"static_on_policy": {},
           "continuous_partial_k1": {"rollout.engine": "continuous", "rollout.partial_rollouts": True,
                                     "rollout.off_policy_steps": 1}}


def trainer_at(workdir, reward, **overrides):
    return PPOTrainer(tiny_config(**{**BASE, **overrides}), str(workdir), reward_functions=[(reward, 1.0)],
                      mesh=make_test_mesh((1, 1, 1)))


@pytest.fixture(scope="module", params=list(ENGINES))
def straight(request, tmp_path_factory):
    """A run with dynamic sampling on `engine`: its engine, history, and what each iteration's
    experience step saw (step, prompt tokens and mask, tokens, mask, host scores, row versions)."""
    trainer = trainer_at(tmp_path_factory.mktemp("straight"), has_w7, **ENGINES[request.param])
    seen, experience = [], trainer._experience

    def recording(state, frozen, rollout):
        seen.append((int(state.step), *sharding.to_host((rollout.prompt_tokens, rollout.prompt_mask, rollout.tokens,
                                                         rollout.mask, rollout.host_scores, rollout.policy_version))))
        return experience(state, frozen, rollout)

    trainer._experience = recording
    history = trainer.train()
    trainer.close()
    return request.param, history, seen, trainer.decode


def test_the_trained_batch_holds_varying_groups_scored_row_for_row(straight):
    engine, history, seen, decode = straight
    assert sum(r["rollout/dynamic_extra_rows"] for r in history) > 0  # the refill ran
    for row, (step, pt, pm, t, m, scores, versions) in zip(history, seen, strict=True):
        # Each row's score is that of its own text (the rows and their scores moved together).
        prompts, responses = decode(pt, pm, t, m)
        np.testing.assert_array_equal(scores, np.asarray(has_w7(prompts, responses), np.float32))
        assert (~varying_groups(scores, 4)).sum() == row["rollout/dynamic_refilled_with_dropped"]
        assert row["rollout/dynamic_extra_rows"] % 32 == 0 and 0 <= row["rollout/dynamic_dropped_share"] < 1
        # Extra rows are the iteration's own; the pipeline's carry their batch's version.
        lag = 1 if engine == "continuous_partial_k1" and step > 0 else 0
        assert set(np.unique(versions)) <= {step - lag, step}


@pytest.mark.parametrize("straight", ["continuous_partial_k1"], indirect=True)
def test_off_policy_partial_refill_resumes_bit_for_bit(straight, tmp_path):
    engine, expected, _, _ = straight
    stop = _toy_reward_then_sigterm_at(3)

    def has_w7_then_sigterm(prompts, responses):
        stop(prompts, responses)
        return has_w7(prompts, responses)

    first = trainer_at(tmp_path, has_w7_then_sigterm, **ENGINES[engine])
    done = first.train()
    first.close()
    assert first.stopped_by == "SIGTERM" and 0 < len(done) < 3
    resumed = trainer_at(tmp_path, has_w7, **ENGINES[engine])
    assert len(resumed.rollouts.in_flight) == 1
    rest = resumed.train()
    resumed.close()
    comparable = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))}  # noqa: E731
    assert [comparable(r) for r in done + rest] == [comparable(r) for r in expected]


@pytest.mark.parametrize("overrides, message", [
    ({"rollout.num_samples": 1, "ppo.advantage_estimator": "gae"}, "dynamic_sampling.enabled needs groups: rollout.num_samples >= 2"),
    ({"dynamic_sampling.max_extra_batches": 0}, "dynamic_sampling.max_extra_batches must be >= 1"),
    ({"reward.path": "/nowhere"}, "set roles.scoring=sampler"),
    ({"environment.name": "tools"}, "multi-turn episodes are not refilled yet"),
])
def test_bad_dynamic_sampling_settings_fail_in_one_line(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        trainer_at(tmp_path, has_w7, **overrides)
