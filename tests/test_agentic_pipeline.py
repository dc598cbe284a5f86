"""The pieces of `python -m ppo_jax.arithmetic` that need no training: the character tokenizer, the
demonstrations as SFT records, the bare environment, the interval. (The run itself: docs/agentic.md.)"""

import pytest

from ppo_jax.agentic import environment, tool_format
from ppo_jax.arithmetic import pipeline, task as arithmetic_task


@pytest.fixture(scope="module")
def tokenizer():
    return pipeline.char_tokenizer()


def test_tokenizer_round_trips_the_transcripts_and_keeps_the_pieces_whole(tokenizer):
    task = arithmetic_task.ArithmeticTask(seed=1, digits=4)
    for record in pipeline.sft_records(task, 16):
        for text in (record["prompt"], record["response"]):
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert tokenizer.decode(ids, skip_special_tokens=True) == text
            assert tokenizer.unk_token_id not in ids
    # The turn stop is one token the trainer can match, and the pieces shorten a row ~4x.
    environment.check_turn_stop(tokenizer, tool_format.CALL_CLOSE)
    assert len(tokenizer.encode(tool_format.CALL_CLOSE, add_special_tokens=False)) == 1
    response = pipeline.sft_records(task, 1)[0]["response"]
    assert len(tokenizer.encode(response, add_special_tokens=False)) < len(response) / 3


def test_demonstrations_are_episodes_the_environment_pays(tokenizer):
    """The SFT response, cut at the turn stop, is a call the environment answers with the tool
    result the demonstration shows; the answer turn is paid by arithmetic_exact."""
    task = arithmetic_task.ArithmeticTask(seed=1, digits=4, wrong_rate=0.0)
    record = pipeline.sft_records(task, 1)[0]
    call, rest = record["response"].split(tool_format.CALL_CLOSE)
    env = pipeline.bare_arithmetic(max_turns=2)
    assert env.reset({"prompt": record["prompt"]}) == record["prompt"]
    first = env.step(call + tool_format.CALL_CLOSE, [])
    assert not first.done and rest.startswith(first.observation) and first.info["tool_calls"] == 1.0
    last = env.step(rest[len(first.observation):], [])
    assert last.done and last.reward == 1.0


def test_interval_covers_the_share():
    low, high = pipeline.interval(32, 128)
    assert low < 0.25 < high and high - low < 0.2
