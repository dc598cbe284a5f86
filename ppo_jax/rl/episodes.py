"""Multi-turn rollouts in a PPO run (`environment.name` set, issue 45): `WholeEpisodes` is the
rollout source whose batches are episodes (`agentic/rollout.py` over `sampling/turns.py`): an
environment per row answers the policy between its turns, its observations are appended to the row as
context. `EpisodeRunner` is what it shares with the segmented source (`rl/partial_episodes.py`).

What the rest of the run sees: the same `Rollout`, plus its `turns` (`EpisodeTurns`: `action_mask`
[B, Lr], the policy's tokens, while the forwards read `mask`, observations included; `rewards` and
`ends` [B, M], each turn's environment reward and its last action column). The reward functions and the reward model score the
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
import numpy as np

from ppo_jax import metrics as metrics_lib
from ppo_jax import sampling, sharding
from ppo_jax.agentic import continuous_rollout, rollout as episodes_lib, slot_rollout
from ppo_jax.config import ConfigError
from ppo_jax.data.tokenization import PromptTokenizer
from ppo_jax.models.transformer import CausalLM
from ppo_jax.rl import roles
from ppo_jax.rl.environment_settings import EnvironmentSettings
from ppo_jax.rl.rollout_source import Sampled, SamplerScorer, restore_sampled, scored
from ppo_jax.rl.settings import RolloutSettings
from ppo_jax.sampling.config import SamplingConfig
from ppo_jax.sampling.turn_slots import SlotDecoder
from ppo_jax.sampling.turns import TurnConfig, TurnDecoder


@dataclasses.dataclass(frozen=True)
class EpisodeModel:
    """What episodes need of the policy beside its weights: its module, tokenizer, the turn-stop
    markers' ids (checked against the tokenizer before anything compiled:
    `EnvironmentSettings.turn_stops`) and the prompt length."""

    model: CausalLM
    tokenizer: Any
    turn_stops: tuple[tuple[int, ...], ...]
    prompt_length: int


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


def _schedule(r: RolloutSettings, env: EnvironmentSettings, model: CausalLM, config: TurnConfig, mesh):
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


class EpisodeRunner:
    """Episodes of prompt rows: their environments (`factory`, reset per row), decoder and schedule
    on the sampler's mesh, the scorer there, and the episode thread, which runs them beside the
    update (off-policy, one process; None otherwise: the episodes' collectives (gathers, sharded
    programs) would race the trainer's, in an order that could differ between processes)."""

    def __init__(self, rollout: RolloutSettings, env: EnvironmentSettings, sampling_config: SamplingConfig,
                 policy: EpisodeModel, mesh, scorer: SamplerScorer | None):
        self.rollout, self.env, self.mesh, self.scorer = rollout, env, mesh, scorer
        self.tokenizer, self.prompt_length = policy.tokenizer, policy.prompt_length
        self.factory = env.bind(policy.tokenizer)
        # One row per episode: with rollout.num_samples = n each prompt is reset n times (`records`).
        one_row = dataclasses.replace(sampling_config, num_samples=1, engine="static", slots=0, prefill_prompts=0)
        config = TurnConfig(sampling=one_row, turn_stops=policy.turn_stops,
                            max_observation_tokens=env.max_observation_tokens)
        self.schedule, self.decoder = _schedule(rollout, env, policy.model, config, mesh)
        self.prompt_tokenizer = PromptTokenizer(policy.tokenizer, max_prompt_length=policy.prompt_length,
                                                truncation="left")
        self.thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="episodes") \
            if rollout.off_policy_steps and jax.process_count() == 1 else None

    def records(self, prompt_tokens: np.ndarray, prompt_mask: np.ndarray) -> list[dict[str, str]]:
        """One record per episode: each prompt row's n = rollout.num_samples times, row r from prompt
        r // n (the one-turn sampler's layout, which GRPO's and RLOO's groups read), each row then
        reset in an environment of its own and drawing its own tokens."""
        decode, n = self.tokenizer.decode, self.rollout.num_samples
        return [{"prompt": decode([int(t) for t, m in zip(row, rm) if m], skip_special_tokens=True)}
                for row, rm in zip(prompt_tokens, prompt_mask) for _ in range(n)]

    def inputs(self, records: list[dict[str, str]]) -> tuple[list, jax.Array, jax.Array]:
        """A fresh environment per record, reset, and the prompts they return tokenised [R, Lq] on the
        sampler's mesh."""
        envs, texts = episodes_lib.reset_episodes(self.factory, records)
        before = self.prompt_tokenizer.num_truncated_prompts
        batch = self.prompt_tokenizer.prompts(texts, length=self.prompt_length)
        if self.prompt_tokenizer.num_truncated_prompts > before and not before:  # said once a run
            metrics_lib.warn(f"the environment's prompts are longer than data.prompt_length={self.prompt_length} "
                             "tokens: cut from the left (raise data.prompt_length)")
        tokens, mask = sharding.put_local_batch((np.asarray(batch.tokens), np.asarray(batch.mask)), self.mesh)
        return envs, tokens, mask

    def run(self, weights: roles.SyncedWeights, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, key,
            version: int) -> Sampled:
        """The episodes of the prompt rows to their end, sampled with `weights` (of train step
        `version`), scored."""
        envs, tokens, mask = self.inputs(self.records(prompt_tokens, prompt_mask))
        out = self.schedule(self.decoder, weights.params, tokens, mask, envs, sharding.replicate(key, self.mesh),
                            tokenizer=self.tokenizer, max_turns=self.env.max_turns,
                            environment_workers=self.env.workers, adapters=weights.adapters)
        return self.scored(out, version)

    def scored(self, out: episodes_lib.MultiTurnOutput, version: int) -> Sampled:
        """Finished episodes (scored on the sampler's mesh with roles.scoring="sampler")."""
        return scored(sample_output(out, self.mesh), version, self.scorer, episodes=out)

    def metrics(self, sampled: Sampled) -> dict[str, float]:
        """The episodes' host metrics (turns, tool calls, errors, time-outs, tokens,
        `time/environment`: part of the generate phase's time). Beside the update their wait on the
        environments is `perf/environment_seconds_overlapped`, not a part of the iteration's phases."""
        metrics = episodes_lib.rollout_metrics(sampled.episodes)
        if self.thread is not None:
            metrics["perf/environment_seconds_overlapped"] = metrics.pop("time/environment")
        return metrics

    def close(self) -> None:
        """Ends the episode thread (after the episodes it runs)."""
        if self.thread is not None:
            self.thread.shutdown(wait=True)


