"""The host's side of a multi-turn rollout, shared by both schedules (`rollout.py`, rounds;
`continuous_rollout.py`, per row): which rows this process steps, the environments' answers as
arrays, and the per-row bookkeeping of the episodes.

Several processes. Each one steps the environments of the rows it owns (the rows of its own prompts;
a row every process holds is owned by the lowest), and every one keeps the bookkeeping of all R rows:
the answers of every process are gathered (`gather`), so the bookkeeping, and every decision taken
from it (which rows go on, whether to append or decode again, when to stop), is the same everywhere,
and every process calls the same compiled programs in the same order. One process: nothing is
gathered.

Shapes: R rows, O = `max_observation_tokens`, M = `max_turns`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ppo_jax.agentic.environment import Environment, EnvironmentFailure, StepResult, Turn, step_outcome
from ppo_jax.sampling.turns import TURN_STOP

INFO_KEYS = ("tool_calls", "tool_errors", "tool_timeouts")  # StepResult.info counts summed per row


@dataclasses.dataclass(frozen=True)
class Ownership:
    """held [h]: the rows whose prompts (and environments, in that order) this process holds;
    owned [R] bool: the rows whose environments this process steps."""

    held: np.ndarray
    owned: np.ndarray

    @classmethod
    def of(cls, prompt_tokens: Any) -> "Ownership":
        """From where the rows of `prompt_tokens` [R, Lq] (a global array, or host) live."""
        rows = int(np.shape(prompt_tokens)[0])
        if jax.process_count() == 1 or not isinstance(prompt_tokens, jax.Array):
            return cls(np.arange(rows), np.ones(rows, bool))
        owner, held, me = np.full(rows, jax.process_count()), np.zeros(rows, bool), jax.process_index()
        for device, index in prompt_tokens.sharding.devices_indices_map(prompt_tokens.shape).items():
            span = np.arange(rows)[index[0]]
            owner[span] = np.minimum(owner[span], device.process_index)
            held[span] |= device.process_index == me
        return cls(np.flatnonzero(held), owner == me)

    def environments(self, environments: Sequence[Environment]) -> dict[int, Environment]:
        """The owned rows' environments by row, from `environments` (one per held row, in order)."""
        if len(environments) != len(self.held):
            raise ValueError(f"rollout: {len(environments)} environments for the {len(self.held)} rows this "
                             "process holds")
        return {int(row): env for row, env in zip(self.held, environments) if self.owned[row]}


@dataclasses.dataclass
class Answers:
    """The environments' answers to some rows' turns, a slot per row (R rows, O tokens).

    answered [R] bool; reward, seconds [R] float32; done [R] bool; info [R, 3] float32 (INFO_KEYS);
    ids [R, O] int32: the observation tokenised and cut to O and to the row's room (column + k < T);
    length [R] int32: k; cut [R] int32: the observation tokens cut; failed [R] bool: the row's
    environment raised (on whichever process steps it: every process stops, `raise_failures`).
    """

    answered: np.ndarray
    reward: np.ndarray
    done: np.ndarray
    info: np.ndarray
    seconds: np.ndarray
    ids: np.ndarray
    length: np.ndarray
    cut: np.ndarray
    failed: np.ndarray

    @classmethod
    def none(cls, rows: int, width: int) -> "Answers":
        zeros = lambda dtype, *shape: np.zeros((rows, *shape), dtype)  # noqa: E731
        return cls(answered=zeros(bool), reward=zeros(np.float32), done=zeros(bool),
                   info=zeros(np.float32, len(INFO_KEYS)), seconds=zeros(np.float32), ids=zeros(np.int32, width),
                   length=zeros(np.int32), cut=zeros(np.int32), failed=zeros(bool))

    def put(self, row: int, result: StepResult, seconds: float, tokenizer: Any, room: int) -> None:
        """Row `row`'s answer; its observation keeps at most O tokens and `room` (T - column - 1)."""
        encoded = tokenizer.encode(result.observation, add_special_tokens=False) if result.observation else []
        keep = max(0, min(len(encoded), self.ids.shape[1], room))
        self.answered[row], self.reward[row], self.done[row] = True, result.reward, result.done
        self.seconds[row] = seconds
        self.info[row] = [float(result.info.get(k, 0.0)) for k in INFO_KEYS]
        self.ids[row, :keep], self.length[row], self.cut[row] = encoded[:keep], keep, len(encoded) - keep


    def keep(self, answers: "Answers", rows: np.ndarray) -> None:
        """`answers`' rows where `rows` [R] bool is set, copied into these (held for later)."""
        for f in dataclasses.fields(self):
            getattr(self, f.name)[rows] = getattr(answers, f.name)[rows]


