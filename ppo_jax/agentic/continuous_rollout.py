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

In segments of turns (partial rollouts, `rl/partial_episodes.py`): `begin` prefills, each
`run_turns(..., turn_limit=L, version=v)` decodes every row's turns below L under the weights it is
given, parking a row whose next turn would be turn L (its observation held, appended by the next
call's weights), and `output` gives the episodes with each action token's turn's version. `rollout`
is `begin` and one `run_turns` to the end.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ppo_jax import sharding
from ppo_jax.agentic.bookkeeping import Answers, Episodes, collect_answers, gather, raise_failures
from ppo_jax.agentic.environment import Environment, timed_step
from ppo_jax.agentic.rollout import MultiTurnOutput, append_observations, checked_episodes, episodes_output
from ppo_jax.config import check
from ppo_jax.sampling.turns import FINAL_STOP, RUNNING, TURN_STOP, TurnDecoder, TurnState


def wait_for_one(waiting: dict[int, concurrent.futures.Future], ep: Episodes, timeout: float | None = None) -> None:
    """Blocks until one of this process's environments answers (or `timeout` seconds pass); files the
    seconds under the lowest turn index waiting."""
    start = time.perf_counter()
    concurrent.futures.wait(waiting.values(), timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
    ep.wall[min(ep.turns[row] - 1 for row in waiting)] += time.perf_counter() - start


@dataclasses.dataclass
class EpisodeRun:
    """A continuous multi-turn rollout between two segments of turns (one segment: `rollout`; several,
    each under the weights synced that iteration: partial rollouts, `rl/episodes.py`).

    state: the decoder's (its KV cache holds every row's context so far); ep: the bookkeeping;
    decoding [R] bool: rows in a turn on the device; parked [R] bool: rows whose environment answered
    at a segment's turn limit, their observation (in `held`, an Answers) appended by the next
    segment, whose weights then choose the next turn; turn_versions [R, M] int32: the version of the
    weights that decoded each turn (-1: not taken); environments: this process's, by row; the prompts
    [R, Lq] and `decode_turn` as `rollout` takes them.
    """

    state: TurnState
    ep: Episodes
    decoding: np.ndarray
    parked: np.ndarray
    held: Answers
    turn_versions: np.ndarray
    environments: dict[int, Environment]
    prompt_tokens: Any
    prompt_mask: Any
    decode_turn: Callable[[Sequence[int]], str]


def begin(decoder: TurnDecoder, params: Any, prompt_tokens: Any, prompt_mask: Any, environments: Sequence[Environment],
          key: jax.Array, *, tokenizer: Any, max_turns: int, version: int = 0, adapters: Any = None,
          decode_turn: Callable[[Sequence[int]], str] | None = None) -> EpisodeRun:
    """The prompts prefilled and each row's first token chosen by `params` (of `version`); no turn
    decoded yet. Arguments as `rollout`'s."""
    rows = int(np.shape(prompt_tokens)[0])
    mine, decode_turn = checked_episodes(decoder, prompt_tokens, environments, tokenizer, max_turns, decode_turn)
    versions = np.full((rows, max_turns), -1, np.int32)
    versions[:, 0] = version
    return EpisodeRun(state=decoder.start(params, prompt_tokens, prompt_mask, key, adapters),
                      ep=Episodes(rows, max_turns), decoding=np.ones(rows, bool), parked=np.zeros(rows, bool),
                      held=Answers.none(rows, decoder.config.max_observation_tokens), turn_versions=versions,
                      environments=mine, prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, decode_turn=decode_turn)


def run_turns(decoder: TurnDecoder, params: Any, run: EpisodeRun, *, tokenizer: Any, version: int = 0,
              turn_limit: int | None = None, environment_workers: int = 16, adapters: Any = None,
              segment_steps: int = 8) -> EpisodeRun:
    """Every row's turns up to `turn_limit` (None: to the episode's end) under `params` (of
    `version`): the parked rows' observations appended first (these weights choose their next
    turns), then decode segments of `segment_steps` steps, each environment stepped as soon as its
    row's turn ends and its observation appended as soon as it answers (see the module docstring). A
    row whose next turn would be turn `turn_limit` is parked instead, so which weights decode a turn
    depends on its index alone, never on how fast an environment answered. Several processes: each
    loop pass gathers the answers (a collective), so all take the same decisions."""
    check(segment_steps >= 1, f"environment.segment_steps={segment_steps}: use at least 1 decode step")
    ep, mine = run.ep, run.environments
    new, width = decoder.config.sampling.max_new_tokens, decoder.config.max_observation_tokens
    limit = ep.max_turns if turn_limit is None else turn_limit
    state = _resume(decoder, params, run, run.held, run.parked, version, adapters)
    run.parked = np.zeros_like(run.parked)
    stepping = np.zeros(len(run.decoding), bool)  # rows whose environment (on any process) has not answered yet
    waiting: dict[int, concurrent.futures.Future] = {}  # this process's environments stepping, by row
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(environment_workers, len(mine))),
                                               thread_name_prefix="environment") as pool:
        while True:
            reason, column, active = sharding.to_host((state.reason, state.column, state.active))
            if (active != (run.decoding & (reason == RUNNING))).any():  # else the loop below would never end
                raise RuntimeError(f"multi-turn rollout: the device decodes rows {np.flatnonzero(active)}, the "
                                   f"host expected {np.flatnonzero(run.decoding & (reason == RUNNING))}")
            ended = np.flatnonzero(run.decoding & (reason != RUNNING))
            tokens = sharding.to_host(state.tokens) if ended.size else None
            for row in ended:
                ep.end_turn(row, column[row], reason[row])
                run.decoding[row] = False
                stepping[row] = reason[row] in (TURN_STOP, FINAL_STOP)  # a turn cut by the length is not
                if stepping[row] and row in mine:
                    turn = ep.turn(row, tokens[row], column[row], run.decode_turn)
                    waiting[row] = pool.submit(timed_step, mine[row], turn)
            if waiting and not run.decoding.any():
                wait_for_one(waiting, ep)
            answers, failure = collect_answers(waiting, width, tokenizer, new - ep.last_column - 1)
            answers = gather(answers)
            raise_failures(answers, failure)
            ep.record(answers)
            stepping &= ~answers.answered
            resume = ep.goes_on(answers, new)
            park = resume & (ep.turns >= limit)
            if park.any():  # their next turn belongs to the next segment's weights
                run.held.keep(answers, park)
                run.parked |= park
            state = _resume(decoder, params, run, answers, resume & ~park, version, adapters, state)
            if run.decoding.any():
                state = decoder.decode(params, state, adapters, max_steps=segment_steps)
            elif not stepping.any():
                break
    run.state = state
    return run


