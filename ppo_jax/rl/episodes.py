"""Multi-turn rollouts in a PPO run (`environment.name` set, issue 45): `EpisodeRollouts` is
`Rollouts` with the one-turn sampler replaced by episodes (`agentic/rollout.py` over
`sampling/turns.py`): an environment per row answers the policy between its turns, its observations
are appended to the row as context.

What the rest of the run sees: the same `Rollout`, plus `action_mask` [B, Lr] (the policy's tokens;
the forwards read `mask`, observations included), `turn_rewards` and `turn_ends` [B, M] (each turn's
environment reward and its last action column). The reward functions and the reward model score the
final text (the whole transcript); the experience step puts the turn rewards on each turn's last
action token (`ppo.action_mask.action_rewards`). Host metrics per iteration: turns, tool calls,
errors and time-outs per episode, observation vs action tokens, `time/environment`.

A row's record is {"prompt": its prompt's text} (the data stream's tokens decoded; with
rollout.num_samples = n each prompt's record n times, row r from prompt r // n); the prompt the
row is sampled from is what the environment's `reset` returns, tokenised and cut from the left to
`data.prompt_length`. Several processes: each resets and steps the environments of its own prompt
rows, and every one gets all the episodes (`agentic/bookkeeping.py`). Shapes: B rows, Lq prompt
length, Lr = rollout.response_length, M = environment.max_turns.

Off-policy (rollout.off_policy_steps = k): batches of episodes run ahead with the weights of their
version, as one-turn samples do, on an episode thread beside the update (one process); a batch is
waited for before the update that learns from it and before a checkpoint, so the k in flight are
saved as whole episodes (their sample and every `MultiTurnOutput` array) and restored bit for bit.

Partial rollouts (rollout.partial_rollouts, the continuous schedule): a batch in flight is decoded in
segments of turns, one per iteration under the weights synced then (`continuous_rollout.run_turns`):
turns [s q, (s + 1) q) in its segment s, q = ceil(max_turns / (k + 1)), the rest when it is finished,
so a turn's weights follow from its index. Each action token records its turn's version
(`Rollout.token_policy_version`). A checkpoint saves the batches between two segments whole (decoder
state, KV cache, bookkeeping: `agentic/saved_runs.py`); their environments are reset and replayed
through the turns they were given on resume.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax import metrics as metrics_lib
from ppo_jax import sampling, sharding
from ppo_jax.agentic import continuous_rollout, rollout as episodes_lib, slot_rollout
from ppo_jax.config import ConfigError
from ppo_jax.data.tokenization import PromptTokenizer
from ppo_jax.models.transformer import CausalLM
from ppo_jax.rl import roles
from ppo_jax.rl.rollouts import InFlightRecord, Rollouts, StartedRollout, resolve_arrays
from ppo_jax.rl.state import PPOState, Rollout
from ppo_jax.sampling.turn_slots import SlotDecoder
from ppo_jax.sampling.turns import TurnConfig, TurnDecoder


@dataclasses.dataclass
class StartedEpisodes(StartedRollout):
    """A started rollout with its episodes (host arrays: masks, turn rewards, tool counts)."""

    episodes: episodes_lib.MultiTurnOutput | None = None
    pending: concurrent.futures.Future | None = None  # running on the episode thread (off-policy)
    # Partial rollouts, between two segments of turns: the run (or, just restored, its saved arrays),
    # the segments run so far and the rows' records (each environment's reset argument).
    run: continuous_rollout.EpisodeRun | dict[str, np.ndarray] | None = None
    segments_run: int = 0
    records: list[dict[str, str]] | None = None


def with_episodes(started: StartedRollout, episodes: episodes_lib.MultiTurnOutput) -> StartedEpisodes:
    """`started` (a scored sample) with the episodes it was made of."""
    return StartedEpisodes(**{f.name: getattr(started, f.name) for f in dataclasses.fields(StartedRollout)},
                           episodes=episodes)


def not_donated(weights: roles.SyncedWeights, state: PPOState) -> roles.SyncedWeights:
    """`weights` with a copy of every array that is the train state's own (the sampler on the
    trainer's mesh in its dtype: nothing was copied): the update donates those while the episode
    thread still decodes with them."""
    owned = {id(leaf) for leaf in jax.tree.leaves(state)}
    copy = lambda tree: jax.tree.map(lambda x: jnp.copy(x) if id(x) in owned else x, tree)  # noqa: E731
    return dataclasses.replace(weights, params=copy(weights.params), adapters=copy(weights.adapters))


def sample_output(out: episodes_lib.MultiTurnOutput, mesh) -> sampling.SampleOutput:
    """The episodes as the one-turn sampler's output, batch-sharded on `mesh` (mask: every real
    token; log-probs 0 on observations), for the scorer and the reward functions."""
    rows = out.tokens.shape[0]
    lengths = out.mask.sum(-1).astype(np.int32)
    fields = dict(prompt_tokens=out.prompt_tokens, prompt_mask=out.prompt_mask, tokens=out.tokens,
                  logprobs=out.logprobs, sampling_logprobs=out.sampling_logprobs, mask=out.mask, lengths=lengths,
                  stopped=out.stopped,
                  # The static engine's convention: every row decoded for the longest row's steps.
                  slot_steps_at_finish=np.maximum(lengths - 1, 0).astype(np.int32) * rows)
    if out.token_policy_version is not None:  # partial rollouts: each action token's turn's version
        fields["token_policy_version"] = out.token_policy_version
    if out.routed_experts is not None:  # moe.router_replay
        fields["routed_experts"] = out.routed_experts
    return sampling.SampleOutput(**sharding.put_batch(fields, mesh))


def _schedule(r, env, model: CausalLM, config: TurnConfig, mesh):
    """The host schedule of the episodes and its decoder: rounds (`rollout.engine=static`); per row,
    overlapping decoding with the environments (continuous, agentic/continuous_rollout.py); and with
    rollout.slots, per row on S slots shared by the episodes (agentic/slot_rollout.py)."""
    if r.engine == "static":
        return episodes_lib.rollout, TurnDecoder(model, config, mesh)
    if not r.slots:
        return functools.partial(continuous_rollout.rollout, segment_steps=env.segment_steps), \
            TurnDecoder(model, config, mesh)
    slot_rollout.check_one_process(r.slots)  # at build, before anything compiles
    insert_rows = r.prefill_prompts or max(1, r.slots // 4)  # checked <= slots by EnvironmentSettings
    return functools.partial(slot_rollout.rollout, segment_steps=env.segment_steps), \
        SlotDecoder(model, config, r.slots, insert_rows, mesh)


class EpisodeRollouts(Rollouts):
    """`Rollouts` whose samples are multi-turn episodes (see the module docstring)."""

    def __init__(self, *args, model: CausalLM, tokenizer: Any, turn_stops: tuple[tuple[int, ...], ...],
                 prompt_length: int, **kwargs):
        """model: the policy's module; turn_stops: the turn-stop markers' ids (checked against the
        tokenizer before anything compiled: `EnvironmentSettings.turn_stops`)."""
        super().__init__(*args, **kwargs)
        env = self.settings.environment
        self.env_settings, self.tokenizer = env, tokenizer
        self.factory = env.bind(tokenizer)
        # One row per episode: with rollout.num_samples = n each prompt is reset n times (`_records`).
        one_row = dataclasses.replace(self.steps.sampling_config, num_samples=1, engine="static", slots=0,
                                      prefill_prompts=0)
        config = TurnConfig(sampling=one_row, turn_stops=turn_stops,
                            max_observation_tokens=env.max_observation_tokens)
        self.schedule, self.decoder = _schedule(self.settings.rollout, env, model, config, self.meshes.sampler)
        self.prompt_tokenizer = PromptTokenizer(tokenizer, max_prompt_length=prompt_length, truncation="left")
        self.prompt_length = prompt_length
        self.finished: episodes_lib.MultiTurnOutput | None = None  # the last finished batch's episodes
        # Off-policy: one thread runs the batches of episodes in turn while the main thread updates. Not
        # with several processes: the episodes' collectives (gathers, sharded programs) would race the
        # trainer's, in an order that could differ between processes.
        self.episode_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="episodes") \
            if self.settings.rollout.off_policy_steps and jax.process_count() == 1 else None
        self.episode_metrics: dict[str, float] = {}  # the current iteration's, until popped

    def _records(self, prompt_tokens: np.ndarray, prompt_mask: np.ndarray) -> list[dict[str, str]]:
        """One record per episode: each prompt row's n = rollout.num_samples times, row r from prompt
        r // n (the one-turn sampler's layout, which GRPO's and RLOO's groups read), each row then
        reset in an environment of its own and drawing its own tokens."""
        decode, n = self.tokenizer.decode, self.settings.rollout.num_samples
        return [{"prompt": decode([int(t) for t, m in zip(row, rm) if m], skip_special_tokens=True)}
                for row, rm in zip(prompt_tokens, prompt_mask) for _ in range(n)]

    def start(self, state: PPOState, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, key) -> StartedEpisodes:
        """Runs the episodes of this process's prompt rows (host arrays) to their end, and with
        roles.scoring="sampler" dispatches their scoring. On-policy this waits (the host steps the
        environments between turns); off-policy the episodes run on the episode thread and this
        returns at once, so they overlap the update (`finish` waits for them)."""
        weights = self.sampler_weights(state)
        if self.episode_thread is None:
            return self._run_episodes(weights, prompt_tokens, prompt_mask, key, int(state.step))
        weights = not_donated(weights, state)
        future = self.episode_thread.submit(self._run_episodes, weights, prompt_tokens, prompt_mask, key,
                                            int(state.step))
        return StartedEpisodes(sample=None, version=int(state.step), pending=future)

    def _run_episodes(self, weights, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, key,
                      version: int) -> StartedEpisodes:
        """The episodes of the prompt rows, sampled with `weights` (of train step `version`), scored."""
        envs, tokens, mask = self._episode_inputs(self._records(prompt_tokens, prompt_mask))
        out = self.schedule(self.decoder, weights.params, tokens, mask, envs,
                            sharding.replicate(key, self.meshes.sampler), tokenizer=self.tokenizer,
                            max_turns=self.env_settings.max_turns, environment_workers=self.env_settings.workers,
                            adapters=weights.adapters)
        return self._scored_episodes(out, version)

    def _episode_inputs(self, records: list[dict[str, str]]) -> tuple[list, jax.Array, jax.Array]:
        """A fresh environment per record, reset, and the prompts they return tokenised [R, Lq] on the
        sampler's mesh."""
        envs, texts = episodes_lib.reset_episodes(self.factory, records)
        before = self.prompt_tokenizer.num_truncated_prompts
        batch = self.prompt_tokenizer.prompts(texts, length=self.prompt_length)
        if self.prompt_tokenizer.num_truncated_prompts > before and not before:  # said once a run
            metrics_lib.warn(f"the environment's prompts are longer than data.prompt_length={self.prompt_length} "
                             "tokens: cut from the left (raise data.prompt_length)")
        tokens, mask = sharding.put_local_batch((np.asarray(batch.tokens), np.asarray(batch.mask)), self.meshes.sampler)
        return envs, tokens, mask

    def _scored_episodes(self, out: episodes_lib.MultiTurnOutput, version: int) -> StartedEpisodes:
        """Finished episodes as a started rollout (scored on the sampler's mesh with roles.scoring="sampler")."""
        return with_episodes(self._scored(sample_output(out, self.meshes.sampler), version), out)

    @staticmethod
    def _resolved(started: StartedEpisodes) -> StartedEpisodes:
        """`started` with its episodes, waited for if they run on the episode thread (filled in place:
        `Rollouts.next` reads the sample off the same object). An error there is raised here."""
        if started.pending is not None:
            done = started.pending.result()
            for f in dataclasses.fields(StartedEpisodes):
                setattr(started, f.name, getattr(done, f.name))
        return started

    def _check_room(self, more: int) -> None:
        """`Rollouts._check_room`, on the first batch's measured arrays (waited for)."""
        if self.in_flight:
            self._resolved(self.in_flight[0])
        super()._check_room(more)

    def close(self) -> None:
        """Ends the episode thread (after the episodes it runs)."""
        if self.episode_thread is not None:
            self.episode_thread.shutdown(wait=True)

    def _in_flight_entry(self, started: StartedEpisodes, record: InFlightRecord) -> dict:
        """`Rollouts._in_flight_entry` (waits for the batch), with its episodes' host arrays."""
        started = self._resolved(started)
        entry = super()._in_flight_entry(started, record)
        fields = {f.name: getattr(started.episodes, f.name) for f in dataclasses.fields(episodes_lib.MultiTurnOutput)}
        entry["episodes"] = record.refer({k: v for k, v in fields.items() if v is not None})
        return entry

    def _restored(self, r: dict, arrays: dict[str, np.ndarray]) -> StartedEpisodes:
        """`Rollouts._restored`, the sample with its episodes again."""
        if "episode_run" in r:  # saved between two segments of turns (rl/partial_episodes.py)
            raise ConfigError("the checkpoint holds multi-turn rollouts in flight between two segments of turns: "
                              "resume with rollout.partial_rollouts=True")
        return with_episodes(super()._restored(r, arrays),
                             episodes_lib.MultiTurnOutput(**resolve_arrays(r["episodes"], arrays)))

    def finish(self, started: StartedEpisodes) -> Rollout:
        """`Rollouts.finish` (reward functions on the whole transcript), plus the action mask and the
        turn rewards on the trainer's mesh."""
        rollout = super().finish(self._resolved(started))
        out = started.episodes
        self.finished = out
        mesh = self.meshes.trainer
        extra = sharding.put_batch({"action_mask": out.action_mask.astype(np.int32),
                                    "turn_rewards": out.turn_rewards.astype(np.float32),
                                    "turn_ends": out.turn_ends.astype(np.int32)}, mesh)
        return rollout.replace(**extra)

    def next(self, state: PPOState) -> tuple[Rollout, sampling.SampleOutput]:
        """`Rollouts.next`; the episodes' host metrics are kept for this iteration's log."""
        rollout, sample = super().next(state)
        self.episode_metrics = episodes_lib.rollout_metrics(self.finished)
        return rollout, sample

    def pop_generate_metrics(self) -> dict[str, float]:
        """The weight sync's metrics and the iteration's episodes' (turns, tool calls, errors,
        time-outs, tokens, `time/environment`: part of the generate phase's time). Off-policy the
        episodes ran on their thread, beside the trainer: their wait on the environments is
        `perf/environment_seconds_overlapped`, not a part of this iteration's phases."""
        metrics, self.episode_metrics = {**super().pop_generate_metrics(), **self.episode_metrics}, {}
        if self.episode_thread is not None:
            metrics["perf/environment_seconds_overlapped"] = metrics.pop("time/environment")
        return metrics
