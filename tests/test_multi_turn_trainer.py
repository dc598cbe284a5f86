"""The PPO trainer on multi-turn rows (environment.name set, rl/episodes.py): DESIGN.md §5's
invariants where observations are context, not actions.

A tiny GPT-2 on the toy task and a scripted environment: each turn ends at "w3" or "w4"; the
environment answers with 1-4 "w9" words (by the turn's length, so rows wait for different
observations and some are cut to the cap), pays 0, 0.25 or 0.5 per turn and ends the episode after 3
steps. Deterministic: what it answers depends on the tokens only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_test_mesh, train_and_check_nothing_moved
from scripted_envs import Scripted  # noqa: F401 (registers the scripted_test_env family)
from tiny_configs import tiny_config

from ppo_jax.config import ConfigError
from ppo_jax.models import forward
from ppo_jax.rl import objective
from ppo_jax.rl.experience import experience_from_outputs
from ppo_jax.rl.forwards import ForwardOutputs
from ppo_jax.rl.objective import LossBatch
from ppo_jax.rl.state import FrozenParams, Trainable
from ppo_jax.rl.trainer import PPOTrainer


def multi_turn_config(**overrides):
    return tiny_config(**{"environment.name": "scripted_test_env", "environment.max_turns": 3,
                          "environment.max_observation_tokens": 3, "rollout.batch_size": 16,
                          "rollout.response_length": 20, "policy.model.max_position_embeddings": 64,
                          "train.iterations": 2, **overrides})


def run(config, tmp_path, mesh_shape=(1, 1, 1)):
    trainer = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh(mesh_shape))
    return trainer, trainer.train()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return run(multi_turn_config(), tmp_path_factory.mktemp("multi_turn"))


def observations(rollout):
    """[B, Lr] bool: the observation tokens of a rollout (real, not the policy's)."""
    mask, actions = np.asarray(rollout.mask), np.asarray(rollout.action_mask)
    return (mask == 1) & (actions == 0)


def test_episodes_have_observations_and_their_metrics(baseline):
    trainer, history = baseline
    rollout, _ = trainer._last_rollout
    assert observations(rollout).sum() > 10  # the invariants below are not vacuous
    for row in history:
        assert 1.0 < row["rollout/turns"] <= 3.0
        assert row["rollout/observation_tokens"] > 0 and row["rollout/action_tokens"] > 0
        assert row["rollout/tool_calls"] > 0 and row["rollout/tool_errors"] > 0
        assert row["rollout/observations_truncated"] > 0  # some 4-word answers meet the cap of 3
        assert row["time/environment"] > 0.0
        assert row["objective/environment_rewards"] > 0.0
        # The action tokens only, as the PPO math counts them.
        assert row["response/length_mean"] * 16 == pytest.approx(row["rollout/action_tokens"])


def test_rollout_logprobs_equal_the_training_forward_on_action_tokens(baseline):
    """Logged: the experience forward's log-probs vs the sampler's, on action tokens. Recomputed
    here: a fresh rollout of the current policy vs one forward over prompt + response with every
    real token (observations included) as context."""
    trainer, history = baseline
    for row in history:
        assert row["policy/rollout_logprob_diff_max"] < 1e-5
    rollout, _ = trainer.rollout(*trainer.prompts.next_batch(), jax.random.key(7))
    actions = np.asarray(rollout.action_mask)
    logits = forward.response_logits(trainer.modules.policy, trainer.state.policy, rollout.prompt_tokens,
                                      rollout.prompt_mask, rollout.tokens, rollout.mask,
                                      trainer.settings.rollout.temperature)
    logprobs = np.asarray(forward.token_logprobs(logits, rollout.tokens, rollout.action_mask))
    sampled = np.asarray(rollout.sampler_logprobs)
    assert observations(rollout).any() and np.all(sampled[observations(rollout)] == 0.0)
    np.testing.assert_allclose(logprobs * actions, sampled * actions, atol=1e-5)


def test_first_minibatch_ratio_is_one(baseline):
    _, history = baseline
    for row in history:
        assert abs(row["first_minibatch/ratio"] - 1.0) < 1e-6
        assert row["first_minibatch/approxkl"] < 1e-12
        assert row["first_minibatch/clipfrac"] == 0.0
    assert history[0]["val/ratio"] != 1.0  # the policy did move


def test_grpo_groups_of_episodes(tmp_path):
    """rollout.num_samples = 2 with GRPO: 8 prompts become 16 episodes, row r from prompt r // 2, each
    reset in its own environment and drawing its own tokens. Each row's advantage is GRPO's (NumPy
    here) of its episode's reward: the score plus every turn's environment reward (KL as a loss term,
    so none in the reward); the invariants hold."""
    config = multi_turn_config(**{"rollout.batch_size": 8, "rollout.num_samples": 2, "train.iterations": 1,
                                  "ppo.advantage_estimator": "grpo", "ppo.kl_in_reward": False})
    trainer, history = run(config, tmp_path)
    rollout, exp = trainer._last_rollout
    prompts, tokens = np.asarray(rollout.prompt_tokens), np.asarray(rollout.tokens)
    np.testing.assert_array_equal(prompts[0::2], prompts[1::2])
    assert len({row.tobytes() for row in prompts[0::2]}) > 1
    assert (tokens[0::2] != tokens[1::2]).any(axis=1).sum() >= 4  # a prompt's two episodes differ
    assert observations(rollout).any()
    episode = np.asarray(exp.scores) + np.asarray(rollout.turns.rewards).sum(-1)
    groups = episode.reshape(-1, 2)
    want = ((groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)
    actions = np.asarray(rollout.action_mask) == 1
    advantages = np.asarray(exp.advantages)
    assert np.abs(advantages[~actions]).max() == 0.0
    for row in range(len(want)):
        np.testing.assert_allclose(advantages[row][actions[row]], want[row], rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(rollout.turns.rewards)).sum() > 0  # the turn rewards are in the check
    assert history[0]["policy/rollout_logprob_diff_max"] < 1e-5
    assert abs(history[0]["first_minibatch/ratio"] - 1.0) < 1e-6


def test_learning_rate_zero_changes_nothing(tmp_path):
    """On padded rows (the baseline runs packed on a CPU): both layouts' loss masks are checked."""
    config = multi_turn_config(**{"optim.policy_lr": 0.0, "optim.value_lr": 0.0, "ppo.packing": "off"})
    train_and_check_nothing_moved(PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1))))


