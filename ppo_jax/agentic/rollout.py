"""Multi-turn rollouts: the host loop over turns around `sampling.turns.TurnDecoder`.

    envs, prompts = reset_episodes(factory, records)        # one environment per row
    out = rollout(decoder, params, prompt_tokens, prompt_mask, envs, key, tokenizer=tok, max_turns=4)

Each round: one compiled decode segment runs every active row to the end of its turn (a turn-stop
sequence, a final stop token, or the row's total length T); the host decodes the turns that ended
at a stop, steps all their environments at once (`environment.step_all`, a thread pool: rows wait
in parallel, never one after another), tokenises the observations, and one compiled `append`
prefills just those tokens into the resumed rows' caches. A row goes on while its environment is
not done, its turns are fewer than `max_turns` and it has room; its observation is cut to
`max_observation_tokens` and to the room left (`observations_truncated` counts the cut tokens).

Which turns are stepped: every turn that ended at a turn stop or a final stop, including the last
one allowed (the environment may pay its reward then); a turn cut by the total length is not (it is
unfinished). An observation is appended only to a row that goes on.

Shapes: R rows, Lq prompt length, T response length, M = max_turns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.struct
import jax
import numpy as np

from ppo_jax.agentic.environment import Environment, StepBatch, StepResult, Turn, step_all
from ppo_jax.config import check
from ppo_jax.sampling.turns import FINAL_STOP, TURN_STOP, TurnDecoder, TurnState

INFO_KEYS = ("tool_calls", "tool_errors", "tool_timeouts")  # StepResult.info counts summed per row


@flax.struct.dataclass
class MultiTurnOutput:
    """A batch of multi-turn episodes, as host (NumPy) arrays.

    prompt_tokens, prompt_mask [R, Lq]: the prompts (left-padded).
    tokens [R, T]: the whole response, actions and observations interleaved, pad after the end.
    mask [R, T]: 1 on every real token (what the training forward reads as context).
    action_mask [R, T]: 1 on the policy's tokens only (log-probs, KL, advantages, losses).
    logprobs, sampling_logprobs [R, T]: as `SampleOutput`'s on action tokens, 0 elsewhere.
    stopped [R] bool: the episode ended with a final stop token (EOS).
    turns [R] int32: policy turns (a turn cut by the length counts).
    turn_ends [R, M] int32: column of each turn's last action token, -1 past the row's turns.
    turn_rewards [R, M] float32: the environment's reward for each turn (0 when not stepped).
    environment_done [R] bool: the environment ended the episode.
    tool_calls, tool_errors, tool_timeouts [R] float32: `StepResult.info` summed over the turns.
    environment_seconds [R] float32: the row's own step time, summed over its turns.
    environment_wall_seconds [M] float32: each round's `step_all` wall time (0: no round).
    observations_truncated [R] int32: observation tokens cut by `max_observation_tokens` or T.
    """

    prompt_tokens: np.ndarray
    prompt_mask: np.ndarray
    tokens: np.ndarray
    mask: np.ndarray
    action_mask: np.ndarray
    logprobs: np.ndarray
    sampling_logprobs: np.ndarray
    stopped: np.ndarray
    turns: np.ndarray
    turn_ends: np.ndarray
    turn_rewards: np.ndarray
    environment_done: np.ndarray
    tool_calls: np.ndarray
    tool_errors: np.ndarray
    tool_timeouts: np.ndarray
    environment_seconds: np.ndarray
    environment_wall_seconds: np.ndarray
    observations_truncated: np.ndarray

    @property
    def rewards(self) -> np.ndarray:
        """[R]: the environment's rewards summed over the episode."""
        return self.turn_rewards.sum(axis=1)


def reset_episodes(factory: Callable[[], Environment], records: Sequence[Mapping[str, Any]]
                   ) -> tuple[list[Environment], list[str]]:
    """A fresh environment per record (row) and the first prompt texts its `reset` returns."""
    envs = [factory() for _ in records]
    return envs, [env.reset(record) for env, record in zip(envs, records)]


def turn_decoder(tokenizer: Any, final_stops: Sequence[int]) -> Callable[[Sequence[int]], str]:
    """A turn's token ids -> the text its environment reads: special tokens kept (a stop marker may
    be one), the final stop tokens dropped."""
    final = set(int(t) for t in final_stops)
    return lambda ids: tokenizer.decode([t for t in ids if t not in final], skip_special_tokens=False)


