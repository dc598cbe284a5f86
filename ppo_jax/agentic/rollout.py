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

Several processes: each steps the environments of its own rows and the answers are gathered, so
every process takes the same decisions (`bookkeeping.py`). `continuous_rollout.py` gives the same
episodes without the rounds.

Shapes: R rows, Lq prompt length, T response length, M = max_turns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.struct
import jax
import numpy as np

from ppo_jax import sharding
from ppo_jax.agentic.bookkeeping import Answers, Episodes, Ownership, gather, raise_failures
from ppo_jax.agentic.environment import Environment, EnvironmentFailure, step_all
from ppo_jax.config import check
from ppo_jax.sampling.turns import FINAL_STOP, TURN_STOP, TurnDecoder, TurnState


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
    decode_steps [] int32: decode steps run, each for all R rows (the slot schedule: for its S slots;
        None in episodes restored from a checkpoint of before 2026-11-27).
    reprefilled_turns [] int32: the slot schedule's turns resumed by a re-prefill of the whole row,
        having given their slot up while their environment stepped (None on the other schedules).
    decode_rows [] int32: the rows each decode step ran, S slots on the slot schedule (None: R).
    token_policy_version [R, T] int32: partial rollouts, the version of the weights that decoded each
        action token's turn, -1 elsewhere (None: one set of weights decoded the whole batch).
    routed_experts [R, Lq + T, Lm, k] int8/int16 (`sampling.record_experts`, else None): the experts
        each prompt, action and observation token went to when it was fed, -1 where none was.
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
    decode_steps: np.ndarray | None = None
    reprefilled_turns: np.ndarray | None = None
    decode_rows: np.ndarray | None = None
    token_policy_version: np.ndarray | None = None
    routed_experts: np.ndarray | None = None

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


def rollout(decoder: TurnDecoder, params: Any, prompt_tokens: Any, prompt_mask: Any,
            environments: Sequence[Environment], key: jax.Array, *, tokenizer: Any, max_turns: int,
            environment_workers: int = 16, adapters: Any = None,
            decode_turn: Callable[[Sequence[int]], str] | None = None) -> MultiTurnOutput:
    """Multi-turn episodes of the R left-padded prompts [R, Lq], `environments[i]` (already reset)
    answering the i-th row this process holds (every row, with one process), up to `max_turns`
    policy turns and T tokens each. `decode_turn`: a turn's ids -> its text (default:
    `turn_decoder(tokenizer, sampling.stop_token_ids)`); with a mesh, the prompts and params must
    already be placed on it. Every process gets all R episodes."""
    new, width = decoder.config.sampling.max_new_tokens, decoder.config.max_observation_tokens
    rows = int(np.shape(prompt_tokens)[0])
    mine, decode_turn = checked_episodes(decoder, prompt_tokens, environments, tokenizer, max_turns, decode_turn)
    state = decoder.start(params, prompt_tokens, prompt_mask, key, adapters)
    ep = Episodes(rows, max_turns)
    for round_ in range(max_turns):
        state = decoder.decode(params, state, adapters)
        reason, column, tokens = sharding.to_host((state.reason, state.column, state.tokens))
        for row in np.flatnonzero(ep.live):
            ep.end_turn(row, column[row], reason[row])
        stepped = [row for row in np.flatnonzero(ep.live & ((reason == TURN_STOP) | (reason == FINAL_STOP)))
                   if row in mine]
        answers, failure = Answers.none(rows, width), None
        try:
            batch = step_all([mine[r] for r in stepped], [ep.turn(r, tokens[r], column[r], decode_turn) for r in stepped],
                             environment_workers, rows=stepped)
        except EnvironmentFailure as e:  # said after the gather, on every process
            answers.failed[e.row], failure = True, e
        else:
            for row, result, seconds in zip(stepped, batch.results, batch.seconds):
                answers.put(row, result, seconds, tokenizer, room=new - int(column[row]) - 1)
            ep.wall[round_] = batch.wall_seconds
        answers = gather(answers)
        raise_failures(answers, failure)
        ep.record(answers)
        ep.live = ep.goes_on(answers, new)
        if not ep.live.any():
            break
        state = append_observations(decoder, params, state, ep, answers, ep.live, adapters)
    return episodes_output(state, ep, prompt_tokens, prompt_mask)


