"""Partial multi-turn rollouts (agentic/continuous_rollout.py `begin` / `run_turns`): an episode batch
decoded in segments of turns, each under the weights synced that iteration. A turn's weights depend
on its index alone (a row whose next turn would cross the segment's limit is parked with its
observation until the next segment), never on how fast an environment answered.

The tiny GPT-2, word tokenizer and scripted environments of test_multi_turn.py.
"""

import jax
import numpy as np
import pytest
import test_multi_turn as mt
from test_multi_turn_slots import assert_same_episodes

from ppo_jax.agentic import continuous_rollout, saved_runs
from ppo_jax.models import forward

lm = mt.lm


@pytest.fixture(scope="module")
def reference(lm):
    """The rounds schedule under one set of weights, episodes of up to 3 turns."""
    envs = [mt.Scripted(row, turns=3) for row in range(mt.ROWS)]
    return mt._run(lm, mt._turn_config(lm[0]), envs), envs


def segmented(lm, params_by_segment, limits, envs):
    """The continuous schedule in len(limits) + 1 segments: segment s under params_by_segment[s] (version s)
    runs every row's turns below limits[s]; the last one to the episodes' end."""
    tokenizer, model, _ = lm
    decoder = mt._decoder(model, mt._turn_config(tokenizer))
    tokens, mask = mt._prompts(tokenizer)
    run = continuous_rollout.begin(decoder, params_by_segment[0], tokens, mask, envs, jax.random.key(3),
                                   tokenizer=tokenizer, max_turns=3)
    for version, (params, limit) in enumerate(zip(params_by_segment, [*limits, None])):
        run = continuous_rollout.run_turns(decoder, params, run, tokenizer=tokenizer, version=version,
                                           turn_limit=limit, segment_steps=3)
        if limit is not None:  # between two segments: every row has ended its turns below the limit
            assert (run.ep.turns[~run.ep.done & (run.ep.reason == 1)] <= limit).all()
            assert not run.decoding.any()
    return continuous_rollout.output(run)


def turn_of_each_column(out) -> np.ndarray:
    """[R, T]: the turn each action column belongs to, walked row by row (-1 elsewhere)."""
    turns = np.full(out.tokens.shape, -1)
    for row in range(out.tokens.shape[0]):
        turn = 0
        for column in range(out.tokens.shape[1]):
            if out.action_mask[row, column]:
                turns[row, column] = turn
                if column == out.turn_ends[row, turn]:
                    turn += 1
    return turns


def test_segments_of_turns_under_one_set_of_weights_give_the_whole_episodes(lm, reference):
    """Three segments (turn 0, turn 1, the rest) under the same weights, environments of 0-0.6 s: the
    rounds schedule's episodes, and each action token's version is its turn's segment."""
    expected, expected_envs = reference
    envs = [mt.Scripted(row, turns=3, sleep=0.3 * (row % 3)) for row in range(mt.ROWS)]
    out = segmented(lm, [lm[2]] * 3, [1, 2], envs)
    assert_same_episodes(out, expected, envs, expected_envs)
    turns = turn_of_each_column(out)
    np.testing.assert_array_equal(out.token_policy_version, turns)
    assert set(np.unique(turns)) == {-1, 0, 1, 2}


def test_after_a_sync_each_turn_is_decoded_by_its_versions_weights(lm):
    """The sync after turn 0 changes only the final norm's scale, so every KV cache is the same under
    both weights: each action token's log-prob must be that of a plain forward of its turn's weights
    over its prefix, the first token of turn 1 (chosen as its observation was appended) included."""
    tokenizer, model, old = lm
    new = jax.tree.map(lambda x: x, old)
    new["transformer"]["ln_f"]["scale"] = old["transformer"]["ln_f"]["scale"] * 1.7
    out = segmented(lm, [old, new], [1], [mt.Scripted(row) for row in range(mt.ROWS)])
    versions, actions = out.token_policy_version, out.action_mask.astype(bool)
    assert ((versions == 0) & actions).sum() and ((versions == 1) & actions).sum()
    temperature = mt._turn_config(tokenizer).sampling.temperature

    def logprobs(params):
        logits = forward.response_logits(model, params, out.prompt_tokens, out.prompt_mask, out.tokens, out.mask,
                                          temperature)
        return np.asarray(forward.token_logprobs(logits, out.tokens, out.action_mask))

    by_version = {0: logprobs(old), 1: logprobs(new)}
    for version, expected in by_version.items():
        mine = actions & (versions == version)
        np.testing.assert_allclose(out.logprobs[mine], expected[mine], atol=1e-5, rtol=0, err_msg=f"version {version}")
    later = actions & (versions == 1)
    assert np.abs(by_version[0][later] - by_version[1][later]).max() > 1e-2  # the two weights tell them apart


# ---------------------------------------------------------------------------------------------- the trainer

PARTIAL = {"rollout.off_policy_steps": 2, "rollout.engine": "continuous", "rollout.partial_rollouts": True,
           "train.iterations": 4}


def trainer_at(workdir, reward_functions, **overrides):
    from conftest import make_test_mesh
    from test_multi_turn_trainer import multi_turn_config

    from ppo_jax.rl.trainer import PPOTrainer

    # Its answers follow from the steps taken before: a restored environment must be replayed.
    config = multi_turn_config(**{**PARTIAL, "environment.name": "stateful_scripted_test_env", **overrides})
    return PPOTrainer(config, str(workdir), reward_functions=reward_functions,
                      mesh=make_test_mesh((1, 1, 1)))


