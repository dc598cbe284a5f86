"""Multi-turn episodes on fewer decode slots than episodes (sampling/turn_slots.py,
agentic/slot_rollout.py): the episodes are the rounds schedule's although waiting episodes gave their
slots up and came back through a re-prefill of their whole row, and the decode ran S rows, not E.

The tiny GPT-2, word tokenizer and scripted environments of test_multi_turn.py.
"""

import time

import jax
import numpy as np
import pytest
import test_multi_turn as mt
from conftest import make_test_mesh

from ppo_jax import sharding
from ppo_jax.agentic import slot_rollout
from ppo_jax.agentic.rollout import rollout_metrics
from ppo_jax.sampling.turn_slots import SlotDecoder

lm = mt.lm


class SlowerThanASegment(mt.Scripted):
    """Scripted, stepping 1, 3 or 5 times (by row) the larger of 0.2 s and 5 decode segments as the
    rollout measures them (`clocks`: conftest's `segment_clocks`): far slower than a segment and far
    apart whatever the machine's load, so once every slot waits, the first answer finds the others
    stepping still and their slots are given up."""

    def __init__(self, row, clocks):
        super().__init__(row)
        self.factor, self.clocks = 1 + 2 * (row % 3), clocks

    def step(self, turn_text, turn_token_ids):
        self.sleep = self.factor * max(0.2, 5 * self.clocks[-1].patience)
        return super().step(turn_text, turn_token_ids)


class AnswerTimed(mt.Scripted):
    """Scripted, recording when it first answered (perf_counter)."""

    answered_at = float("inf")

    def step(self, turn_text, turn_token_ids):
        result = super().step(turn_text, turn_token_ids)
        self.answered_at = min(self.answered_at, time.perf_counter())
        return result


@pytest.fixture(scope="module")
def reference(lm):
    """The rounds schedule, one cache row per episode."""
    envs = [mt.Scripted(row) for row in range(mt.ROWS)]
    return mt._run(lm, mt._turn_config(lm[0]), envs), envs


