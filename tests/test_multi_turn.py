"""Multi-turn rollouts (sampling/turns.py; agentic/rollout.py, the rounds schedule, and
agentic/continuous_rollout.py, which gives the same episodes per row): the KV append is exact (action log-probs equal a teacher-forced forward with no cache), observations are context, the
environments of all waiting rows are stepped at once, max_turns and the total length hold, a first
turn the environment ends at once is exactly the one-turn sampler's, and 8 devices agree with 1.

A tiny random GPT-2 over a word tokenizer and a scripted environment: no learning. Several words end
a turn (so rows stop at different times and wait while others decode), observations have a length
per row (so one append pads them differently) and some are longer than the cap.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_test_mesh

from ppo_jax import sharding
from ppo_jax.agentic import rollout as rollout_lib
from ppo_jax.agentic.environment import StepResult
from ppo_jax.data import PromptTokenizer, build_word_tokenizer
from ppo_jax.models import CausalLM, ModelConfig, forward, init_params, positions_from_mask
from ppo_jax.sampling import SamplingConfig, sample
from ppo_jax.sampling.turns import TurnConfig, TurnDecoder, turn_stop_hit

_jitted_sample = jax.jit(sample, static_argnames=("model", "config"))

WORDS = [f"w{i}" for i in range(26)] + ["call", "done", "obs"]
STOP_WORDS = ["call", "w1", "w2", "w3", "w4"]  # single-token turn stops: about 1 draw in 6
ROWS, PROMPT_LEN, NEW, OBS = 8, 8, 40, 4
# Two-token turn stops: every pair of STOP_WORDS, and "obs" (also an observation word) then any word.
PAIR_STOPS = [[a, b] for a in STOP_WORDS for b in STOP_WORDS] + [["obs", w] for w in WORDS]


@pytest.fixture(scope="module")
def lm():
    tokenizer = build_word_tokenizer(WORDS)
    config = ModelConfig(arch="gpt2", vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_heads=4,
                         max_position_embeddings=64)
    model = CausalLM(config)
    params, _ = init_params(model, jax.random.key(0), make_test_mesh((1, 1, 1)))
    # Scaled embeddings: next-token distributions far from uniform (random init is near uniform).
    params["transformer"]["embed"]["embedding"] = params["transformer"]["embed"]["embedding"] * 3.0
    return tokenizer, model, params


def _turn_config(tokenizer, new=NEW, turn_stops=None, **sampling):
    """Single-token turn stops (STOP_WORDS) unless `turn_stops` (lists of words) are given."""
    stops = [[w] for w in STOP_WORDS] if turn_stops is None else turn_stops
    config = SamplingConfig(max_new_tokens=new, pad_token_id=tokenizer.pad_token_id,
                            stop_token_ids=(tokenizer.eos_token_id,), **sampling)
    return TurnConfig(sampling=config, turn_stops=tuple(tuple(tokenizer.convert_tokens_to_ids(s)) for s in stops),
                      max_observation_tokens=OBS)


def _prompts(tokenizer):
    texts = [" ".join(f"w{(7 * i + j) % 26}" for j in range(1 + i % PROMPT_LEN)) for i in range(ROWS)]
    batch = PromptTokenizer(tokenizer, max_prompt_length=PROMPT_LEN).prompts(texts, length=PROMPT_LEN)
    return np.asarray(batch.tokens), np.asarray(batch.mask)


class Scripted:
    """Answers every turn with `length` "obs" words (1..6 by row: longer than OBS for some) and ends
    the episode after `turns` steps; records what it was given. `sleep`: seconds per step."""

    stop_strings = tuple(STOP_WORDS)

    def __init__(self, row, turns=2, sleep=0.0):
        self.length, self.turns, self.sleep = 1 + row % 6, turns, sleep
        self.seen = []

    def step(self, turn_text, turn_token_ids):
        self.seen.append((turn_text, list(turn_token_ids)))
        time.sleep(self.sleep)
        return StepResult(observation=" ".join(["obs"] * self.length), reward=float(len(self.seen)),
                          done=len(self.seen) >= self.turns)


_decoders = {}


def _decoder(model, config, mesh=None):
    """One TurnDecoder (three compiled programs) per model, config and mesh, shared by the tests."""
    if (model, config, mesh) not in _decoders:
        _decoders[model, config, mesh] = TurnDecoder(model, config, mesh)
    return _decoders[model, config, mesh]


def _run(lm, config, envs, key=3, max_turns=3, mesh=None):
    tokenizer, model, params = lm
    tokens, mask = _prompts(tokenizer)
    if mesh is not None:
        params = jax.device_put(params, _shardings_on(model, mesh))
        tokens, mask = sharding.put_batch((tokens, mask), mesh)
    return rollout_lib.rollout(_decoder(model, config, mesh), params, tokens, mask, envs, jax.random.key(key),
                               tokenizer=tokenizer, max_turns=max_turns)


def _shardings_on(model, mesh):
    tokens, mask = jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, positions_from_mask(mask), mask))
    return sharding.tree_shardings(abstract["params"], mesh)


@pytest.fixture(scope="module")
def run(lm):
    envs = [Scripted(row) for row in range(ROWS)]
    return _run(lm, _turn_config(lm[0]), envs), envs


def _observation_columns(out, row):
    """Columns of row's observation tokens: after each turn that went on, up to the next action."""
    real, action = out.mask[row] == 1, out.action_mask[row] == 1
    return np.flatnonzero(real & ~action)


