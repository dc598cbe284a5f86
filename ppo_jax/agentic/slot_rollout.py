"""Multi-turn rollouts on fewer decode slots than episodes (`rollout.engine=continuous` with an
environment and `rollout.slots` below the rows): the continuous schedule, plus a waiting episode's
slot given to another.

    out = rollout(slot_decoder, params, prompt_tokens, prompt_mask, envs, key, tokenizer=tok, max_turns=4,
                  segment_steps=8)

`continuous_rollout.py` keeps every episode in its cache row from its first token to its last, so a
row whose environment is stepping holds its slot idle, and a decode step pays for all E rows. Here S
slots decode the E episodes (`sampling/turn_slots.py`). The host loops over decode segments of
`segment_steps` steps and, after each:

1. steps the environment of every episode whose turn just ended, on a thread pool (an episode cut by
   the length, or whose environment ended it, gives its slot up for good);
2. appends the observation of every answered episode that still holds its slot (`append`, no
   recompute), and queues the answered episodes that gave theirs up;
3. fills the free slots (`insert`, up to P = `insert_rows` episodes a call): first the queued
   episodes, re-prefilled whole with their observation, then episodes not yet started. When more
   wait than slots are free and fewer than half the slots decode, episodes whose environment has
   been stepping for longer than a decode segment takes give their slot up (`store`), the
   most recently submitted first (under a steady environment latency, the longest left to wait). A
   re-prefill costs a forward over the whole row, so a slot is taken only from an environment slower
   than a segment, and only while the decode batch is less than half full.
4. blocks on the environments only when no slot has a row to decode, and then only until the first
   of them has stepped longer than a segment, if episodes wait for a slot (step 3 gives it up).

Same episodes as the other schedules for the same key and deterministic environments: episode e
draws the uniform (e, t) at response column t in whichever slot, and a re-prefilled row holds the
same tokens at the same positions (log-probs to float round-off). One process only (the slots'
bookkeeping is not gathered across processes).

Shapes: E episodes (rows of the prompts), S slots, O observation tokens, T response columns.
"""

from __future__ import annotations

import collections
import concurrent.futures
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ppo_jax import sharding
from ppo_jax.agentic.bookkeeping import Episodes, collect_answers, raise_failures
from ppo_jax.agentic.continuous_rollout import wait_for_one
from ppo_jax.agentic.environment import Environment, timed_step
from ppo_jax.agentic.rollout import MultiTurnOutput, checked_episodes, episodes_output
from ppo_jax.config import check
from ppo_jax.sampling.turn_slots import SlotDecoder
from ppo_jax.sampling.turns import FINAL_STOP, RUNNING, TURN_STOP


def check_one_process(slots: int) -> None:
    """The slot schedule runs on one process: its slot table is not gathered across processes."""
    check(jax.process_count() == 1, f"rollout.slots={slots} with an environment runs on one process (the slots' "
          f"bookkeeping is not gathered across the {jax.process_count()}); leave rollout.slots 0")


