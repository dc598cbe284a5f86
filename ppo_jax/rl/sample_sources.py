"""One-turn rollout sources: a whole sample per batch (`WholeSamples`), or one decoded in segments
(`SegmentedSamples`, rollout.partial_rollouts on the continuous engine).

Partial rollouts: a batch in flight is decoded in segments (`sampling/segments.py`), one per
iteration, each under the weights synced that iteration, so the weights change between two decode
steps of a rollout in flight; each token records the version that chose it
(`Rollout.token_policy_version`). A segment is `segment_budget` decode steps: a batch whose rows all
run to rollout.response_length takes k + 1, one per iteration in flight. The engine states in flight
are saved in checkpoints (every array of each, KV caches included) and resumed bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ppo_jax import sampling, sharding
from ppo_jax.checkpoint import trees
from ppo_jax.config import ConfigError
from ppo_jax.rl import roles
from ppo_jax.rl.rollout_source import (InFlightRecord, LargeStateWarning, Sampled, SamplerScorer, resolve_arrays,
                                       restore_sampled, scored)
from ppo_jax.sampling import segments


class WholeSamples:
    """Each batch sampled whole when it begins (dispatched: the sampler's devices work while the
    trainer does)."""

    beside_update = False

    def __init__(self, sampler: sampling.Sampler, scorer: SamplerScorer | None):
        self.sampler, self.scorer = sampler, scorer

    def begin(self, weights: roles.SyncedWeights, prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
              key: jax.Array, version: int) -> Sampled:
        """Dispatches the sampling (and the scoring) of this process's prompt rows (host arrays)."""
        mesh = self.sampler.mesh
        toks, mask = sharding.put_local_batch((prompt_tokens, prompt_mask), mesh)
        out = self.sampler(weights.params, toks, mask, sharding.replicate(key, mesh), adapters=weights.adapters)
        return scored(out, version, self.scorer)

    def restore(self, entry: dict, arrays: dict[str, np.ndarray]) -> Sampled:
        if "segment" in entry:
            raise ConfigError("the checkpoint holds partial rollouts in flight (mid-decode): resume with "
                              "rollout.partial_rollouts=True")
        return restore_sampled(entry, arrays, self.sampler.mesh, self.scorer)

    def metrics(self, sampled: Sampled) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Nothing runs beside the trainer: the sampler's work is all dispatched."""


class SegmentedSamples:
    """Each batch decoded in segments of `budget` decode steps, one per iteration (module docstring)."""

    beside_update = False

    def __init__(self, sampler: sampling.Sampler, scorer: SamplerScorer | None, budget: int):
        self.segmented = segments.SegmentedSampler(sampler)
        self.scorer, self.budget = scorer, budget
        self.warn_size = LargeStateWarning()

    @property
    def mesh(self):
        return self.segmented.mesh

    def begin(self, weights: roles.SyncedWeights, prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
              key: jax.Array, version: int) -> SegmentBatch:
        """Dispatches the first segment of a batch."""
        toks, mask = sharding.put_local_batch((prompt_tokens, prompt_mask), self.mesh)
        segment = self.segmented.begin(weights.params, toks, mask, sharding.replicate(key, self.mesh), version,
                                       self.budget, adapters=weights.adapters)
        return SegmentBatch(self, version, segment)

    def restore(self, entry: dict, arrays: dict[str, np.ndarray]) -> SegmentBatch | SavedSegment | Sampled:
        """A batch saved mid-decode (rebuilt by its next segment), or whole (a run without partial
        rollouts saved it)."""
        if "segment" in entry:
            return SavedSegment(self, int(entry["version"]), resolve_arrays(entry["segment"], arrays))
        return restore_sampled(entry, arrays, self.mesh, self.scorer)

    def rebuilt(self, saved: SavedSegment, weights: roles.SyncedWeights) -> SegmentBatch:
        """A segment saved as host arrays by tree path, back on the sampler's mesh (replicated; the
        engine's own constraints split its rows again in the next segment)."""
        tokens = jax.ShapeDtypeStruct(saved.arrays[".prompt_tokens"].shape, np.int32)
        key = sharding.replicate(jax.random.key(0), self.mesh)  # a shape only
        abstract = self.segmented.abstract_segment(weights.params, tokens, tokens, key, adapters=weights.adapters)
        segment = trees.tree_from_host_arrays(saved.arrays, abstract, lambda a: sharding.replicate(a, self.mesh),
                                              what="the checkpoint's partial rollout in flight")
        return SegmentBatch(self, saved.version, segment)

    def metrics(self, sampled: Sampled) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Nothing runs beside the trainer: the sampler's work is all dispatched."""


@dataclasses.dataclass
class SegmentBatch:
    """A partial rollout between two segments: the engine state (`segments.Segment`, on the sampler's
    mesh)."""

    source: SegmentedSamples
    version: int
    segment: segments.Segment
    held_what = "its engine state and KV cache"
    room_hint = " or fewer rollout.slots"
    decodes_more = True

    def advance(self, weights: roles.SyncedWeights, iteration: int) -> SegmentBatch:
        segment = self.source.segmented.advance(weights.params, self.segment, iteration, self.source.budget,
                                                adapters=weights.adapters)
        return dataclasses.replace(self, segment=segment)

    def complete(self, weights: roles.SyncedWeights, iteration: int) -> Sampled:
        out = self.source.segmented.finish(weights.params, self.segment, iteration, adapters=weights.adapters)
        return scored(out, self.version, self.source.scorer)

    def held(self) -> Any:
        return self.segment

    def save(self, record: InFlightRecord) -> dict:
        """The engine state as host arrays by tree path (waits for it; its size said once past 256 MiB)."""
        return {"segment": record.refer(self.source.warn_size(trees.host_arrays_by_path(self.segment)))}


@dataclasses.dataclass
class SavedSegment:
    """A partial rollout just restored from a checkpoint: its arrays by tree path, on the host until
    its next segment rebuilds it on the sampler's mesh."""

    source: SegmentedSamples
    version: int
    arrays: dict[str, np.ndarray]
    held_what = SegmentBatch.held_what
    room_hint = SegmentBatch.room_hint
    decodes_more = True

    def advance(self, weights: roles.SyncedWeights, iteration: int) -> SegmentBatch:
        return self.source.rebuilt(self, weights).advance(weights, iteration)

    def complete(self, weights: roles.SyncedWeights, iteration: int) -> Sampled:
        return self.source.rebuilt(self, weights).complete(weights, iteration)

    def held(self) -> Any:
        return ()  # nothing on the devices yet

    def save(self, record: InFlightRecord) -> dict:
        return {"segment": record.refer(self.arrays)}
