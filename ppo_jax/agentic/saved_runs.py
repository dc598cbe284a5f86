"""A partial multi-turn rollout between two segments of turns (`continuous_rollout.EpisodeRun`), saved
with a checkpoint and rebuilt on resume, so a SIGTERM with episodes in flight resumes bit for bit.

Saved (`run_arrays`): every array of the decoder's state by tree path (its KV cache included), the
prompts, and every bookkeeping array (`Episodes`, the parked rows' held answers, the turn versions).

Not saved: the environments. They are Python objects that may hold processes, sockets or files, so
they are rebuilt by replay (`rebuild_run`): each is reset with its row's record and stepped again
with the very turns it was given, and each answer must be the one it gave before (the reward, the
done flag and the observation's tokens as they were appended or held). An environment whose
answers do not follow from the turns it is given cannot be resumed exactly: resuming stops with a
line naming the row and the turn.

Shapes: R rows, M = max_turns, T response columns, O = max_observation_tokens.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ppo_jax import sharding
from ppo_jax.checkpoint import trees
from ppo_jax.agentic.bookkeeping import Answers, Episodes
from ppo_jax.agentic.continuous_rollout import EpisodeRun
from ppo_jax.agentic.environment import Environment, StepResult, Turn, timed_step
from ppo_jax.sampling.turns import LENGTH, TurnState

class ReplayMismatch(RuntimeError):
    """A restored environment answered a replayed turn otherwise than it did before the checkpoint."""


def run_arrays(run: EpisodeRun) -> dict[str, np.ndarray]:
    """Every array of `run` as a host array by name (waits for the device)."""
    arrays = {"state" + name: a for name, a in trees.host_arrays_by_path(run.state).items()}
    arrays["prompt_tokens"], arrays["prompt_mask"] = map(np.asarray, sharding.to_host((run.prompt_tokens,
                                                                                       run.prompt_mask)))
    arrays.update({f"ep.{name}": value for name, value in vars(run.ep).items() if isinstance(value, np.ndarray)})
    arrays.update({f"held.{f.name}": getattr(run.held, f.name) for f in dataclasses.fields(Answers)})
    arrays.update(decoding=run.decoding, parked=run.parked, turn_versions=run.turn_versions)
    return arrays


def rebuild_run(arrays: Mapping[str, np.ndarray], abstract_state: TurnState, mesh, *,
                environments: dict[int, Environment], decode_turn: Callable[[Sequence[int]], str],
                tokenizer: Any, response_length: int, workers: int = 16) -> EpisodeRun:
    """The run `run_arrays` saved: its state back on `mesh` (replicated; the decoder's constraints
    split the rows again), its bookkeeping, and `environments` (this process's, by row, freshly
    reset) stepped again through the turns they were given (`replay`). `abstract_state`: the
    decoder's state shapes for these prompts, to check the saved arrays against."""
    place = (lambda a: sharding.replicate(a, mesh)) if mesh is not None else jnp.asarray
    state = trees.tree_from_host_arrays(arrays, abstract_state, place, prefix="state",
                                        what="the checkpoint's multi-turn rollout in flight")
    rows, max_turns = arrays["ep.turn_ends"].shape
    ep = Episodes(rows, max_turns)
    for name, value in arrays.items():
        if name.startswith("ep."):
            setattr(ep, name[len("ep."):], np.array(value))
    run = EpisodeRun(state=state, ep=ep,
                     decoding=np.array(arrays["decoding"]), parked=np.array(arrays["parked"]),
                     held=Answers(**{f.name: np.array(arrays[f"held.{f.name}"]) for f in dataclasses.fields(Answers)}),
                     turn_versions=np.array(arrays["turn_versions"]), environments=environments,
                     prompt_tokens=arrays["prompt_tokens"], prompt_mask=arrays["prompt_mask"], decode_turn=decode_turn)
    replay(run, np.asarray(arrays["state.tokens"]), np.asarray(arrays["state.action_mask"]), tokenizer,
           response_length, workers)
    return run


def replay(run: EpisodeRun, tokens: np.ndarray, action_mask: np.ndarray, tokenizer: Any, response_length: int,
           workers: int = 16) -> None:
    """Steps each of the run's (freshly reset) environments through its row's turns again, in order,
    the rows in parallel; raises ReplayMismatch at the first answer that differs from the record."""
    def row_replay(row: int) -> None:
        for turn, (ids, observation) in enumerate(_row_turns(run, row, tokens[row], action_mask[row])):
            result, _ = timed_step(run.environments[row], Turn(text=run.decode_turn(ids), token_ids=ids))
            _check_answer(run, row, turn, result, observation, tokenizer, response_length)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(workers, len(run.environments))),
                                               thread_name_prefix="replay") as pool:
        for future in [pool.submit(row_replay, row) for row in run.environments]:
            future.result()


def _row_turns(run: EpisodeRun, row: int, tokens: np.ndarray, action_mask: np.ndarray):
    """(the turn's action ids, the observation ids appended or held after it, or None where none
    was) for each turn of `row` its environment was stepped with: every ended turn but a last one cut
    by the response length."""
    ep = run.ep
    turns = int(ep.turns[row]) - int(ep.reason[row] == LENGTH)
    actions = np.flatnonzero(action_mask)
    for turn in range(turns):
        end = int(ep.turn_ends[row, turn])
        start = int(actions[actions <= end][0]) if turn == 0 else int(actions[actions > ep.turn_ends[row, turn - 1]][0])
        if turn + 1 < ep.turns[row]:  # appended: the columns between this turn and the next
            following = int(actions[actions > end][0])
            observation = tokens[end + 1:following].tolist()
        elif run.parked[row]:
            observation = run.held.ids[row, :run.held.length[row]].tolist()
        else:
            observation = None
        yield tokens[start:end + 1].tolist(), observation


def _check_answer(run: EpisodeRun, row: int, turn: int, result: StepResult, observation: list[int] | None,
                  tokenizer: Any, response_length: int) -> None:
    """Raises ReplayMismatch when `result` is not the answer the row's turn got before."""
    ep, what = run.ep, None
    if not isinstance(result, StepResult):
        what = f"answered {type(result).__name__}, not a StepResult"
    elif np.float32(result.reward) != ep.turn_rewards[row, turn]:
        what = f"paid {result.reward}, not {ep.turn_rewards[row, turn]}"
    elif turn == ep.turns[row] - 1 and bool(result.done) != bool(ep.done[row]):
        what = f"answered done={result.done}, not {bool(ep.done[row])}"
    elif observation is not None:
        answer = Answers.none(len(ep.turns), run.held.ids.shape[1])
        answer.put(row, result, 0.0, tokenizer, room=response_length - int(ep.turn_ends[row, turn]) - 2)
        if answer.ids[row, :answer.length[row]].tolist() != observation:
            what = "answered another observation"
    if what is not None:
        raise ReplayMismatch(
            f"resuming the multi-turn rollout in flight: the environment of row {row}, stepped again with its turn "
            f"{turn}, {what}. Partial multi-turn rollouts resume an environment by resetting it with its record and "
            "replaying the turns it was given, so its answers must follow from them (no clock, no unseeded "
            "randomness, no outside state)")