class SlotTable:
    """Which episode each slot holds (S slots, E episodes), on the host."""

    def __init__(self, slots: int, episodes: int):
        self.episode = np.full(slots, -1)  # [S]: the episode a slot holds, -1 free
        self.slot = np.full(episodes, -1)  # [E]: the slot an episode holds, -1 none

    def take(self, slot: int, episode: int) -> None:
        self.episode[slot], self.slot[episode] = episode, slot

    def free(self, episodes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Gives the episodes' slots up: (their slots, the episodes), for `SlotDecoder.store`."""
        episodes = np.asarray(episodes, np.int32)
        slots = self.slot[episodes].astype(np.int32)
        self.episode[slots], self.slot[episodes] = -1, -1
        return slots, episodes

    def free_slots(self) -> np.ndarray:
        return np.flatnonzero(self.episode < 0)

    def per_slot(self, values: np.ndarray, episodes: np.ndarray) -> np.ndarray:
        """values [E, ...] of `episodes` (held ones) at their slots [S, ...], zeros elsewhere."""
        out = np.zeros((len(self.episode),) + values.shape[1:], values.dtype)
        out[self.slot[episodes]] = values[episodes]
        return out


# Ten GIL switch intervals (50 ms): with the cores busy (XLA's threads, other processes) a thread
# handed an instant environment step can wait several scheduler slices before it runs. At the former
# two intervals, instant environments beside 3 busy processes on 2 cores lost a slot in 1 run of 7.
MIN_PATIENCE_S = 10 * sys.getswitchinterval()


class SegmentClock:
    """How long a decode segment takes: the fastest measured, from its dispatch to the next look (the
    rollout compiles the program before it times the first)."""

    def __init__(self):
        self.fastest, self._started = float("inf"), None

    def started(self) -> None:
        self._started = time.perf_counter()

    def looked(self) -> None:
        if self._started is not None:
            self.fastest, self._started = min(self.fastest, time.perf_counter() - self._started), None

    @property
    def timed(self) -> bool:
        """Whether a segment has been timed yet."""
        return self.fastest < float("inf")

    @property
    def patience(self) -> float:
        """How long an environment may step before its episode gives its slot up: a segment, and not
        less than MIN_PATIENCE_S (an instant environment's thread may wait that long to run at all on
        a loaded machine, and taking its slot would cost a re-prefill for nothing)."""
        return max(self.fastest, MIN_PATIENCE_S)


def _slots_to_give_up(waiting: dict[int, concurrent.futures.Future], table: SlotTable, submitted_at: np.ndarray,
                      patience: float, count: int) -> list[int]:
    """Up to `count` episodes holding a slot whose environment has stepped longer than `patience`
    seconds and is stepping still, the most recently submitted first (under a steady latency, the
    longest left to wait). One that answered since this look collected the answers keeps its slot: the
    look may have spent longer than `patience` compiling an `append` or `insert`."""
    now = time.perf_counter()
    stale = [e for e in waiting if table.slot[e] >= 0 and now - submitted_at[e] > patience and not waiting[e].done()]
    return sorted(stale, key=lambda e: -submitted_at[e])[:count]


def _until_stale(waiting: dict[int, concurrent.futures.Future], table: SlotTable, submitted_at: np.ndarray,
                 patience: float) -> float | None:
    """Seconds until the first episode holding a slot has waited on its environment longer than
    `patience` (0 if one has); None if none holds a slot."""
    holding = [submitted_at[e] for e in waiting if table.slot[e] >= 0]
    if not holding or not np.isfinite(patience):
        return None
    return max(0.0, min(holding) + patience - time.perf_counter())


def rollout(decoder: SlotDecoder, params: Any, prompt_tokens: Any, prompt_mask: Any,
            environments: Sequence[Environment], key: jax.Array, *, tokenizer: Any, max_turns: int,
            environment_workers: int = 16, adapters: Any = None,
            decode_turn: Callable[[Sequence[int]], str] | None = None, segment_steps: int = 8) -> MultiTurnOutput:
    """`agentic.rollout.rollout`'s episodes (same arguments and output, plus `reprefilled_turns`), on
    `decoder.slots` decode slots (see the module docstring)."""
    check(segment_steps >= 1, f"environment.segment_steps={segment_steps}: use at least 1 decode step")
    check_one_process(decoder.slots)
    new = decoder.config.sampling.max_new_tokens
    episodes = int(np.shape(prompt_tokens)[0])
    mine, decode_turn = checked_episodes(decoder, prompt_tokens, environments, tokenizer, max_turns, decode_turn)
    state, store = decoder.empty(params, prompt_tokens, prompt_mask, key, adapters)
    ep, table = Episodes(episodes, max_turns), SlotTable(decoder.slots, episodes)
    decoding = np.zeros(episodes, bool)  # episodes in a turn on the device
    submitted_at = np.zeros(episodes)  # when each episode's environment step began (perf_counter)
    clock = SegmentClock()
    fresh = collections.deque(range(episodes))  # episodes not started
    queued: dict[int, tuple[np.ndarray, int]] = {}  # answered, going on, slot given up: observation ids, length
    waiting: dict[int, concurrent.futures.Future] = {}  # environments stepping, by episode
    reprefilled = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(environment_workers, episodes)),
                                               thread_name_prefix="environment") as pool:
        while True:
            reason, column, active = sharding.to_host((state.reason, state.column, state.active))
            clock.looked()
            in_turn = np.zeros(decoder.slots, bool)
            in_turn[table.slot[decoding]] = True
            if (active != (in_turn & (reason == RUNNING))).any():
                raise RuntimeError(f"multi-turn rollout: the device decodes slots {np.flatnonzero(active)}, the "
                                   f"host expected {np.flatnonzero(in_turn & (reason == RUNNING))}")
            ended = np.flatnonzero(in_turn & (reason != RUNNING))
            tokens = sharding.to_host(state.tokens) if ended.size else None
            leaving = []  # episodes giving their slot up at this look
            for slot in ended:
                e = int(table.episode[slot])
                ep.end_turn(e, column[slot], reason[slot])
                decoding[e] = False
                if reason[slot] in (TURN_STOP, FINAL_STOP):
                    waiting[e] = pool.submit(timed_step, mine[e], ep.turn(e, tokens[slot], column[slot], decode_turn))
                    submitted_at[e] = time.perf_counter()
                else:  # cut by the length: the episode is over
                    leaving.append(e)
            answers, failure = collect_answers(waiting, decoder.config.max_observation_tokens, tokenizer,
                                               new - ep.last_column - 1)
            raise_failures(answers, failure)  # one process: nothing to gather
            ep.record(answers)
            resume = ep.goes_on(answers, new)
            ids, lengths = ep.take_observations(answers, resume)
            leaving += [int(e) for e in np.flatnonzero(answers.answered & ~resume & (table.slot >= 0))]
            kept = resume & (table.slot >= 0)
            if kept.any():
                state = decoder.append(params, state, table.per_slot(ids, kept), table.per_slot(lengths, kept),
                                       table.per_slot(np.ones(episodes, bool), kept), adapters)
                decoding |= kept
            queued.update((int(e), (ids[e], int(lengths[e]))) for e in np.flatnonzero(resume & (table.slot < 0)))
            shortfall = len(queued) + len(fresh) - len(table.free_slots()) - len(leaving)
            if shortfall > 0 and 2 * decoding.sum() < decoder.slots:
                leaving += _slots_to_give_up(waiting, table, submitted_at, clock.patience, shortfall)
            if leaving:
                store = decoder.store(state, store, *table.free(leaving))
            state, started = _fill(decoder, params, state, store, table, queued, fresh, adapters)
            decoding[started] = True
            reprefilled += sum(int(ep.turns[e] > 0) for e in started)
            if decoding.any():
                if not clock.timed:
                    # Compile (or fetch) the decode program for this state before the clock times a
                    # segment: zero steps change nothing. A first segment that compiled would set
                    # the patience to the compile time until a second one is timed.
                    state = decoder.decode(params, state, adapters, max_steps=0)
                clock.started()
                state = decoder.decode(params, state, adapters, max_steps=segment_steps)
            elif waiting:  # every slot waits: wake when one of them may be given up to a waiting episode
                wait_for_one(waiting, ep, _until_stale(waiting, table, submitted_at, clock.patience)
                             if queued or fresh else None)
            elif not (queued or fresh):
                break
    held = np.flatnonzero(table.slot >= 0)
    if held.size:
        store = decoder.store(state, store, *table.free(held))
    return episodes_output(state, ep, prompt_tokens, prompt_mask, store=store, reprefilled_turns=reprefilled)


def _fill(decoder: SlotDecoder, params: Any, state, store, table: SlotTable,
          queued: dict[int, tuple[np.ndarray, int]], fresh: collections.deque, adapters: Any) -> tuple[Any, list[int]]:
    """The free slots filled, `insert_rows` a call: the queued episodes first (in the order they were
    queued, re-prefilled with their observations), then new ones (their prompts alone). Returns the
    state and the episodes started."""
    started = []
    free = list(table.free_slots())
    while free and (queued or fresh):
        count = min(len(free), decoder.insert_rows, len(queued) or len(fresh))
        slots, free = free[:count], free[count:]
        if queued:
            episodes = list(queued)[:count]
            ids, lengths = zip(*(queued.pop(e) for e in episodes))
            state = decoder.insert(params, state, store, slots, episodes, np.stack(ids), lengths, adapters)
        else:
            episodes = [fresh.popleft() for _ in range(count)]
            state = decoder.insert(params, state, store, slots, episodes, adapters=adapters)
        for slot, e in zip(slots, episodes):
            table.take(slot, e)
        started += episodes
    return state, started
