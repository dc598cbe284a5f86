"""Partial multi-turn rollouts (`rollout.partial_rollouts` with `environment.name`, the continuous
schedule): `SegmentedEpisodes`, the rollout source whose batches of episodes are decoded in segments
of turns, one per iteration, each under the weights synced that iteration.

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

import concurrent.futures
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ppo_jax import sharding
from ppo_jax.agentic import continuous_rollout, rollout as episodes_lib, saved_runs
from ppo_jax.config import ConfigError
from ppo_jax.rl import roles
from ppo_jax.rl.episodes import EpisodeFuture, EpisodeRunner
from ppo_jax.rl.rollout_source import InFlightRecord, LargeStateWarning, Sampled, resolve_arrays, restore_sampled


def check_one_process() -> None:
    """Partial multi-turn rollouts run on one process (one line, at build)."""
    if jax.process_count() > 1:
        raise ConfigError(f"rollout.partial_rollouts with environment.name runs on one process, and this run has "
                          f"{jax.process_count()}: set rollout.partial_rollouts=False (the episodes then run whole, "
                          "each batch with the weights of its version)")


@dataclasses.dataclass
class LiveRun:
    """A batch between two segments of turns: its run (decoder state, KV cache, bookkeeping), the
    segments run so far and the rows' records (each environment's reset argument)."""

    run: continuous_rollout.EpisodeRun
    segments_run: int
    records: list[dict[str, str]]

    def live(self, source: SegmentedEpisodes, weights: roles.SyncedWeights) -> LiveRun:
        return self

    def held(self) -> Any:
        return self.run.state

    def arrays(self, source: SegmentedEpisodes) -> dict[str, np.ndarray]:
        return source.warn_size(saved_runs.run_arrays(self.run))


@dataclasses.dataclass
class SavedRun:
    """A batch between two segments just restored from a checkpoint: its run's arrays, until its
    next segment rebuilds it."""

    run_arrays: dict[str, np.ndarray]
    segments_run: int
    records: list[dict[str, str]]

    def live(self, source: SegmentedEpisodes, weights: roles.SyncedWeights) -> LiveRun:
        return LiveRun(source.rebuilt(self, weights), self.segments_run, self.records)

    def held(self) -> Any:
        return ()  # nothing on the devices yet

    def arrays(self, source: SegmentedEpisodes) -> dict[str, np.ndarray]:
        return self.run_arrays


class SegmentedEpisodes:
    """Batches of episodes advanced a segment of turns per iteration on the episode thread (module
    docstring)."""

    beside_update = True

    def __init__(self, runner: EpisodeRunner, off_policy_steps: int):
        check_one_process()
        self.runner = runner
        self.turns_per_segment = math.ceil(runner.env.max_turns / (off_policy_steps + 1))
        self.warn_size = LargeStateWarning()

    def begin(self, weights: roles.SyncedWeights, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, key,
              version: int) -> EpisodeSegments:
        """A new batch: its environments reset, its prompts prefilled, its first segment of turns (queued)."""
        return EpisodeSegments(self, version, self.runner.thread.submit(
            self._begin, weights, version, prompt_tokens, prompt_mask, key))

    def _begin(self, weights: roles.SyncedWeights, version: int, prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
               key) -> LiveRun:
        r = self.runner
        records = r.records(prompt_tokens, prompt_mask)
        envs, tokens, mask = r.inputs(records)
        run = continuous_rollout.begin(r.decoder, weights.params, tokens, mask, envs,
                                       sharding.replicate(key, r.mesh), tokenizer=r.tokenizer,
                                       max_turns=r.env.max_turns, version=version, adapters=weights.adapters)
        return self.advanced(LiveRun(run, 0, records), weights, version)

    def advanced(self, batch: LiveRun | SavedRun, weights: roles.SyncedWeights, version: int) -> LiveRun:
        """`batch`'s next segment of turns under `weights` (of train step `version`)."""
        limit = min(self.runner.env.max_turns, (batch.segments_run + 1) * self.turns_per_segment)
        live = batch.live(self, weights)
        return LiveRun(self._run_turns(live, weights, version, limit), live.segments_run + 1, live.records)

    def finished(self, batch: LiveRun | SavedRun, weights: roles.SyncedWeights, version: int,
                 begun: int) -> Sampled:
        """`batch`'s remaining turns under `weights`, its episodes scored (`begun`: its version)."""
        run = self._run_turns(batch.live(self, weights), weights, version, None)
        return self.runner.scored(continuous_rollout.output(run), begun)

    def _run_turns(self, batch: LiveRun, weights: roles.SyncedWeights, version: int,
                   limit: int | None) -> continuous_rollout.EpisodeRun:
        r = self.runner
        return continuous_rollout.run_turns(r.decoder, weights.params, batch.run, tokenizer=r.tokenizer,
                                            version=version, turn_limit=limit, environment_workers=r.env.workers,
                                            adapters=weights.adapters, segment_steps=r.env.segment_steps)

    def rebuilt(self, saved: SavedRun, weights: roles.SyncedWeights) -> continuous_rollout.EpisodeRun:
        """A batch restored from a checkpoint: its decoder state on the sampler's mesh, its environments
        reset and replayed through the turns they were given."""
        r, arrays = self.runner, saved.run_arrays
        envs, _ = episodes_lib.reset_episodes(r.factory, saved.records)
        tokens = sharding.replicate(arrays["prompt_tokens"], r.mesh)
        mine, decode_turn = episodes_lib.checked_episodes(r.decoder, tokens, envs, r.tokenizer, r.env.max_turns, None)
        key = sharding.replicate(jax.random.key(0), r.mesh)  # a shape only
        abstract = r.decoder.abstract_state(weights.params, tokens, tokens, key, weights.adapters)
        return saved_runs.rebuild_run(arrays, abstract, r.mesh, environments=mine, decode_turn=decode_turn,
                                      tokenizer=r.tokenizer, response_length=r.decoder.config.sampling.max_new_tokens,
                                      workers=r.env.workers)

    def restore(self, entry: dict, arrays: dict[str, np.ndarray]) -> EpisodeSegments | Sampled:
        """A batch saved between two segments (rebuilt by its next segment, on the episode thread), or
        whole (a run without partial rollouts saved it)."""
        if "episode_run" not in entry:
            return restore_sampled(entry, arrays, self.runner.mesh, self.runner.scorer)
        done = concurrent.futures.Future()
        done.set_result(SavedRun(resolve_arrays(entry["episode_run"], arrays), int(entry["segments_run"]),
                                 list(entry["records"])))
        return EpisodeSegments(self, int(entry["version"]), done)

    def metrics(self, sampled: Sampled) -> dict[str, float]:
        return self.runner.metrics(sampled)

    def close(self) -> None:
        self.runner.close()