def _perturbed(x, where, by=3.0):
    return jnp.where(jnp.asarray(where), x + by, x)


def test_observation_tokens_get_no_advantage_and_do_not_change_the_loss(baseline):
    trainer, _ = baseline
    rollout, exp = trainer._last_rollout
    obs = observations(rollout)
    for name in ("advantages", "returns", "old_logprobs", "ref_logprobs", "values"):
        assert np.all(np.asarray(getattr(exp, name))[obs] == 0.0), name
    # The experience math: the models' outputs on observation tokens (a value is GAE's bootstrap, a
    # log-prob the KL's input) change nothing it computes.
    b, length = rollout.tokens.shape
    key = jax.random.key(3)
    out = ForwardOutputs(*(jax.random.normal(jax.random.fold_in(key, i), (b, length)) for i in range(4)),
                         scores=jnp.zeros((b,)))
    noisy = out.replace(**{f: _perturbed(getattr(out, f), obs) for f in ("logprobs", "ref_logprobs", "values",
                                                                        "entropy")})
    hp = trainer.hp
    coef = jnp.asarray(0.05)
    want, _ = experience_from_outputs(out, rollout, coef, hp)
    got, _ = experience_from_outputs(noisy, rollout, coef, hp)
    for field in ("advantages", "returns", "old_logprobs", "ref_logprobs", "values", "sequence_kl", "scores"):
        np.testing.assert_allclose(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), rtol=1e-6,
                                   atol=1e-6, err_msg=field)
    # The loss: advantages, old log-probs, returns and values of observation tokens are not read.
    params, frozen = Trainable(trainer.state.policy, trainer.state.value), FrozenParams(None, None)
    num_tokens = jnp.asarray(float(np.asarray(rollout.action_mask).sum()))

    def loss_of(e):
        return objective.padded_loss(trainer.modules, params, frozen, LossBatch(e, num_tokens, coef), hp)[0]

    fields = ("advantages", "old_logprobs", "returns", "values")
    base = float(loss_of(exp))
    moved = float(loss_of(exp.replace(**{f: _perturbed(getattr(exp, f), obs) for f in fields})))
    assert moved == pytest.approx(base, rel=1e-6, abs=1e-7)
    # ... while the same change on action tokens does move it (the check can fail).
    actions = np.asarray(rollout.action_mask) == 1
    assert float(loss_of(exp.replace(advantages=_perturbed(exp.advantages, actions)))) != pytest.approx(base)