def gather(answers: Answers) -> Answers:
    """Every process's answers (each row answered by its owner only), the same on every process. A
    collective: every process calls it at the same point."""
    if jax.process_count() == 1:
        return answers
    every = multihost_utils.process_allgather(dataclasses.asdict(answers))  # each [P, R, ...]
    mine = every["answered"]

    def combine(name):
        values = every[name]
        if name == "failed":
            return values.any(axis=0)
        where = mine.reshape(mine.shape + (1,) * (values.ndim - mine.ndim))
        return np.where(where, values, 0).sum(axis=0).astype(values.dtype)

    return Answers(**{f.name: combine(f.name) for f in dataclasses.fields(Answers)})


def collect_answers(waiting: dict[int, concurrent.futures.Future], width: int, tokenizer: Any, room: np.ndarray
                    ) -> tuple[Answers, EnvironmentFailure | None]:
    """The answers of this process's environments done stepping (taken out of `waiting`, by row),
    each observation cut to its row's `room` [R]; and the first error one raised (its row flagged
    `failed`), to be raised after `gather` (`raise_failures`), so that every process stops."""
    answers, failure = Answers.none(len(room), width), None
    for row in [row for row, future in waiting.items() if future.done()]:
        try:
            result, seconds = step_outcome(row, waiting.pop(row))
        except EnvironmentFailure as e:
            answers.failed[row], failure = True, failure or e
            continue
        answers.put(row, result, seconds, tokenizer, room=int(room[row]))
    return answers, failure


def raise_failures(answers: Answers, local: EnvironmentFailure | None) -> None:
    """After `gather`: stops every process when any environment raised. This process raises its own
    error; the others one that names the row (its error is in its own process's output)."""
    if local is not None:
        raise local
    if answers.failed.any():
        row = int(np.flatnonzero(answers.failed)[0])
        raise EnvironmentFailure(row, f"the environment of row {row} raised on another process (its error "
                                      "is in that process's output); this process stops with it")


class Episodes:
    """The per-row bookkeeping across turns (R rows, M turns), the same on every process."""

    def __init__(self, rows: int, max_turns: int):
        self.max_turns = max_turns
        self.live = np.ones(rows, bool)
        self.turn_start = np.zeros(rows, np.int64)
        self.turns = np.zeros(rows, np.int32)
        self.turn_ends = np.full((rows, max_turns), -1, np.int32)
        self.turn_rewards = np.zeros((rows, max_turns), np.float32)
        self.done = np.zeros(rows, bool)
        self.info = np.zeros((rows, len(INFO_KEYS)), np.float32)
        self.seconds = np.zeros(rows, np.float32)
        self.wall = np.zeros(max_turns, np.float32)  # this process's own waits (a metric, not a decision)
        self.truncated = np.zeros(rows, np.int32)
        self.reason = np.zeros(rows, np.int32)  # why each row's last turn ended (sampling.turns reasons)

    def turn(self, row: int, row_tokens: np.ndarray, column: int, decode_turn) -> Turn:
        """Row `row`'s current turn: its action ids from the turn's start to `column`, of the row's
        host response tokens [T]."""
        ids = row_tokens[self.turn_start[row]:column].tolist()
        return Turn(text=decode_turn(ids), token_ids=ids)

    def end_turn(self, row: int, column: int, reason: int) -> None:
        """Row `row`'s turn ended at response column `column` (its next free one), for `reason`."""
        self.turn_ends[row, self.turns[row]] = column - 1
        self.turns[row] += 1
        self.reason[row] = reason

    def record(self, answers: Answers) -> None:
        """The answered rows' rewards (on their last turn), done flags, times and info counts."""
        rows = np.flatnonzero(answers.answered)
        self.turn_rewards[rows, self.turns[rows] - 1] = answers.reward[rows]
        self.done[rows] = answers.done[rows]
        self.seconds[rows] += answers.seconds[rows]
        self.info[rows] += answers.info[rows]

    @property
    def last_column(self) -> np.ndarray:
        """[R]: the response column after each row's last ended turn (its next free one; 0 before any)."""
        last = self.turn_ends[np.arange(len(self.turns)), np.maximum(self.turns - 1, 0)] + 1
        return np.where(self.turns > 0, last, 0)

    def goes_on(self, answers: Answers, new: int) -> np.ndarray:
        """[R] bool: the answered rows that take another turn: their last turn ended at a turn stop
        (not EOS), the environment is not done, and turns and columns (of `new`) are left."""
        return (answers.answered & (self.reason == TURN_STOP) & ~self.done & (self.last_column < new)
                & (self.turns < self.max_turns))

    def take_observations(self, answers: Answers, resume: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The resumed rows' observation ids [R, O] and lengths [R] (0 elsewhere); their next turns
        start after them."""
        lengths = np.where(resume, answers.length, 0).astype(np.int32)
        self.truncated += np.where(resume, answers.cut, 0).astype(np.int32)
        self.turn_start = np.where(resume, self.last_column + lengths, self.turn_start)
        return np.where(resume[:, None], answers.ids, 0).astype(np.int32), lengths

    def info_by_key(self) -> dict[str, np.ndarray]:
        return {k: self.info[:, i] for i, k in enumerate(INFO_KEYS)}
