"""A PPO run's rollouts: the sampler's side of the run, composed of parts chosen once from the
settings (`make_rollouts`):

- `WeightSync` (`rl/weight_sync.py`): the policy on the sampler's mesh, once per train step;
- a `SamplerScorer` (`rl/rollout_source.py`) with roles.scoring="sampler": the reference and reward
  model there, scoring each sample as soon as it is sampled;
- the training `RolloutSource` (`rl/rollout_source.py` lists the four kinds: whole or segmented
  samples, whole or segmented episodes) and its `InFlightPipeline` (`rl/in_flight.py`: the k-step
  off-policy queue, version stamps, the memory admission check, the checkpoint record);
- the evaluation source: a whole rollout of the current weights, of the training source's kind,
  whatever the training source is;
- with dynamic_sampling.enabled, `DynamicSampling` (`rl/dynamic_sampling.py`): DAPO's refill of the
  groups whose rewards are all equal;
- the hand-over (`finish`): the Python reward functions on the host and the move to the trainer's mesh.

`Rollouts` reads the trainer's state only as the argument of each call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ppo_jax import reward_functions, sampling, sharding
from ppo_jax.data.prompt_stream import PromptStream
from ppo_jax.models import LoraConfig
from ppo_jax.rl import roles
from ppo_jax.rl.build import Steps
from ppo_jax.rl.dynamic_sampling import DynamicSampling
from ppo_jax.rl.episodes import EpisodeModel, EpisodeRunner, WholeEpisodes
from ppo_jax.rl.in_flight import InFlightPipeline
from ppo_jax.rl.partial_episodes import SegmentedEpisodes
from ppo_jax.rl.rollout_source import InFlightRecord, RolloutSource, Sampled, SamplerScorer
from ppo_jax.rl.sample_sources import SegmentedSamples, WholeSamples
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.state import EpisodeTurns, FrozenParams, PPOState, Rollout
from ppo_jax.rl.weight_sync import WeightSync, not_donated
from ppo_jax.sampling import segments

IN_FLIGHT_ITEM = "in_flight_rollout"


@dataclasses.dataclass(frozen=True)
class Texts:
    """Token ids -> texts, for the Python reward functions and the sample logs."""

    tokenizer: Any
    stop_ids: tuple[int, ...]

    def decode(self, prompt_tokens, prompt_mask, tokens, mask) -> tuple[list[str], list[str]]:
        """Host arrays [B, Lq], [B, Lr] -> prompt and response texts (stop tokens and padding dropped)."""
        stop = set(self.stop_ids)
        prompts = [self.tokenizer.decode([int(t) for t, m in zip(row, rm) if m], skip_special_tokens=True)
                   for row, rm in zip(prompt_tokens, prompt_mask)]
        responses = [self.tokenizer.decode([int(t) for t, m in zip(row, rm) if m and int(t) not in stop],
                                           skip_special_tokens=True)
                     for row, rm in zip(tokens, mask)]
        return prompts, responses


class Rollouts:
    """The sampler's side of a PPO run (see the module docstring for its parts)."""

    def __init__(self, *, meshes: roles.RoleMeshes, sampler: sampling.Sampler, sync: WeightSync,
                 scorer: SamplerScorer | None, training: RolloutSource, evaluation: RolloutSource,
                 pipeline: InFlightPipeline, texts: Texts, reward_functions: Sequence[tuple[Callable, float]],
                 dynamic: DynamicSampling | None = None):
        self.meshes, self.sampler, self.sync, self.sampler_scorer = meshes, sampler, sync, scorer
        self.training, self.evaluation, self.pipeline, self.dynamic = training, evaluation, pipeline, dynamic
        self.texts, self.reward_functions = texts, reward_functions
        self.iteration_metrics: dict[str, float] = {}  # the training batch's (episodes), until popped

    @property
    def scorer(self) -> FrozenParams | None:
        """roles.scoring="sampler": the reference and reward model on the sampler's mesh."""
        return None if self.sampler_scorer is None else self.sampler_scorer.frozen

    @property
    def in_flight(self):
        """The batches in flight, oldest first."""
        return self.pipeline.queue

    def sampler_weights(self, state: PPOState) -> roles.SyncedWeights:
        return self.sync.weights(state)

    def sample(self, state: PPOState, prompt_tokens, prompt_mask, key) -> sampling.SampleOutput:
        """Responses of `state`'s policy to prompts [B, Lq] batch-sharded on the sampler's mesh."""
        weights = self.sync.weights(state)
        return self.sampler(weights.params, prompt_tokens, prompt_mask, key, adapters=weights.adapters)

    def whole(self, state: PPOState, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, key) -> Sampled:
        """A whole rollout of `state`'s weights on this process's prompt rows (host arrays), waited
        for: the evaluation source's, whatever the training source is."""
        weights, version = self.sync.weights(state), int(state.step)
        return self.evaluation.begin(weights, prompt_tokens, prompt_mask, key, version).complete(
            weights, version).result()

    def rollout(self, state: PPOState, prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
                key) -> tuple[Rollout, sampling.SampleOutput]:
        """Samples responses with `state`'s policy and scores them with the Python reward functions."""
        sampled = self.whole(state, prompt_tokens, prompt_mask, key)
        return self.finish(sampled), sampled.sample

    def iteration_key(self, iteration: int):
        return self.pipeline.key(iteration)

    def next(self, state: PPOState) -> tuple[Rollout, sampling.SampleOutput]:
        """The rollout of iteration `state.step` from the training source's pipeline (`rl/in_flight.py`)."""
        step = int(state.step)
        # Synced on first use only: a run's last whole-sample iterations decode nothing, so copy nothing.
        weights = functools.cache(lambda: self._sampling_weights(state))
        sampled = self.pipeline.next(weights() if self.pipeline.decodes(step) else None, step)
        self.iteration_metrics = self.training.metrics(sampled)
        if self.dynamic is None:
            return self.finish(sampled), sampled.sample
        sampled, host_scores, metrics = self.dynamic.refill(sampled, self.host_scores(sampled), weights, step,
                                                            self.host_scores)
        self.iteration_metrics.update(metrics)
        return self.finish(sampled, host_scores), sampled.sample

    def _sampling_weights(self, state: PPOState) -> roles.SyncedWeights:
        """`state`'s policy on the sampler's mesh, for the training source."""
        weights = self.sync.weights(state)
        if self.training.beside_update:  # the update donates the state's own arrays while this decodes
            weights = not_donated(weights, state)
        return weights

    def host_scores(self, sampled: Sampled) -> np.ndarray:
        """[R] the Python reward functions' weighted sum over a sample's texts (on the host; this
        waits for it); 0 without any."""
        out = sampled.sample
        if not self.reward_functions:
            return np.zeros(out.tokens.shape[0], np.float32)
        host = sharding.to_host({"pt": out.prompt_tokens, "pm": out.prompt_mask, "t": out.tokens, "m": out.mask})
        prompts_text, responses_text = self.texts.decode(host["pt"], host["pm"], host["t"], host["m"])
        host_scores = reward_functions.combined_scores(self.reward_functions, prompts_text, responses_text)
        reward_functions.warn_once_if_meaningless(host_scores, run=self)
        return host_scores

    def finish(self, sampled: Sampled, host_scores: np.ndarray | None = None) -> Rollout:
        """A sample scored by the Python reward functions (`host_scores`, unless given) and moved to
        the trainer's mesh."""
        out = sampled.sample
        host_scores = self.host_scores(sampled) if host_scores is None else host_scores
        fields = dict(prompt_tokens=out.prompt_tokens, prompt_mask=out.prompt_mask, tokens=out.tokens,
                      mask=out.mask, sampler_logprobs=out.logprobs, behaviour_logprobs=out.sampling_logprobs,
                      stopped=out.stopped, routed_experts=out.routed_experts,
                      token_policy_version=out.token_policy_version, frozen_outputs=sampled.frozen_outputs)
        trainer_mesh = self.meshes.trainer
        data = sharding.data_sharding(trainer_mesh)  # a no-op when the sampler shares the trainer's mesh
        fields = sharding.reshard(fields, jax.tree.map(lambda _: data, fields))
        episodes = sampled.episodes
        turns = None if episodes is None else EpisodeTurns(**sharding.put_batch(
            {"action_mask": episodes.action_mask.astype(np.int32), "rewards": episodes.turn_rewards.astype(np.float32),
             "ends": episodes.turn_ends.astype(np.int32)}, trainer_mesh))
        # The version that began each row's batch (partial rollouts: its oldest tokens'; each token's is
        # above; dynamic sampling's extra rows: the iteration's).
        version = np.full(host_scores.shape, sampled.version, np.int32)
        return Rollout(**fields, turns=turns, host_scores=sharding.put_batch(host_scores, trainer_mesh),
                       policy_version=sharding.put_batch(version, trainer_mesh))

    def pop_generate_metrics(self) -> dict[str, float]:
        """What ran inside the generate phase since the last call, apart from sampling: the weight
        syncs (`time/weight_sync`, `perf/weight_sync_bytes`) and the training source's own (episodes:
        turns, tool calls, `time/environment`, ...)."""
        metrics, self.iteration_metrics = {**self.sync.pop_metrics(), **self.iteration_metrics}, {}
        return metrics

    def in_flight_record(self) -> InFlightRecord:
        """The batches in flight, oldest first (waits for them), as a checkpoint keeps them."""
        return self.pipeline.record()

    def restore_in_flight(self, record: list[dict] | dict | None, step: int,
                          arrays: dict[str, np.ndarray] | None = None) -> None:
        """The batches a checkpoint of train step `step` saved in flight (`InFlightPipeline.restore`)."""
        self.pipeline.restore(record, step, arrays)

    def close(self) -> None:
        """Ends what runs beside the trainer (the episode thread, after its work)."""
        self.training.close()