def _compressed(x, actions):
    """[B, L] -> each row's action-token values moved to its first columns, 0 after."""
    x, out = np.asarray(x), np.zeros(np.shape(x), np.asarray(x).dtype)
    for r, keep in enumerate(actions):
        out[r, :keep.sum()] = x[r, keep]
    return out


def test_gae_over_actions_is_gae_of_the_rows_without_their_observations(baseline):
    """The experience of multi-turn rows == that of the same rows with the observation tokens cut
    out (actions moved together, each turn's end moved with them): the advantages, returns and
    rewards see the policy's tokens as one sequence, the next action's value as the bootstrap."""
    trainer, _ = baseline
    rollout, _ = trainer._last_rollout
    actions = np.asarray(rollout.action_mask) == 1
    b, length = actions.shape
    key = jax.random.key(5)
    out = ForwardOutputs(*(np.asarray(jax.random.normal(jax.random.fold_in(key, i), (b, length))) for i in range(4)),
                         scores=np.zeros((b,), np.float32))
    ends = np.asarray(rollout.turns.ends)
    cut_ends = np.where(ends >= 0, np.cumsum(actions, axis=1)[np.arange(b)[:, None], np.maximum(ends, 0)] - 1, -1)
    lengths = actions.sum(1)
    cut_mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)
    cut_rollout = rollout.replace(
        tokens=_compressed(rollout.tokens, actions), mask=cut_mask,
        turns=rollout.turns.replace(action_mask=cut_mask, ends=cut_ends.astype(np.int32)),
        sampler_logprobs=_compressed(rollout.sampler_logprobs, actions),
        behaviour_logprobs=_compressed(rollout.behaviour_logprobs, actions))
    cut_out = out.replace(**{f: _compressed(getattr(out, f), actions) for f in ("logprobs", "ref_logprobs", "values",
                                                                               "entropy")})
    coef = jnp.asarray(0.05)
    want, _ = experience_from_outputs(cut_out, cut_rollout, coef, trainer.hp)
    got, _ = experience_from_outputs(out, rollout, coef, trainer.hp)
    for field in ("advantages", "returns", "old_logprobs", "values"):
        np.testing.assert_allclose(_compressed(getattr(got, field), actions), np.asarray(getattr(want, field)),
                                   rtol=1e-5, atol=1e-5, err_msg=field)
    np.testing.assert_allclose(np.asarray(got.sequence_kl), np.asarray(want.sequence_kl), rtol=1e-5, atol=1e-6)


def test_eight_devices_give_the_same_metrics(baseline, tmp_path):
    _, expected = baseline
    _, history = run(multi_turn_config(), tmp_path, (2, 2, 2))
    for want, got in zip(expected, history):
        for key, value in want.items():
            if key.startswith(("time/", "perf/")):
                continue
            np.testing.assert_allclose(got[key], value, rtol=2e-3, atol=2e-4, err_msg=key)


def test_continuous_schedule_gives_the_same_run(baseline, tmp_path):
    """rollout.engine=continuous schedules each row on its own (agentic/continuous_rollout.py, 2-step
    segments): the same episodes, so the same run, metric for metric (time aside)."""
    _, expected = baseline
    trainer, history = run(multi_turn_config(**{"rollout.engine": "continuous", "environment.segment_steps": 2}),
                           tmp_path)
    assert trainer.rollouts.training.runner.schedule.func.__module__ == "ppo_jax.agentic.continuous_rollout"
    for want, got in zip(expected, history, strict=True):
        for key, value in want.items():
            if not key.startswith(("time/", "perf/")):
                np.testing.assert_allclose(got[key], value, rtol=1e-6, atol=1e-7, err_msg=key)


