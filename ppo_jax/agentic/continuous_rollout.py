"""Multi-turn rollouts on the continuous schedule (`rollout.engine="continuous"` with an environment):
no row waits for a round. The same episodes as `agentic.rollout.rollout`, scheduled per row.

    out = rollout(decoder, params, prompt_tokens, prompt_mask, envs, key, tokenizer=tok, max_turns=4,
                  segment_steps=8)

The rounds schedule (`agentic/rollout.py`) decodes until every row's turn has ended, then steps all
their environments, then appends all the observations: a row whose turn ends early waits for the
longest turn, and every row waits for the slowest environment. Here the host loops over short decode
segments (`segment_steps` decode steps, `TurnDecoder.decode(max_steps=...)`), and after each one

- submits the environment of every row whose turn just ended to a thread pool (it steps while the
  device decodes the other rows),
- appends, in one `append`, the observations of every row whose environment has answered (the rows
  still decoding go on untouched), and
- blocks on the environments only when no row is left to decode.

Every row keeps its cache row for the whole episode (the decode batch is the R rows, as on the rounds
schedule; `rollout.slots` below R is refused for multi-turn runs): the overlap is of decoding with
environment time, not a reuse of a waiting row's slot.

Same tokens as the rounds schedule: row r's token at response column t is drawn with the uniform (r,
t) whenever it is decoded, and each row's cache holds the same tokens at the same slots, so for the same
key and deterministic environments both give the same episodes (log-probs to float round-off: the
same row's logits, computed beside other rows). What differs is `environment_wall_seconds`: here [M]
holds the seconds the host was blocked on environments with nothing to decode, each wait filed under
the lowest turn index then waiting (the rounds schedule blocks for every round's `step_all`).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ppo_jax import sharding
from ppo_jax.agentic.bookkeeping import Episodes, collect_answers, gather, raise_failures
from ppo_jax.agentic.environment import Environment, timed_step
from ppo_jax.agentic.rollout import MultiTurnOutput, append_observations, checked_episodes, episodes_output
from ppo_jax.config import check
from ppo_jax.sampling.turns import FINAL_STOP, RUNNING, TURN_STOP, TurnDecoder


def wait_for_one(waiting: dict[int, concurrent.futures.Future], ep: Episodes) -> None:
    """Blocks until one of this process's environments answers; files the seconds under the lowest
    turn index waiting."""
    start = time.perf_counter()
    concurrent.futures.wait(waiting.values(), return_when=concurrent.futures.FIRST_COMPLETED)
    ep.wall[min(ep.turns[row] - 1 for row in waiting)] += time.perf_counter() - start


def rollout(decoder: TurnDecoder, params: Any, prompt_tokens: Any, prompt_mask: Any,
            environments: Sequence[Environment], key: jax.Array, *, tokenizer: Any, max_turns: int,
            environment_workers: int = 16, adapters: Any = None,
            decode_turn: Callable[[Sequence[int]], str] | None = None, segment_steps: int = 8) -> MultiTurnOutput:
    """`agentic.rollout.rollout`'s episodes (same arguments and output), scheduled per row: decode
    segments of `segment_steps` steps, each environment stepped as soon as its row's turn ends and
    its observation appended as soon as it answers (see the module docstring). Several processes:
    each loop pass gathers the answers (a collective), so all take the same decisions."""
    check(segment_steps >= 1, f"environment.segment_steps={segment_steps}: use at least 1 decode step")
    new, width = decoder.config.sampling.max_new_tokens, decoder.config.max_observation_tokens
    rows = int(np.shape(prompt_tokens)[0])
    mine, decode_turn = checked_episodes(decoder, prompt_tokens, environments, tokenizer, max_turns, decode_turn)
    state = decoder.start(params, prompt_tokens, prompt_mask, key, adapters)
    ep = Episodes(rows, max_turns)
    decoding = np.ones(rows, bool)  # rows in a turn on the device
    stepping = np.zeros(rows, bool)  # rows whose environment (on any process) has not answered yet
    waiting: dict[int, concurrent.futures.Future] = {}  # this process's environments stepping, by row
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(environment_workers, len(mine))),
                                               thread_name_prefix="environment") as pool:
        while True:
            reason, column, active = sharding.to_host((state.reason, state.column, state.active))
            if (active != (decoding & (reason == RUNNING))).any():  # else the loop below would never end
                raise RuntimeError(f"multi-turn rollout: the device decodes rows {np.flatnonzero(active)}, the "
                                   f"host expected {np.flatnonzero(decoding & (reason == RUNNING))}")
            ended = np.flatnonzero(decoding & (reason != RUNNING))
            tokens = sharding.to_host(state.tokens) if ended.size else None
            for row in ended:
                ep.end_turn(row, column[row], reason[row])
                decoding[row] = False
                stepping[row] = reason[row] in (TURN_STOP, FINAL_STOP)  # a turn cut by the length is not
                if stepping[row] and row in mine:
                    turn = ep.turn(row, tokens[row], column[row], decode_turn)
                    waiting[row] = pool.submit(timed_step, mine[row], turn)
            if waiting and not decoding.any():
                wait_for_one(waiting, ep)
            answers, failure = collect_answers(waiting, width, tokenizer, new - ep.last_column - 1)
            answers = gather(answers)
            raise_failures(answers, failure)
            ep.record(answers)
            stepping &= ~answers.answered
            resume = ep.goes_on(answers, new)
            if resume.any():
                state = append_observations(decoder, params, state, ep, answers, resume, adapters)
                decoding |= resume
            if decoding.any():
                state = decoder.decode(params, state, adapters, max_steps=segment_steps)
            elif not stepping.any():
                break
    return episodes_output(state, ep, prompt_tokens, prompt_mask)