def test_scenario_covers_waiting_rows_and_padded_observations(run):
    """Guards the tests below against a vacuous run: rows end their first turn at different columns
    (the early ones wait while others decode), several go on to a second turn, their observations
    in one append have different lengths, one is cut by the cap, and some rows end by EOS."""
    out, envs = run
    went_on = out.turns >= 2
    assert went_on.sum() >= 3, out.turns
    assert len(set(out.turn_ends[went_on, 0].tolist())) >= 3
    assert len({len(_observation_columns(out, r)) for r in np.flatnonzero(went_on)}) >= 2
    assert out.observations_truncated.sum() > 0
    assert out.stopped.any() or (out.turns == 2).any()


def test_action_logprobs_equal_teacher_forced_forward(lm, run):
    """(a) The rollout's log-probs on action tokens equal one full forward, no cache, over prompt +
    whole response (observations included as context): the per-row KV index and the observation
    append put every token where the forward puts it."""
    tokenizer, model, params = lm
    out, _ = run
    config = _turn_config(tokenizer).sampling
    logits = forward.response_logits(model, params, out.prompt_tokens, out.prompt_mask, out.tokens, out.mask,
                                     config.temperature)
    expected = np.asarray(forward.token_logprobs(logits, out.tokens, out.action_mask))
    np.testing.assert_allclose(out.logprobs, expected, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(out.sampling_logprobs, out.logprobs)  # nothing truncates
    assert (out.action_mask * out.logprobs < -0.01).sum() > 50  # real log-probs, not zeros


def test_llama_scanned_layers_and_several_steps_per_sync(lm):
    """(a) again on the other paths: a Llama (RoPE, grouped KV heads) with scanned layers, decoded
    on the stacked cache (the TPU default) with 3 decode steps per stop test."""
    tokenizer = lm[0]
    config = ModelConfig(arch="llama", vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_position_embeddings=64, scan_layers=True)
    model = CausalLM(config)
    params, _ = init_params(model, jax.random.key(0), make_test_mesh((1, 1, 1)))
    params["transformer"]["embed"]["embedding"] = params["transformer"]["embed"]["embedding"] * 3.0
    turn_config = _turn_config(tokenizer, unroll_layers=False, steps_per_sync=3)
    out = _run((tokenizer, model, params), turn_config, [Scripted(row) for row in range(ROWS)])
    logits = forward.response_logits(model, params, out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, 1.0)
    expected = np.asarray(forward.token_logprobs(logits, out.tokens, out.action_mask))
    np.testing.assert_allclose(out.logprobs, expected, atol=1e-5, rtol=0)
    assert (out.turns >= 2).sum() >= 3 and (out.mask != out.action_mask).sum() > 8


def test_decode_steps_are_counted(run):
    """The occupancy's counts against a count from the episodes: each round, `decode` runs until the
    longest live turn has ended, so its steps are the largest number of tokens a live row decoded in
    that round (its turn's tokens less the first, which `start` or `append` chose), and the tokens
    the decode steps chose are those numbers summed."""
    out, _ = run
    expected, decoded_in_all = 0, 0
    for k in range(out.turns.max()):
        decoded = []
        for row in np.flatnonzero(out.turns > k):
            end = out.turn_ends[row, k]
            begin = 0 if k == 0 else out.turn_ends[row, k - 1] + 1 + np.flatnonzero(
                out.action_mask[row, out.turn_ends[row, k - 1] + 1:])[0]
            decoded.append(end - begin)
        expected, decoded_in_all = expected + max(decoded), decoded_in_all + sum(decoded)
    assert int(out.decode_steps) == expected > 0
    assert rollout_lib.decoded_tokens(out) == decoded_in_all  # the occupancy's numerator
    assert 0 < rollout_lib.row_occupancy(out) < 1


def test_observations_are_context_not_actions(lm, run):
    """(b) Each observation's tokens follow its turn exactly (cut to the cap), with action_mask 0 and
    log-prob 0; every action is a real token; the environment saw each turn's own action tokens."""
    tokenizer, _, _ = lm
    out, envs = run
    obs = tokenizer.convert_tokens_to_ids("obs")
    assert ((out.action_mask == 1) <= (out.mask == 1)).all()
    assert (out.logprobs[out.action_mask == 0] == 0).all()
    assert (out.sampling_logprobs[out.action_mask == 0] == 0).all()
    for row, env in enumerate(envs):
        columns = _observation_columns(out, row)
        expected = []
        for turn in range(out.turns[row] - 1):  # every turn but the last went on
            end = out.turn_ends[row, turn]
            expected += list(range(end + 1, end + 1 + min(env.length, OBS, NEW - end - 2)))
        np.testing.assert_array_equal(columns, expected, err_msg=f"row {row}")
        assert (out.tokens[row, columns] == obs).all()
        # The environment got each stepped turn's action ids, from the turn's start to its end.
        starts = [0] + [out.turn_ends[row, t] + 1 + min(env.length, OBS, NEW - out.turn_ends[row, t] - 2)
                        for t in range(out.turns[row] - 1)]
        for (_, ids), begin, end in zip(env.seen, starts, out.turn_ends[row]):
            assert ids == out.tokens[row, begin:end + 1].tolist()
        assert out.mask[row].sum() == out.mask[row, :out.mask[row].sum()].sum()  # no hole before the end


def test_rows_wait_for_environments_in_parallel(lm, monkeypatch):
    """(c) Per round, `step_all` is called once with every row that ended its turn at a stop, and
    with environments that sleep the round's wall time is about one sleep, not one per row."""
    tokenizer = lm[0]
    calls = []
    real_step_all = rollout_lib.step_all

    def recording(envs, turns, max_workers, rows=None):
        calls.append(len(envs))
        return real_step_all(envs, turns, max_workers, rows)

    monkeypatch.setattr(rollout_lib, "step_all", recording)
    sleep = 1.0
    envs = [Scripted(row, sleep=sleep) for row in range(ROWS)]
    out = _run(lm, _turn_config(tokenizer), envs)
    stepped_per_round = [int(((out.turn_ends[:, t] >= 0) & (np.asarray([len(e.seen) for e in envs]) > t)).sum())
                         for t in range(3)]
    assert calls == [n for n in stepped_per_round if n], (calls, stepped_per_round)
    assert max(calls) >= 4
    walls = out.environment_wall_seconds[out.environment_wall_seconds > 0]
    assert len(walls) == len(calls)
    for wall, n in zip(walls, calls):
        # One after another would take n * sleep; the margin is for a loaded 2-core machine.
        assert sleep <= wall < sleep + 0.4 * (n - 1) * sleep, (walls, calls)
    np.testing.assert_allclose(out.environment_seconds.sum(), sleep * sum(calls), rtol=0.2)


def test_max_turns_and_total_length(lm):
    """(d) max_turns=1: one turn, no observation, nothing to append. An environment that never ends,
    max_turns=3 and a short T: at most 3 turns, no row past T, rows cut at T hold exactly T tokens,
    and an observation is cut to the room left (column + k < T)."""
    tokenizer = lm[0]
    envs = [Scripted(row) for row in range(ROWS)]
    one = _run(lm, _turn_config(tokenizer), envs, max_turns=1)
    assert (one.turns == 1).all() and (one.mask == one.action_mask).all()
    assert all(len(e.seen) <= 1 for e in envs)

    new = 14
    envs = [Scripted(row, turns=99) for row in range(ROWS)]
    out = _run(lm, _turn_config(tokenizer, new=new), envs, max_turns=3)
    lengths = out.mask.sum(1)
    assert out.turns.max() == 3 and (out.turns <= 3).all()
    assert (lengths <= new).all() and (lengths == new).any()
    assert all(len(e.seen) <= 3 for e in envs)
    for row in range(ROWS):
        if out.turns[row] == 3 and not out.stopped[row] and lengths[row] < new:
            assert len(envs[row].seen) == 3  # the last allowed turn is stepped, nothing appended after
        assert out.action_mask[row, lengths[row] - 1] == 1  # an observation never ends a row
    cut_by_cap = np.asarray([max(e.length - OBS, 0) for e in envs]) * (out.turns - 1)
    assert (out.observations_truncated > cut_by_cap).any()  # some observation was cut to the room left
    metrics = rollout_lib.rollout_metrics(out)
    assert metrics["rollout/action_tokens"] + metrics["rollout/observation_tokens"] == lengths.sum()


@pytest.mark.parametrize("greedy", [False, True])
def test_first_turn_equals_one_turn_sampler(lm, greedy):
    """(e) An environment that ends the episode at its first step: the rollout is the one-turn
    sampler's (`sampling.sample` with the turn stops as stop tokens), same key, same tokens, mask and
    log-probs, sampled and greedy. By design: row r's token at column t uses the uniform (r, t) in
    both."""
    tokenizer, model, params = lm
    config = _turn_config(tokenizer, greedy=greedy)
    out = _run(lm, config, [Scripted(row, turns=1) for row in range(ROWS)], key=11)
    one_turn = dataclasses.replace(config.sampling, stop_token_ids=config.sampling.stop_token_ids +
                                   tuple(s[0] for s in config.turn_stops))
    tokens, mask = _prompts(tokenizer)
    reference = jax.device_get(_jitted_sample(params, tokens, mask, jax.random.key(11), model=model, config=one_turn))
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    np.testing.assert_array_equal(out.mask, reference.mask)
    np.testing.assert_array_equal(out.action_mask, reference.mask)
    np.testing.assert_allclose(out.logprobs, reference.logprobs, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.sampling_logprobs, reference.sampling_logprobs, atol=1e-5, rtol=0)
    assert reference.stopped.any() and reference.lengths.min() < reference.lengths.max()


def test_multi_token_turn_stops_match_inside_the_turn_only(lm):
    """Two-token turn stops: every pair of STOP_WORDS, and "obs" followed by any word. A turn that
    went on ended with one of them, both tokens its own; an observation's last "obs" never combines
    with the next turn's first token (a turn of one token would have gone on)."""
    tokenizer = lm[0]
    config = _turn_config(tokenizer, turn_stops=PAIR_STOPS)
    envs = [Scripted(row, turns=3) for row in range(ROWS)]
    out = _run(lm, config, envs, max_turns=3)
    pairs = {tuple(s) for s in config.turn_stops}
    went_on = 0
    for row, env in enumerate(envs):
        starts = [0] + [out.turn_ends[row, t] + 1 + min(env.length, OBS, NEW - out.turn_ends[row, t] - 2)
                        for t in range(out.turns[row] - 1)]
        for turn in range(out.turns[row] - 1):  # every turn but the last ended at a turn stop
            begin, end = starts[turn], out.turn_ends[row, turn]
            assert end - begin >= 1, (row, turn)  # both tokens inside the turn
            assert tuple(out.tokens[row, end - 1:end + 1].tolist()) in pairs
            went_on += 1
    assert went_on >= 3


def test_eight_devices_give_the_same_rollout(lm, run):
    """(f) On a (2, 2, 2) mesh of the 8 fake CPU devices (batch split 4 ways, tensor-parallel
    layers) the rollout is the one-device rollout: same tokens and masks, log-probs to 1e-5."""
    tokenizer = lm[0]
    reference, _ = run
    out = _run(lm, _turn_config(tokenizer), [Scripted(row) for row in range(ROWS)], mesh=make_test_mesh((2, 2, 2)))
    for field in ("tokens", "mask", "action_mask", "turns", "turn_ends", "observations_truncated"):
        np.testing.assert_array_equal(getattr(out, field), getattr(reference, field), err_msg=field)
    np.testing.assert_allclose(out.logprobs, reference.logprobs, atol=1e-5, rtol=0)


def test_append_starts_a_fresh_turn(lm):
    """The compiled pieces directly, with two-token stops: after `append`, a resumed row's observation
    sits at its columns (mask 1, action 0), its turn-stop window holds only the new turn's first token
    (the last turn's tokens are gone from it), and it decodes again; rows not resumed are untouched."""
    from ppo_jax.sampling.turns import RUNNING, TURN_STOP

    tokenizer, model, params = lm
    decoder = _decoder(model, _turn_config(tokenizer, turn_stops=PAIR_STOPS))
    tokens, mask = _prompts(tokenizer)
    state = decoder.decode(params, decoder.start(params, tokens, mask, jax.random.key(3)))
    before = jax.device_get(state)
    resume = (before.reason == TURN_STOP) & (before.column < NEW - 3) & (np.arange(ROWS) % 3 != 0)
    assert resume.sum() >= 2 and (~resume).sum() >= 1
    obs = tokenizer.convert_tokens_to_ids("obs")
    observations = np.full((ROWS, OBS), obs, np.int32)
    after = jax.device_get(decoder.append(params, state, observations, np.full(ROWS, 2, np.int32), resume))
    for row in range(ROWS):
        column = before.column[row]
        if not resume[row]:
            assert after.column[row] == column and not after.active[row]
            np.testing.assert_array_equal(after.tokens[row], before.tokens[row])
            continue
        assert after.column[row] == column + 3
        assert after.tokens[row, column:column + 2].tolist() == [obs, obs]
        assert after.mask[row, column:column + 3].tolist() == [1, 1, 1]
        assert after.action_mask[row, column:column + 3].tolist() == [0, 0, 1]
        assert after.recent[row, :-1].tolist() == [-1] * (after.recent.shape[1] - 1)
        assert after.recent[row, -1] == after.tokens[row, column + 2]
        assert after.active[row] == (after.reason[row] == RUNNING)


def test_append_leaves_the_rows_still_decoding_untouched(lm):
    """The continuous schedule appends while other rows are mid-turn: a decode cut after 2 steps
    leaves rows active; `append` of the rows that ended at a turn stop resumes them and keeps every
    active row's column, tokens, turn window and activity as they were."""
    from ppo_jax.sampling.turns import RUNNING, TURN_STOP

    tokenizer, model, params = lm
    decoder = _decoder(model, _turn_config(tokenizer))
    tokens, mask = _prompts(tokenizer)
    state = decoder.decode(params, decoder.start(params, tokens, mask, jax.random.key(3)), max_steps=2)
    before = jax.device_get(state)
    assert (before.column <= 3).all()  # the budget held: the first token, then 2 steps at most
    resume = (before.reason == TURN_STOP) & ~before.active
    assert resume.sum() >= 1 and before.active.sum() >= 2, (before.reason, before.active)
    observations = np.full((ROWS, OBS), tokenizer.convert_tokens_to_ids("obs"), np.int32)
    after = jax.device_get(decoder.append(params, state, observations, np.full(ROWS, 2, np.int32), resume))
    assert (after.column[resume] == before.column[resume] + 3).all()
    for field in ("column", "tokens", "recent", "active", "reason", "logprobs", "mask"):
        np.testing.assert_array_equal(getattr(after, field)[before.active], getattr(before, field)[before.active],
                                      err_msg=field)
    assert (after.active == (before.active | (resume & (after.reason == RUNNING)))).all()


class RecordingDecoder:
    """A TurnDecoder that records when each decode segment ran and, at each append, the rows that
    were still decoding beside the resumed ones."""

    def __init__(self, decoder):
        self.decoder, self.config, self.mesh = decoder, decoder.config, decoder.mesh
        self.segments, self.decoding_at_append = [], []

    def start(self, *args):
        return self.decoder.start(*args)

    def decode(self, params, state, adapters=None, max_steps=None):
        begin = time.monotonic()
        state = jax.block_until_ready(self.decoder.decode(params, state, adapters, max_steps))
        self.segments.append((begin, time.monotonic()))
        return state

    def append(self, params, state, ids, lengths, resume, adapters=None):
        self.decoding_at_append.append(np.asarray(state.active) & ~np.asarray(resume))
        return self.decoder.append(params, state, ids, lengths, resume, adapters)


class Timed(Scripted):
    """Scripted, sleeping 0, 0.3 or 0.6 s by row, recording when each step ran."""

    def __init__(self, row):
        super().__init__(row, sleep=0.3 * (row % 3))
        self.intervals = []

    def step(self, turn_text, turn_token_ids):
        begin = time.monotonic()
        result = super().step(turn_text, turn_token_ids)
        self.intervals.append((begin, time.monotonic()))
        return result


def test_continuous_schedule_gives_the_rounds_episodes_and_overlaps(lm, run):
    """rollout.engine=continuous (agentic/continuous_rollout.py), 3-step segments, environments of
    0-0.6 s: the episodes are the rounds schedule's (same key, deterministic environments): every
    token, mask, turn end, reward and cut, and what each environment saw; log-probs to round-off.
    And it is not the rounds schedule in disguise: decode segments ran while environments stepped,
    and observations were appended while other rows were still mid-turn."""
    from ppo_jax.agentic import continuous_rollout

    tokenizer, model, params = lm
    reference, reference_envs = run
    decoder = RecordingDecoder(_decoder(model, _turn_config(tokenizer)))
    envs = [Timed(row) for row in range(ROWS)]
    tokens, mask = _prompts(tokenizer)
    out = continuous_rollout.rollout(decoder, params, tokens, mask, envs, jax.random.key(3), tokenizer=tokenizer,
                                     max_turns=3, segment_steps=3)
    for field in ("tokens", "mask", "action_mask", "turns", "turn_ends", "turn_rewards", "environment_done",
                  "stopped", "observations_truncated"):
        np.testing.assert_array_equal(getattr(out, field), getattr(reference, field), err_msg=field)
    np.testing.assert_allclose(out.logprobs, reference.logprobs, atol=1e-6, rtol=0)
    assert [env.seen for env in envs] == [env.seen for env in reference_envs]
    slow_steps = [interval for env in envs for interval in env.intervals if env.sleep > 0]
    assert any(begin < segment_begin < end for begin, end in slow_steps for segment_begin, _ in decoder.segments)
    assert any(decoding.any() for decoding in decoder.decoding_at_append)
    # Blocked only with nothing left to decode: less than the environments' own time.
    assert 0 < out.environment_wall_seconds.sum() < out.environment_seconds.sum()


def test_gather_takes_each_rows_answer_from_its_owner(lm, monkeypatch):
    """`bookkeeping.gather` with a second process stood in for (its allgather returns this process's
    answers beside the other's): each row's answer comes from the process that answered it, with
    its observation ids, and a failure there reaches every process."""
    from ppo_jax.agentic import bookkeeping
    from ppo_jax.agentic.environment import EnvironmentFailure

    tokenizer = lm[0]
    mine, theirs = bookkeeping.Answers.none(4, 2), bookkeeping.Answers.none(4, 2)
    mine.put(0, StepResult(observation="w1", reward=1.0, done=False, info={"tool_calls": 1.0}), 0.5, tokenizer, 5)
    theirs.put(3, StepResult(observation="w2 w3 w4", reward=2.0, done=True), 0.25, tokenizer, room=1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(bookkeeping.multihost_utils, "process_allgather", lambda tree: {
        name: np.stack([value, dataclasses.asdict(theirs)[name]]) for name, value in tree.items()})
    got = bookkeeping.gather(mine)
    w = tokenizer.convert_tokens_to_ids
    np.testing.assert_array_equal(got.answered, [True, False, False, True])
    np.testing.assert_array_equal(got.reward, [1.0, 0, 0, 2.0])
    np.testing.assert_array_equal(got.done, [False, False, False, True])
    np.testing.assert_array_equal(got.ids, [[w("w1"), 0], [0, 0], [0, 0], [w("w2"), 0]])
    np.testing.assert_array_equal(got.length, [1, 0, 0, 1])
    np.testing.assert_array_equal(got.cut, [0, 0, 0, 2])
    np.testing.assert_array_equal(got.info[:, 0], [1.0, 0, 0, 0])
    bookkeeping.raise_failures(got, None)  # nothing failed
    theirs.failed[2] = True
    with pytest.raises(EnvironmentFailure, match="row 2 raised on another process"):
        bookkeeping.raise_failures(bookkeeping.gather(mine), None)


@pytest.mark.parametrize("schedule", ["rounds", "continuous"])
def test_an_environment_failing_on_another_process_stops_this_one(lm, monkeypatch, schedule):
    """Both schedules read the failures after each gather: when another process's environment of
    row 5 raised (its flag in the gathered answers), this process stops with an error naming the
    row instead of waiting in the next collective for a process that has left."""
    from ppo_jax.agentic import bookkeeping, continuous_rollout
    from ppo_jax.agentic.environment import EnvironmentFailure

    module = rollout_lib if schedule == "rounds" else continuous_rollout
    calls = []

    def other_process_failed(answers):
        calls.append(1)
        if len(calls) == 2:
            answers.failed[5] = True
        return answers

    monkeypatch.setattr(module, "gather", other_process_failed)
    tokenizer, model, params = lm
    tokens, mask = _prompts(tokenizer)
    envs = [Scripted(row, turns=3) for row in range(ROWS)]
    extra = {} if schedule == "rounds" else {"segment_steps": 3}
    with pytest.raises(EnvironmentFailure, match="row 5 raised on another process"):
        module.rollout(_decoder(model, _turn_config(tokenizer)), params, tokens, mask, envs, jax.random.key(3),
                       tokenizer=tokenizer, max_turns=3, **extra)
    assert len(calls) == 2


def test_turn_stop_sequences_match_only_inside_the_turn():
    """A sequence matches the turn's last tokens only; -1 (before the turn) never matches a token."""
    recent = jnp.asarray([[5, 6, 7], [-1, 6, 7], [-1, -1, 7], [7, 6, 5], [1, 2, 3]])
    hit = turn_stop_hit(recent, ((6, 7), (3,)))
    np.testing.assert_array_equal(np.asarray(hit), [True, True, False, False, True])


def test_bad_configs_are_rejected(lm):
    tokenizer = lm[0]
    config = _turn_config(tokenizer)
    for change, message in (({"turn_stops": ()}, "turn_stops"), ({"turn_stops": ((),)}, "turn_stops"),
                            ({"max_observation_tokens": 0}, "max_observation_tokens"),
                            ({"sampling": dataclasses.replace(config.sampling, num_samples=2)}, "num_samples")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(config, **change)
