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

from ppo_jax.agentic import continuous_rollout
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