@dataclasses.dataclass
class EpisodeFuture:
    """A batch of episodes running on the episode thread; `result()` waits for it (an error there is
    raised here)."""

    version: int
    future: concurrent.futures.Future
    held_what = Sampled.held_what
    room_hint = Sampled.room_hint
    decodes_more = False  # its episodes run to the end on the episode thread

    def advance(self, weights: roles.SyncedWeights, iteration: int) -> EpisodeFuture:
        return self

    def complete(self, weights: roles.SyncedWeights, iteration: int) -> EpisodeFuture:
        return self

    def result(self) -> Sampled:
        return self.future.result()

    def held(self) -> Any:
        return self.result().held()

    def save(self, record) -> dict:
        return self.result().save(record)


class WholeEpisodes:
    """Each batch's episodes run to their end when it begins: on-policy this waits (the host steps the
    environments between turns); off-policy they run on the episode thread, overlapping the update."""

    def __init__(self, runner: EpisodeRunner):
        self.runner = runner
        self.beside_update = runner.thread is not None

    def begin(self, weights: roles.SyncedWeights, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, key,
              version: int) -> Sampled | EpisodeFuture:
        if self.runner.thread is None:
            return self.runner.run(weights, prompt_tokens, prompt_mask, key, version)
        return EpisodeFuture(version, self.runner.thread.submit(self.runner.run, weights, prompt_tokens,
                                                                prompt_mask, key, version))

    def restore(self, entry: dict, arrays: dict[str, np.ndarray]) -> Sampled:
        """A whole batch of episodes: its sample and every `MultiTurnOutput` array."""
        if "episode_run" in entry:  # saved between two segments of turns (rl/partial_episodes.py)
            raise ConfigError("the checkpoint holds multi-turn rollouts in flight between two segments of turns: "
                              "resume with rollout.partial_rollouts=True")
        return restore_sampled(entry, arrays, self.runner.mesh, self.runner.scorer)

    def metrics(self, sampled: Sampled) -> dict[str, float]:
        return self.runner.metrics(sampled)

    def close(self) -> None:
        self.runner.close()