def test_fewer_slots_than_episodes_keep_the_invariants(tmp_path, segment_clocks):
    """rollout.slots=8 for 16 episodes (agentic/slot_rollout.py) with environments of 0.2-1 s or more
    (`scripted_envs.SlowerScripted`): waiting episodes give their slot up and come back re-prefilled, and every iteration the rollout
    log-probs still equal the training forward's and the first minibatch's ratio is 1. (That the
    episodes are the rounds schedule's is test_multi_turn_slots.py's, where a round-off draw may
    part one row; here one would change every metric.)"""
    trainer, history = run(multi_turn_config(**{
        "rollout.engine": "continuous", "environment.segment_steps": 2, "rollout.slots": 8,
        "rollout.prefill_prompts": 4, "environment.name": "slower_scripted_test_env", "train.iterations": 3}),
        tmp_path)
    assert trainer.rollouts.training.runner.schedule.func.__module__ == "ppo_jax.agentic.slot_rollout"
    # Whether a slot is given up depends on time: a look that compiles an insert or a store takes longer
    # than the environments' steps, which then answer before any is given up. From a cold cache the
    # first iteration re-prefilled 0 or 1 turns and the second 1 (so a loaded suite run once saw 0 in
    # both, 2026-11-30); the third, with its programs compiled, 4 in each of 3 runs. Over the run.
    assert sum(row["rollout/reprefilled_turns"] for row in history) > 0
    for row in history:
        assert row["policy/rollout_logprob_diff_max"] < 1e-5
        assert abs(row["first_minibatch/ratio"] - 1.0) < 1e-6
        assert row["first_minibatch/approxkl"] < 1e-12
        assert row["rollout/observation_tokens"] > 0 and 1 < row["rollout/turns"] <= 3


def test_resume_continues_the_episodes_exactly(baseline, tmp_path):
    """Stopped after iteration 1 (saved), resumed for iteration 2: the baseline's iteration 2 (the
    same prompts, keys and episodes; an episode never spans iterations, so none is in flight)."""
    _, expected = baseline
    run(multi_turn_config(**{"train.iterations": 1}), tmp_path)
    trainer, history = run(multi_turn_config(), tmp_path)
    assert trainer.resumed_from == 1 and len(history) == 1
    for key, value in expected[1].items():
        if not key.startswith(("time/", "perf/")):
            assert history[0][key] == value, key


def test_off_policy_episodes_in_flight_resume_bit_for_bit(tmp_path):
    """rollout.off_policy_steps = 2: two batches of episodes run ahead with older weights (lag 0, 1,
    2, 2). A SIGTERM after iteration 1 saves both with the checkpoint (sample and episode arrays);
    the resumed run's iterations 2 and 3 and its final weights equal the straight run's, bit for bit."""
    from test_reliability import _toy_reward_then_sigterm_at

    from ppo_jax import reward_functions as reward_fns

    config = multi_turn_config(**{"rollout.off_policy_steps": 2, "train.iterations": 4})
    toy = [(reward_fns.toy_target_count, 1.0)]
    straight = PPOTrainer(config, str(tmp_path / "straight"), reward_functions=toy, mesh=make_test_mesh((1, 1, 1)))
    expected = straight.train()
    assert [row["rollout/policy_lag_mean"] for row in expected] == [0.0, 1.0, 2.0, 2.0]
    assert all(row["rollout/turns"] > 1 for row in expected)
    expected_policy = jax.device_get(straight.state.policy)
    straight.close()
    first = PPOTrainer(config, str(tmp_path / "run"), reward_functions=[(_toy_reward_then_sigterm_at(1), 1.0)],
                       mesh=make_test_mesh((1, 1, 1)))
    assert len(first.train()) == 1 and first.stopped_by == "SIGTERM"
    first.close()
    resumed = PPOTrainer(config, str(tmp_path / "run"), reward_functions=toy, mesh=make_test_mesh((1, 1, 1)))
    assert resumed.resumed_from == 1 and [r.version for r in resumed.rollouts.in_flight] == [0, 0]
    assert_resumes_bit_for_bit(resumed, expected[1:], expected_policy)


def assert_resumes_bit_for_bit(resumed, expected_rows, expected_policy):
    """The resumed trainer's remaining iterations log `expected_rows` (every metric but times), and its
    final policy is `expected_policy`, bit for bit; closes it."""
    rest = resumed.train()
    for want, got in zip(expected_rows, rest, strict=True):
        for key, value in want.items():
            if not key.startswith(("time/", "perf/")):
                assert got[key] == value, key
    for a, b in zip(jax.tree.leaves(expected_policy), jax.tree.leaves(jax.device_get(resumed.state.policy))):
        np.testing.assert_array_equal(a, b)
    resumed.close()