def make_rollouts(settings: Settings, meshes: roles.RoleMeshes, steps: Steps, frozen: FrozenParams, *,
                  lora: LoraConfig | None, texts: Texts, reward_functions: Sequence[tuple[Callable, float]],
                  prompts: PromptStream, sample_key: jax.Array, episode_model: EpisodeModel | None) -> Rollouts:
    """The run's rollout parts, each kind picked here once. frozen: the run's frozen trees on the
    trainer's mesh (with roles.scoring="sampler" the reference and reward model are copied to the
    sampler's: the trainer then keeps neither); lora: the policy's adapters' config (None without
    LoRA); episode_model: the policy as episodes need it (environment.name; else None)."""
    r = settings.rollout
    sync = WeightSync(meshes.sampler, steps.sampler_shardings, lora, frozen.policy)
    scorer = None
    if settings.roles.scoring == "sampler":
        scorer = SamplerScorer(frozen, steps.scorer_shardings, steps.scoring_jit, meshes.sampler, sync.base)
    if episode_model is not None:  # multi-turn episodes (rl/episodes.py)
        runner = EpisodeRunner(r, settings.environment, steps.sampling_config, episode_model, meshes.sampler, scorer)
        evaluation = WholeEpisodes(runner)
        training = SegmentedEpisodes(runner, r.off_policy_steps) if r.partial_rollouts else evaluation
    else:
        evaluation = WholeSamples(steps.sampler, scorer)
        training = evaluation
        if r.partial_rollouts:  # a batch whose rows all run to the response length takes k + 1 segments
            budget = segments.segment_budget(r.batch_size * r.num_samples, steps.sampling_config,
                                             r.off_policy_steps + 1)
            training = SegmentedSamples(steps.sampler, scorer, budget)
    pipeline = InFlightPipeline(training, prompts, sample_key, r.off_policy_steps, settings.train.iterations,
                                list(meshes.sampler.devices.flat))
    dynamic = None
    if settings.dynamic_sampling.enabled:  # DAPO: the extra batches are whole samples of the current weights
        dynamic = DynamicSampling(settings.dynamic_sampling, r.num_samples, evaluation, prompts, sample_key,
                                  meshes.sampler, settings.reward.model_weight)
    return Rollouts(meshes=meshes, sampler=steps.sampler, sync=sync, scorer=scorer, training=training,
                    evaluation=evaluation, pipeline=pipeline, texts=texts, reward_functions=reward_functions,
                    dynamic=dynamic)