def _resume(decoder: TurnDecoder, params: Any, run: EpisodeRun, answers: Answers, resume: np.ndarray, version: int,
            adapters: Any, state: TurnState | None = None) -> TurnState:
    """`state` (default: the run's) with the `resume` rows' observations appended: their next turn,
    decoded by `params` of `version`, begins (its first token chosen here)."""
    state = run.state if state is None else state
    if not resume.any():
        return state
    run.turn_versions[np.flatnonzero(resume), run.ep.turns[resume]] = version
    run.decoding |= resume
    return append_observations(decoder, params, state, run.ep, answers, resume, adapters)


def output(run: EpisodeRun) -> MultiTurnOutput:
    """The finished episodes, each action token with the version of the weights that decoded its turn
    (`MultiTurnOutput.token_policy_version`)."""
    out = episodes_output(run.state, run.ep, run.prompt_tokens, run.prompt_mask)
    return out.replace(token_policy_version=token_versions(run.turn_versions, out.turn_ends, out.action_mask))


def token_versions(turn_versions: np.ndarray, turn_ends: np.ndarray, action_mask: np.ndarray) -> np.ndarray:
    """[R, T] int32: each action token's turn's version (turn_versions [R, M]; the turn of response
    column c is the number of turns that ended before it, turn_ends [R, M]), -1 off the actions."""
    columns = np.arange(action_mask.shape[1])
    turn = ((turn_ends[:, None, :] >= 0) & (turn_ends[:, None, :] < columns[None, :, None])).sum(-1)
    versions = np.take_along_axis(turn_versions, np.minimum(turn, turn_versions.shape[1] - 1), axis=1)
    return np.where(action_mask > 0, versions, -1).astype(np.int32)


def rollout(decoder: TurnDecoder, params: Any, prompt_tokens: Any, prompt_mask: Any,
            environments: Sequence[Environment], key: jax.Array, *, tokenizer: Any, max_turns: int,
            environment_workers: int = 16, adapters: Any = None,
            decode_turn: Callable[[Sequence[int]], str] | None = None, segment_steps: int = 8) -> MultiTurnOutput:
    """`agentic.rollout.rollout`'s episodes (same arguments and output), scheduled per row: decode
    segments of `segment_steps` steps, each environment stepped as soon as its row's turn ends and
    its observation appended as soon as it answers (see the module docstring)."""
    run = begin(decoder, params, prompt_tokens, prompt_mask, environments, key, tokenizer=tokenizer,
                max_turns=max_turns, adapters=adapters, decode_turn=decode_turn)
    run = run_turns(decoder, params, run, tokenizer=tokenizer, environment_workers=environment_workers,
                    adapters=adapters, segment_steps=segment_steps)
    return episodes_output(run.state, run.ep, prompt_tokens, prompt_mask)