def test_the_trainer_decodes_each_turn_under_its_segments_weights_and_resumes_bit_for_bit(tmp_path):
    """k = 2, 3 turns: one turn per segment. Batch b, begun at iteration s_b = max(0, b - 2), decodes
    its turn j under the weights of iteration min(s_b + j, b); the logged lag is the action tokens'.
    A SIGTERM after iteration 1 saves batches 2 and 3 between two segments (KV caches, bookkeeping);
    the resumed run replays their environments and its iterations 2 and 3 and final weights equal the
    straight run's, bit for bit."""
    from scripted_envs import StatefulScripted  # noqa: F401 (registers stateful_scripted_test_env)
    from test_multi_turn_trainer import assert_resumes_bit_for_bit
    from test_reliability import _toy_reward_then_sigterm_at

    from ppo_jax import reward_functions as reward_fns
    from ppo_jax.config import ConfigError

    toy = [(reward_fns.toy_target_count, 1.0)]
    straight = trainer_at(tmp_path / "straight", toy)
    seen, finish = [], straight.rollouts.finish

    def recording_finish(sampled):
        rollout = finish(sampled)
        seen.append((int(straight.state.step), sampled.episodes))
        return rollout

    straight.rollouts.finish = recording_finish
    expected = straight.train()
    expected_policy = jax.device_get(straight.state.policy)
    straight.close()
    for row, (step, out) in zip(expected, seen, strict=True):
        turns = turn_of_each_column(out)
        begun = max(0, step - 2)
        np.testing.assert_array_equal(out.token_policy_version, np.where(turns >= 0, np.minimum(begun + turns, step), -1))
        lag = (step - out.token_policy_version)[turns >= 0]
        np.testing.assert_allclose(row["rollout/policy_lag_mean"], lag.mean(), rtol=1e-6)
        assert row["rollout/policy_lag_max"] == lag.max()
    assert expected[2]["rollout/policy_lag_max"] == 2 and 0 < expected[2]["rollout/policy_lag_mean"] < 2
    assert all(row["rollout/turns"] > 1 for row in expected)

    first = trainer_at(tmp_path / "run", [(_toy_reward_then_sigterm_at(2), 1.0)])
    assert len(first.train()) == 2 and first.stopped_by == "SIGTERM"
    first.close()
    with pytest.raises(ConfigError, match="between two segments of turns: resume with rollout.partial_rollouts=True"):
        trainer_at(tmp_path / "run", toy, **{"rollout.partial_rollouts": False})
    resumed = trainer_at(tmp_path / "run", toy)
    assert resumed.resumed_from == 2
    assert [(b.version, b.future.result().segments_run) for b in resumed.rollouts.in_flight] == [(0, 2), (1, 1)]
    assert_resumes_bit_for_bit(resumed, expected[2:], expected_policy)


def _first_segment(lm, envs):
    tokenizer, model, params = lm
    decoder = mt._decoder(model, mt._turn_config(tokenizer))
    tokens, mask = mt._prompts(tokenizer)
    run = continuous_rollout.begin(decoder, params, tokens, mask, envs, jax.random.key(3), tokenizer=tokenizer,
                                   max_turns=3)
    return decoder, continuous_rollout.run_turns(decoder, params, run, tokenizer=tokenizer, turn_limit=1,
                                                 segment_steps=3)


def test_a_run_saved_between_segments_goes_on_with_its_environments_replayed(lm, reference):
    """Saved after turn 0 (host arrays) and rebuilt with fresh environments, which are stepped again
    through the turns they were given: the rest of the run gives the rounds schedule's episodes, and
    every environment saw the reference's turns (the replayed ones, then the new)."""
    tokenizer, _, params = lm
    expected, expected_envs = reference
    decoder, run = _first_segment(lm, [mt.Scripted(row, turns=3) for row in range(mt.ROWS)])
    arrays = saved_runs.run_arrays(run)
    assert run.parked.any()  # rows wait, their observation held, for the next segment
    fresh = [mt.Scripted(row, turns=3) for row in range(mt.ROWS)]
    abstract = decoder.abstract_state(params, run.prompt_tokens, run.prompt_mask, jax.random.key(3))
    rebuilt = saved_runs.rebuild_run(arrays, abstract, None, environments=dict(enumerate(fresh)),
                                     decode_turn=run.decode_turn, tokenizer=tokenizer, response_length=mt.NEW)
    rebuilt = continuous_rollout.run_turns(decoder, params, rebuilt, tokenizer=tokenizer, segment_steps=3)
    assert_same_episodes(continuous_rollout.output(rebuilt), expected, fresh, expected_envs)


def test_an_environment_that_answers_a_replay_otherwise_stops_the_resume_in_one_line(lm):
    tokenizer, _, params = lm
    decoder, run = _first_segment(lm, [mt.Scripted(row, turns=3) for row in range(mt.ROWS)])
    arrays = saved_runs.run_arrays(run)
    other = {row: mt.Scripted(row + 1, turns=3) for row in range(mt.ROWS)}  # other observation lengths
    abstract = decoder.abstract_state(params, run.prompt_tokens, run.prompt_mask, jax.random.key(3))
    with pytest.raises(saved_runs.ReplayMismatch, match=r"the environment of row \d+, stepped again with its turn 0, "
                                                        r"answered another observation"):
        saved_runs.rebuild_run(arrays, abstract, None, environments=other, decode_turn=run.decode_turn,
                               tokenizer=tokenizer, response_length=mt.NEW)


def test_several_processes_are_refused_in_one_line(monkeypatch):
    from ppo_jax.config import ConfigError
    from ppo_jax.rl import partial_episodes

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match="rollout.partial_rollouts with environment.name runs on one process, and "
                                          "this run has 2") as err:
        partial_episodes.check_one_process()
    assert "\n" not in str(err.value)
