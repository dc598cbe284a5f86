"""Partial multi-turn rollouts (`rollout.partial_rollouts` with `environment.name`, the continuous
schedule): `PartialEpisodeRollouts` decodes each batch of episodes in flight in segments of turns,
one per iteration, each under the weights synced that iteration.

    sync θ_i;  finish batch i (θ_i);  a segment of batches i+1 .. i+k-1 (θ_i);  begin batch i+k (θ_i)
    -> host rewards of batch i;  experience i;  update i   (meanwhile the episode thread runs the rest)

A batch begun at iteration b runs turns [s q, (s + 1) q) in its segment s (iteration b + s), q =
ceil(max_turns / (k + 1)), and the rest when it is finished: a turn's weights follow from its index
(`continuous_rollout.run_turns` parks a row whose next turn crosses the limit, its observation appended
by the next segment's weights, which choose that turn). So the same seed learns from the same
episodes however fast the environments answer. Each action token records its turn's version
(`Rollout.token_policy_version`): the policy lag is per token, and its behaviour log-prob is that of
the weights that chose it.

Why turns and not decode steps. A one-turn partial rollout syncs every `segment_steps` decode steps; an
episode's decode steps are interleaved with its environment's answers, which arrive when they arrive,
so a sync by decode steps would land at timing-dependent points of an episode. A turn boundary is a
point of the episode itself.

The segments of every batch run on the episode thread in the order they are dispatched (the finishing
one first: the trainer waits for it), so they overlap the update. A checkpoint waits for them and saves
each batch between two segments whole (`agentic/saved_runs.py`); on resume its environments are reset
and replayed through the turns they were given.

One process only (refused at build): the episode thread and the environments' replay are this
process's. The slot schedule (`rollout.slots` below the episodes) is refused when the config is read.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ppo_jax import sampling, sharding
from ppo_jax.agentic import continuous_rollout, rollout as episodes_lib, saved_runs
from ppo_jax.config import ConfigError
from ppo_jax.rl import roles
from ppo_jax.rl.episodes import EpisodeRollouts, StartedEpisodes, not_donated
from ppo_jax.rl.rollouts import InFlightRecord, resolve_arrays
from ppo_jax.rl.state import PPOState, Rollout


def check_one_process() -> None:
    """Partial multi-turn rollouts run on one process (one line, at build)."""
    if jax.process_count() > 1:
        raise ConfigError(f"rollout.partial_rollouts with environment.name runs on one process, and this run has "
                          f"{jax.process_count()}: set rollout.partial_rollouts=False (the episodes then run whole, "
                          "each batch with the weights of its version)")


class PartialEpisodeRollouts(EpisodeRollouts):
    """`EpisodeRollouts` whose batches in flight advance a segment of turns per iteration (see the
    module docstring)."""

    def __init__(self, *args, **kwargs):
        check_one_process()
        super().__init__(*args, **kwargs)
        k, turns = self.settings.rollout.off_policy_steps, self.env_settings.max_turns
        self.turns_per_segment = math.ceil(turns / (k + 1))

    def _next_partial(self, state: PPOState, last: int) -> tuple[Rollout, sampling.SampleOutput]:
        """The oldest batch finished under the current weights (queued first: the trainer waits for
        it), every other one a segment of turns further, then the batches up to `last` begun."""
        iteration = int(state.step)
        weights = not_donated(self.sampler_weights(state), state)  # the update donates the state's own
        if not self.in_flight:  # a run's first iteration: batch `iteration` begins now
            self.in_flight.append(self._then(self._begin, None, weights, iteration, *self.prompts.next_batch(),
                                             self.iteration_key(iteration)))
            self._check_room(more=last - iteration)
        current = self.in_flight.popleft()
        if current.sample is None:
            current = self._then(self._finish, current, weights, iteration)
        self.in_flight = collections.deque(
            started if started.sample is not None else self._then(self._advance, started, weights, iteration)
            for started in self.in_flight)  # a sample restored from a run without partial rollouts is whole
        while iteration + 1 + len(self.in_flight) <= last:
            batch = iteration + 1 + len(self.in_flight)
            self.in_flight.append(self._then(self._begin, None, weights, iteration, *self.prompts.next_batch(),
                                             self.iteration_key(batch)))
        return self.finish(current), current.sample

    def _then(self, job: Callable[..., StartedEpisodes], after: StartedEpisodes | None, weights: roles.SyncedWeights,
              version: int, *args) -> StartedEpisodes:
        """`job(batch, weights, version, *args)` queued on the episode thread behind the last job of
        `after` (batch: `after` as that job left it; None for a new batch); a placeholder now."""
        previous = None if after is None else after.pending  # taken now: `_resolved` may clear it meanwhile

        def run() -> StartedEpisodes:
            batch = after if previous is None else previous.result()
            return job(batch, weights, version, *args)

        return StartedEpisodes(sample=None, version=version if after is None else after.version,
                               pending=self.episode_thread.submit(run))

    def _begin(self, _, weights: roles.SyncedWeights, version: int, prompt_tokens: np.ndarray,
               prompt_mask: np.ndarray, key) -> StartedEpisodes:
        """A new batch: its environments reset, its prompts prefilled, its first segment of turns."""
        records = self._records(prompt_tokens, prompt_mask)
        envs, tokens, mask = self._episode_inputs(records)
        run = continuous_rollout.begin(self.decoder, weights.params, tokens, mask, envs,
                                       sharding.replicate(key, self.meshes.sampler), tokenizer=self.tokenizer,
                                       max_turns=self.env_settings.max_turns, version=version,
                                       adapters=weights.adapters)
        return self._advance(StartedEpisodes(sample=None, version=version, run=run, records=records), weights, version)

    def _advance(self, batch: StartedEpisodes, weights: roles.SyncedWeights, version: int) -> StartedEpisodes:
        """`batch`'s next segment of turns under `weights` (of train step `version`)."""
        limit = min(self.env_settings.max_turns, (batch.segments_run + 1) * self.turns_per_segment)
        batch.run = self._run_turns(batch, weights, version, limit)
        batch.segments_run += 1
        return batch

    def _finish(self, batch: StartedEpisodes, weights: roles.SyncedWeights, version: int) -> StartedEpisodes:
        """`batch`'s remaining turns under `weights`, its episodes scored."""
        run = self._run_turns(batch, weights, version, None)
        return self._scored_episodes(continuous_rollout.output(run), batch.version)

    def _run_turns(self, batch: StartedEpisodes, weights: roles.SyncedWeights, version: int,
                   limit: int | None) -> continuous_rollout.EpisodeRun:
        run = self._rebuilt(batch, weights) if isinstance(batch.run, dict) else batch.run
        return continuous_rollout.run_turns(self.decoder, weights.params, run, tokenizer=self.tokenizer,
                                            version=version, turn_limit=limit,
                                            environment_workers=self.env_settings.workers, adapters=weights.adapters,
                                            segment_steps=self.env_settings.segment_steps)

    def _rebuilt(self, batch: StartedEpisodes, weights: roles.SyncedWeights) -> continuous_rollout.EpisodeRun:
        """A batch restored from a checkpoint: its decoder state on the sampler's mesh, its environments
        reset and replayed through the turns they were given."""
        arrays, mesh = batch.run, self.meshes.sampler
        envs, _ = episodes_lib.reset_episodes(self.factory, batch.records)
        tokens = sharding.replicate(arrays["prompt_tokens"], mesh)
        mine, decode_turn = episodes_lib.checked_episodes(self.decoder, tokens, envs, self.tokenizer,
                                                          self.env_settings.max_turns, None)
        abstract = self.decoder.abstract_state(weights.params, tokens, tokens, sharding.replicate(self.iteration_key(0),
                                                                                                 mesh), weights.adapters)
        return saved_runs.rebuild_run(arrays, abstract, mesh, environments=mine, decode_turn=decode_turn,
                                      tokenizer=self.tokenizer,
                                      response_length=self.decoder.config.sampling.max_new_tokens,
                                      workers=self.env_settings.workers)

    @staticmethod
    def _held_on_sampler(started: StartedEpisodes) -> Any:
        """A batch between two segments holds its decoder state (KV cache included)."""
        run = started.run
        return EpisodeRollouts._held_on_sampler(started), \
            run.state if isinstance(run, continuous_rollout.EpisodeRun) else None

    def _in_flight_entry(self, started: StartedEpisodes, record: InFlightRecord) -> dict:
        """A batch between two segments: its run's arrays, segments and records (waits for it)."""
        started = self._resolved(started)
        if started.sample is not None:
            return super()._in_flight_entry(started, record)
        run = started.run
        arrays = run if isinstance(run, dict) else self._saved_whole(saved_runs.run_arrays(run))
        return {"episode_run": record.refer(arrays), "segments_run": started.segments_run,
                "records": started.records}

    def _restored(self, r: dict, arrays: dict[str, np.ndarray]) -> StartedEpisodes:
        """A batch saved between two segments, rebuilt by its next segment (on the episode thread)."""
        if "episode_run" not in r:
            return super()._restored(r, arrays)
        return StartedEpisodes(sample=None, version=int(r["version"]), run=resolve_arrays(r["episode_run"], arrays),
                               segments_run=int(r["segments_run"]), records=list(r["records"]))