@dataclasses.dataclass
class EpisodeSegments:
    """A batch of episodes between two segments of turns; `future` (on the episode thread) holds it as
    its last queued segment leaves it. Each step is queued behind that one."""

    source: SegmentedEpisodes
    version: int
    future: concurrent.futures.Future  # -> LiveRun | SavedRun
    held_what = "its engine state and KV cache"
    room_hint = ""
    decodes_more = True

    def _then(self, job: Callable[[LiveRun | SavedRun], Any]) -> concurrent.futures.Future:
        """`job(this batch as its last segment left it)`, queued on the episode thread."""
        previous = self.future
        return self.source.runner.thread.submit(lambda: job(previous.result()))

    def advance(self, weights: roles.SyncedWeights, iteration: int) -> EpisodeSegments:
        return dataclasses.replace(self, future=self._then(
            lambda batch: self.source.advanced(batch, weights, iteration)))

    def complete(self, weights: roles.SyncedWeights, iteration: int) -> EpisodeFuture:
        return EpisodeFuture(self.version, self._then(
            lambda batch: self.source.finished(batch, weights, iteration, self.version)))

    def held(self) -> Any:
        return self.future.result().held()

    def save(self, record: InFlightRecord) -> dict:
        """Its run's arrays, segments and records (waits for it)."""
        batch = self.future.result()
        return {"episode_run": record.refer(batch.arrays(self.source)), "segments_run": batch.segments_run,
                "records": batch.records}