class Episodes:
    """The host's per-row bookkeeping across rounds (R rows, M turns)."""

    def __init__(self, rows: int, max_turns: int):
        self.max_turns = max_turns
        self.live = np.ones(rows, bool)
        self.turn_start = np.zeros(rows, np.int64)
        self.turns = np.zeros(rows, np.int32)
        self.turn_ends = np.full((rows, max_turns), -1, np.int32)
        self.turn_rewards = np.zeros((rows, max_turns), np.float32)
        self.done = np.zeros(rows, bool)
        self.info = {k: np.zeros(rows, np.float32) for k in INFO_KEYS}
        self.seconds = np.zeros(rows, np.float32)
        self.wall = np.zeros(max_turns, np.float32)
        self.truncated = np.zeros(rows, np.int32)

    def turn(self, row: int, tokens: np.ndarray, column: np.ndarray, decode_turn) -> Turn:
        """Row `row`'s current turn: its action ids from the turn's start to `column[row]` (host
        tokens [R, T])."""
        ids = tokens[row, self.turn_start[row]:column[row]].tolist()
        return Turn(text=decode_turn(ids), token_ids=ids)

    def end_turn(self, row: int, column: int) -> int:
        """Row `row`'s turn ended at response column `column` (its next free one); returns the turn's
        index."""
        turn = int(self.turns[row])
        self.turns[row] += 1
        self.turn_ends[row, turn] = column - 1
        return turn

    def record(self, row: int, turn: int, result: StepResult, seconds: float) -> None:
        """Row `row`'s environment answered its turn `turn` in `seconds`."""
        self.turn_rewards[row, turn] = result.reward
        self.done[row] = result.done
        self.seconds[row] += seconds
        for k in INFO_KEYS:
            self.info[k][row] += float(result.info.get(k, 0.0))

    def goes_on(self, row: int, reason: int, column: int, new: int) -> bool:
        """Whether the row takes another turn after its environment answered: its turn ended at a
        turn stop (not EOS), the environment is not done, and turns and columns are left."""
        return bool(reason == TURN_STOP and not self.done[row] and column < new
                    and self.turns[row] < self.max_turns)

    def output(self, out: TurnState, prompt_tokens: Any, prompt_mask: Any) -> MultiTurnOutput:
        """The episodes, from the decoder's final state (host arrays) and this bookkeeping."""
        return MultiTurnOutput(
            prompt_tokens=np.asarray(prompt_tokens), prompt_mask=np.asarray(prompt_mask), tokens=out.tokens,
            mask=out.mask, action_mask=out.action_mask, logprobs=out.logprobs,
            sampling_logprobs=out.sampling_logprobs, stopped=out.reason == FINAL_STOP, turns=self.turns,
            turn_ends=self.turn_ends, turn_rewards=self.turn_rewards, environment_done=self.done, **self.info,
            environment_seconds=self.seconds, environment_wall_seconds=self.wall,
            observations_truncated=self.truncated)

    def step(self, round_: int, steppable: np.ndarray, batch: StepBatch) -> list:
        """Records the results of the rows `steppable` [R] bool; returns each row's result (None: not
        stepped)."""
        results = [None] * len(self.live)
        for row, result, seconds in zip(np.flatnonzero(steppable), batch.results, batch.seconds):
            results[row] = result
            self.record(row, round_, result, seconds)
        self.wall[round_] = batch.wall_seconds
        return results


def observations(tokenizer, results, resume, column, new, width):
    """The resumed rows' observation ids [R, O], their lengths [R] (cut to O and to the room left,
    column + k < T) and the tokens cut [R]."""
    rows = len(results)
    ids = np.zeros((rows, width), np.int32)
    lengths, cut = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    for row in np.flatnonzero(resume):
        encoded = tokenizer.encode(results[row].observation, add_special_tokens=False) \
            if results[row].observation else []
        keep = min(len(encoded), width, new - int(column[row]) - 1)
        ids[row, :keep], lengths[row], cut[row] = encoded[:keep], keep, len(encoded) - keep
    return ids, lengths, cut