def checked_episodes(decoder: TurnDecoder, prompt_tokens: Any, environments: Sequence[Environment], tokenizer: Any,
                     max_turns: int, decode_turn: Callable | None
                     ) -> tuple[dict[int, Environment], Callable[[Sequence[int]], str]]:
    """Checks the episodes' settings (one error line each); returns the environments of the rows
    this process steps, by row, and `decode_turn` or the default."""
    check(max_turns >= 1, f"environment.max_turns={max_turns}: an episode needs at least 1 turn")
    mine = Ownership.of(prompt_tokens).environments(environments)
    return mine, decode_turn or turn_decoder(tokenizer, decoder.config.sampling.stop_token_ids)


def append_observations(decoder: TurnDecoder, params: Any, state: TurnState, ep: Episodes, answers: Answers,
                        resume: np.ndarray, adapters: Any = None) -> TurnState:
    """The resumed rows' (`resume` [R] bool, the same on every process) observations appended to
    their caches; their next turns start after them."""
    ids, lengths = ep.take_observations(answers, resume)
    if decoder.mesh is not None:
        ids, lengths, resume = sharding.put_batch((ids, lengths, resume), decoder.mesh)
    return decoder.append(params, state, ids, lengths, resume, adapters)


def episodes_output(state: TurnState, ep: Episodes, prompt_tokens: Any, prompt_mask: Any, store: Any = None,
                    reprefilled_turns: int = 0) -> MultiTurnOutput:
    """The episodes, from the decoder's final state (its buffers, not its cache) and the bookkeeping;
    on the slot schedule from its `store` (an `EpisodeStore`: the same response fields, [R, T]), with
    its `reprefilled_turns` and the state's slots as `decode_rows`."""
    buffers = state if store is None else store
    prompt_tokens, prompt_mask, out = sharding.to_host((prompt_tokens, prompt_mask, {
        "tokens": buffers.tokens, "mask": buffers.mask, "action_mask": buffers.action_mask,
        "logprobs": buffers.logprobs, "sampling_logprobs": buffers.sampling_logprobs,
        "decode_steps": state.decode_steps, "routed_experts": state.experts}))
    return MultiTurnOutput(
        prompt_tokens=np.asarray(prompt_tokens), prompt_mask=np.asarray(prompt_mask), tokens=out["tokens"],
        mask=out["mask"], action_mask=out["action_mask"], logprobs=out["logprobs"],
        sampling_logprobs=out["sampling_logprobs"], stopped=ep.reason == FINAL_STOP, turns=ep.turns,
        turn_ends=ep.turn_ends, turn_rewards=ep.turn_rewards, environment_done=ep.done, **ep.info_by_key(),
        environment_seconds=ep.seconds, environment_wall_seconds=ep.wall, observations_truncated=ep.truncated,
        decode_steps=np.asarray(out["decode_steps"]), routed_experts=out["routed_experts"],
        **({} if store is None else {"reprefilled_turns": np.asarray(reprefilled_turns, np.int32),
                                     "decode_rows": np.asarray(state.tokens.shape[0], np.int32)}))


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
        **({} if out.decode_steps is None else {"perf/decode_row_occupancy": row_occupancy(out)}),
        **({} if out.reprefilled_turns is None else {"rollout/reprefilled_turns": float(out.reprefilled_turns)}),
    }


def row_occupancy(out: MultiTurnOutput) -> float:
    """The share of the decode steps' row-slots that decoded an active row: at most what a decode
    that skipped waiting and ended rows could save (a CPU's decode cost follows the rows; an
    accelerator's, at small batches, the weights it streams)."""
    rows = out.tokens.shape[0] if out.decode_rows is None else int(out.decode_rows)
    return decoded_tokens(out) / max(1.0, float(out.decode_steps) * rows)


def decoded_tokens(out: MultiTurnOutput) -> int:
    """The action tokens the decode steps chose: an active row records one token a step, and the
    others come from `start` (one a row) and `append` (one a resumed turn: each turn after a row's
    first), or on the slot schedule from `insert` (one per first turn and per re-prefilled turn)."""
    return int(out.action_mask.sum()) - out.tokens.shape[0] - int((out.turns - 1).sum())