def test_off_policy_episodes_run_beside_the_update(tmp_path):
    """rollout.off_policy_steps = 1: the next batch's episodes run on the episode thread while the
    trainer updates: at each update but the last, the batch started for the next iteration is still
    running (on the main thread it would have ended before the update began; the first update is
    left out, as its compile outlasts the episodes). Their wait on the
    environments is logged as perf/environment_seconds_overlapped, outside the iteration's time/*."""
    config = multi_turn_config(**{"environment.name": "slow_scripted_test_env", "rollout.off_policy_steps": 1,
                                  "train.iterations": 4})
    trainer = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
    running_at_update, update = [], trainer._update

    def recording(state, exp):
        running_at_update.append([not batch.future.done() for batch in trainer.rollouts.in_flight
                                  if hasattr(batch, "future")])
        return update(state, exp)

    trainer._update = recording
    history = trainer.train()
    trainer.close()
    assert running_at_update[1:] == [[True], [True], []]
    for row in history:
        assert row["perf/environment_seconds_overlapped"] >= 0.2 and "time/environment" not in row
        assert row["time/iteration"] == pytest.approx(sum(v for k, v in row.items()
                                                          if k.startswith("time/") and k != "time/iteration"))


def test_an_environment_error_on_the_episode_thread_fails_the_run_in_one_line(tmp_path):
    """k = 2: an environment that starts raising mid-run (on the episode thread) fails the run with
    the one-line RunFailedError naming the row and the error, the traceback in error.log; the
    batches still in flight raise too, and the emergency save says so instead of hiding the error."""
    from scripted_envs import FailingScripted

    from ppo_jax.rl.errors import RunFailedError

    FailingScripted.steps_taken = 0
    config = multi_turn_config(**{"environment.name": "failing_scripted_test_env", "rollout.off_policy_steps": 2,
                                  "train.iterations": 6})
    trainer = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
    with pytest.raises(RunFailedError, match=r"failed with EnvironmentFailure: the environment of row \d+ raised KeyError"):
        trainer.train()
    trainer.close()
    assert "KeyError" in (tmp_path / "error.log").read_text()


@pytest.mark.parametrize("overrides, message", [
    ({"environment.turn_stop": "</tool_call>"}, "environment.turn_stop='</tool_call>': the tokenizer cannot encode it"),
    ({"environment.name": "no_such_environment"}, "environment.name='no_such_environment' is not a registered"),
    ({"environment.max_turns": 0}, "environment.max_turns=0: an episode needs at least 1 turn"),
    ({"rollout.engine": "continuous", "rollout.slots": 8, "rollout.prefill_prompts": 9},
     "rollout.prefill_prompts=9: it is the episodes one insert re-prefills, at most the rollout.slots=8 slots"),
    ({"rollout.engine": "continuous", "environment.segment_steps": 0}, "environment.segment_steps=0: use at least 1"),
    ({"rollout.engine": "continuous", "rollout.slots": 8, "moe.router_replay": True},
     "moe.router_replay and rollout.slots=8: the slot schedule routes a re-prefilled episode's tokens a second"),
])
def test_bad_multi_turn_settings_fail_before_compiling(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PPOTrainer(multi_turn_config(**overrides), str(tmp_path), mesh=make_test_mesh((1, 1, 1)))



def test_routing_replay_carries_the_episodes_record_through_the_trainer(tmp_path):
    """A Qwen3-MoE policy with moe.router_replay on multi-turn episodes (the continuous schedule): the
    record of every fed token, observations included, reaches the experience step (the metric is
    there, and 0: on-policy in float32 no token's own routing differs), and the invariants hold with
    it replayed."""
    from test_partial_rollouts import MOE_REPLAY

    trainer, history = run(multi_turn_config(**MOE_REPLAY, **{"rollout.engine": "continuous"}), tmp_path)
    trainer.close()
    for row in history:
        assert row["rollout/routing_mismatch"] == 0.0
        assert abs(row["first_minibatch/ratio"] - 1.0) < 1e-6
        assert row["policy/rollout_logprob_diff_max"] < 1e-5
        assert row["rollout/turns"] > 1