class CountingDecoder:
    """A SlotDecoder that records every insert: (episode, observation length, None for a new one)."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.inserted = []
        self.first_inserted_at = {}  # episode: perf_counter

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def insert(self, params, state, store, slots, episodes, observations=None, lengths=None, adapters=None):
        self.inserted += [(e, None if lengths is None else int(n)) for e, n in zip(episodes, lengths or episodes)]
        for e in episodes:
            self.first_inserted_at.setdefault(e, time.perf_counter())
        return self.decoder.insert(params, state, store, slots, episodes, observations, lengths, adapters)


def _slot_run(lm, slots, insert_rows, envs, segment_steps=3, mesh=None):
    tokenizer, model, params = lm
    decoder = CountingDecoder(SlotDecoder(model, mt._turn_config(tokenizer), slots=slots, insert_rows=insert_rows,
                                          mesh=mesh))
    tokens, mask = mt._prompts(tokenizer)
    if mesh is not None:
        params = jax.device_put(params, mt._shardings_on(model, mesh))
        tokens, mask = sharding.put_batch((tokens, mask), mesh)
    out = slot_rollout.rollout(decoder, params, tokens, mask, envs, jax.random.key(3), tokenizer=tokenizer,
                               max_turns=3, segment_steps=segment_steps)
    return out, decoder


EPISODE_FIELDS = ("tokens", "mask", "action_mask", "turns", "turn_ends", "turn_rewards", "environment_done",
                  "stopped", "observations_truncated")


def assert_same_episodes(out, expected, envs, expected_envs):
    """The rounds schedule's episodes, row for row (every field, what each environment saw, log-probs
    to round-off), except at most one row whose tokens part at an action token. The slot schedule
    decodes in batches of another size and re-prefills: its log-probs round differently, and on
    some CPU a uniform within ~1e-6 of a token's CDF boundary may pick the neighbour (seen once in
    12,288 draws, docs/agentic.md). A bug parts many rows."""
    differ = np.flatnonzero((out.tokens != expected.tokens).any(axis=1))
    assert len(differ) <= 1, f"episodes {differ} differ from the rounds schedule's"
    for row in differ:
        column = np.flatnonzero(out.tokens[row] != expected.tokens[row])[0]
        assert out.action_mask[row, column] and expected.action_mask[row, column]
    same = np.setdiff1d(np.arange(len(out.tokens)), differ)
    for field in EPISODE_FIELDS:
        np.testing.assert_array_equal(getattr(out, field)[same], getattr(expected, field)[same], err_msg=field)
    np.testing.assert_allclose(out.logprobs[same], expected.logprobs[same], atol=2e-5, rtol=0)
    np.testing.assert_allclose(out.sampling_logprobs[same], expected.sampling_logprobs[same], atol=2e-5, rtol=0)
    assert [envs[r].seen for r in same] == [expected_envs[r].seen for r in same]


@pytest.mark.parametrize("slots,insert_rows", [(4, 2), (2, 1)])
def test_fewer_slots_give_the_rounds_episodes(lm, reference, segment_clocks, slots, insert_rows):
    """8 episodes on 4 (or 2) slots, environments of 0.2-1 s or more (`SlowerThanASegment`): episodes
    that wait give their slot up, new ones start in it, and the waiting ones come back re-prefilled
    with their observation; every token, mask, turn end, reward and cut is the rounds schedule's, and
    what each environment saw; log-probs to round-off (a re-prefill's arithmetic is not the decode's;
    `assert_same_episodes`)."""
    expected, expected_envs = reference
    envs = [SlowerThanASegment(row, segment_clocks) for row in range(mt.ROWS)]
    out, decoder = _slot_run(lm, slots, insert_rows, envs)
    assert_same_episodes(out, expected, envs, expected_envs)
    # Not one row per episode in disguise: the slots were shared, and re-prefills resumed turns.
    resumed = [e for e, length in decoder.inserted if length is not None]
    assert len(decoder.inserted) > mt.ROWS and resumed
    assert int(out.reprefilled_turns) == len(resumed)
    assert int(out.decode_rows) == slots
    metrics = rollout_metrics(out)
    assert metrics["rollout/reprefilled_turns"] == len(resumed)
    assert 0 < metrics["perf/decode_row_occupancy"] <= 1


def test_slots_that_all_wait_are_given_up_before_the_environments_answer(lm, reference):
    """Both slots' environments step for a second while six episodes wait for a slot: the slots go
    to new episodes once the environments have stepped longer than a segment, not once they answer.
    A segment decodes whole turns (segment_steps = the response length), so both turns end at the
    same look and neither environment has stepped at all when the schedule first looks for a slot."""
    expected, expected_envs = reference
    envs = [AnswerTimed(row, sleep=1.0 if row < 2 else 0.0) for row in range(mt.ROWS)]
    out, decoder = _slot_run(lm, 2, 2, envs, segment_steps=mt.NEW)
    assert_same_episodes(out, expected, envs, expected_envs)
    assert decoder.first_inserted_at[2] < min(env.answered_at for env in envs[:2])
    assert int(out.reprefilled_turns) >= 1


def test_environments_within_the_patience_floor_keep_their_slots(lm, reference):
    """Environments of 10 ms, longer than a segment of this toy model (a few ms) but within
    slot_rollout.MIN_PATIENCE_S (what a thread may wait to run at all on a loaded machine): every
    episode is inserted once, at its start, and resumes by `append`, never by a re-prefill."""
    expected, expected_envs = reference
    envs = [mt.Scripted(row, sleep=0.01) for row in range(mt.ROWS)]
    out, decoder = _slot_run(lm, 4, 2, envs)
    assert_same_episodes(out, expected, envs, expected_envs)
    assert sorted(e for e, _ in decoder.inserted) == list(range(mt.ROWS))
    assert int(out.reprefilled_turns) == 0


def test_eight_devices_give_the_same_episodes(lm, reference, segment_clocks):
    """On a (2, 2, 2) mesh of the 8 fake CPU devices (slots split 4 ways, tensor-parallel layers),
    episodes giving their slots up and coming back: the one-device rollout's episodes."""
    expected, expected_envs = reference
    envs = [SlowerThanASegment(row, segment_clocks) for row in range(mt.ROWS)]
    out, _ = _slot_run(lm, 4, 2, envs, segment_steps=1, mesh=make_test_mesh((2, 2, 2)))
    assert_same_episodes(out, expected, envs, expected_envs)
    assert int(out.reprefilled_turns) > 0


def test_insert_rows_are_checked(lm):
    tokenizer, model, _ = lm
    with pytest.raises(ValueError, match="insert_rows=5"):
        SlotDecoder(model, mt._turn_config(tokenizer), slots=4, insert_rows=5)


def test_several_processes_are_refused_in_one_line(lm, monkeypatch):
    """The slots' bookkeeping is not gathered across processes: refused before anything runs."""
    from ppo_jax.config import ConfigError

    tokenizer, model, params = lm
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    tokens, mask = mt._prompts(tokenizer)
    envs = [mt.Scripted(row) for row in range(mt.ROWS)]
    with pytest.raises(ConfigError, match="rollout.slots=4 with an environment runs on one process"):
        slot_rollout.rollout(SlotDecoder(model, mt._turn_config(tokenizer), slots=4, insert_rows=1), params, tokens,
                             mask, envs, jax.random.key(3), tokenizer=tokenizer, max_turns=3)