def rollout(decoder: TurnDecoder, params: Any, prompt_tokens: Any, prompt_mask: Any,
            environments: Sequence[Environment], key: jax.Array, *, tokenizer: Any, max_turns: int,
            environment_workers: int = 16, adapters: Any = None,
            decode_turn: Callable[[Sequence[int]], str] | None = None) -> MultiTurnOutput:
    """Multi-turn episodes of the R left-padded prompts [R, Lq], `environments[r]` (already reset)
    answering row r, up to `max_turns` policy turns and T tokens each. `decode_turn`: a turn's ids ->
    its text (default: `turn_decoder(tokenizer, sampling.stop_token_ids)`); with a mesh, the
    prompts and params must already be placed on it."""
    new = decoder.config.sampling.max_new_tokens
    rows = int(np.shape(prompt_tokens)[0])
    decode_turn = checked_episodes(decoder, rows, environments, tokenizer, max_turns, decode_turn)
    state = decoder.start(params, prompt_tokens, prompt_mask, key, adapters)
    ep = Episodes(rows, max_turns)
    for round_ in range(max_turns):
        state = decoder.decode(params, state, adapters)
        reason, column, tokens = jax.device_get((state.reason, state.column, state.tokens))
        for row in np.flatnonzero(ep.live):
            ep.end_turn(row, column[row])
        steppable = ep.live & ((reason == TURN_STOP) | (reason == FINAL_STOP))
        turns = [ep.turn(row, tokens, column, decode_turn) for row in np.flatnonzero(steppable)]
        batch = step_all([environments[r] for r in np.flatnonzero(steppable)], turns, environment_workers)
        results = ep.step(round_, steppable, batch)
        resume = np.asarray([bool(steppable[r]) and ep.goes_on(r, reason[r], column[r], new) for r in range(rows)])
        ep.live = resume
        if not resume.any():
            break
        state = append_observations(decoder, params, state, ep, tokenizer, results, resume, column, adapters)
    return ep.output(jax.device_get(state), prompt_tokens, prompt_mask)


def checked_episodes(decoder: TurnDecoder, rows: int, environments: Sequence[Environment], tokenizer: Any,
                     max_turns: int, decode_turn: Callable | None) -> Callable[[Sequence[int]], str]:
    """Checks the episodes' settings (one error line each); returns `decode_turn` or the default."""
    check(max_turns >= 1, f"environment.max_turns={max_turns}: an episode needs at least 1 turn")
    check(len(environments) == rows, f"rollout: {len(environments)} environments for {rows} rows")
    return decode_turn or turn_decoder(tokenizer, decoder.config.sampling.stop_token_ids)


def append_observations(decoder: TurnDecoder, params: Any, state: TurnState, ep: Episodes, tokenizer: Any,
                        results: list, resume: np.ndarray, column: np.ndarray, adapters: Any = None) -> TurnState:
    """The resumed rows' (`resume` [R] bool) observations, tokenised and cut, appended to their
    caches; their next turns start after them."""
    config = decoder.config
    ids, lengths, cut = observations(tokenizer, results, resume, column, config.sampling.max_new_tokens,
                                      config.max_observation_tokens)
    ep.truncated += cut
    ep.turn_start = np.where(resume, column + lengths, ep.turn_start)
    if decoder.mesh is not None:
        from ppo_jax import sharding

        ids, lengths, resume = sharding.put_batch((ids, lengths, resume), decoder.mesh)
    return decoder.append(params, state, ids, lengths, resume, adapters)


def rollout_metrics(out: MultiTurnOutput) -> dict[str, float]:
    """The issue's metrics over a batch: turns and tool calls per episode, tool errors and time-outs,
    environment time, observation vs action tokens."""
    actions, real = out.action_mask.sum(), out.mask.sum()
    return {
        "rollout/turns": float(out.turns.mean()),
        "rollout/tool_calls": float(out.tool_calls.mean()),
        "rollout/tool_errors": float(out.tool_errors.sum()),
        "rollout/tool_timeouts": float(out.tool_timeouts.sum()),
        "rollout/observation_tokens": float(real - actions),
        "rollout/action_tokens": float(actions),
        "rollout/observations_truncated": float(out.observations_truncated.sum()),
        "time/environment": float(out.environment_wall_seconds.sum()),
    }
