"""What a kind of rollout is, as the in-flight pipeline (`rl/in_flight.py`) sees it.

A `RolloutSource` begins a batch from the synced weights, this process's prompt rows, a key and the
version (train step) of the weights; it restores a batch a checkpoint saved. A `Batch` is what is in
flight between two iterations: it advances (a segment further under the current weights, or nothing
for a whole sample), completes (the rest dispatched under the current weights), saves its own
pending state into a checkpoint record, and says what it holds on the sampler's devices. A completed
batch's `result()` is a `Sampled`: the sample, its version, the frozen models' outputs where the
sampler's mesh scores, and for multi-turn sources the episodes.

The kinds (each picked once by `rl/rollouts.make_rollouts`):

| source | batch in flight | module |
|---|---|---|
| `WholeSamples` | `Sampled` | `rl/sample_sources.py` |
| `SegmentedSamples` (rollout.partial_rollouts) | `SegmentBatch` / `SavedSegment` | `rl/sample_sources.py` |
| `WholeEpisodes` (environment.name) | `Sampled` / `EpisodeFuture` | `rl/episodes.py` |
| `SegmentedEpisodes` (both) | `EpisodeSegments` | `rl/partial_episodes.py` |
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any, Protocol

import jax
import numpy as np

from ppo_jax import metrics as metrics_lib
from ppo_jax import sampling, sharding
from ppo_jax.agentic.rollout import MultiTurnOutput
from ppo_jax.rl import roles
from ppo_jax.rl.state import FrozenOutputs, FrozenParams


@dataclasses.dataclass
class InFlightRecord:
    """The batches in flight as a checkpoint holds them: `records` (JSON, oldest first: each its
    version and, per array, its name in `arrays`) and `arrays` (saved in Orbax's binary item, not as
    JSON)."""

    records: list[dict]
    arrays: dict[str, np.ndarray]

    def refer(self, arrays: dict[str, np.ndarray]) -> dict[str, dict]:
        """`arrays` added under names of their own; what a record keeps of them."""
        refs = {}
        for name, a in arrays.items():
            key = f"in_flight_{len(self.arrays)}"
            self.arrays[key] = a
            refs[name] = {"array": key}
        return refs


def resolve_arrays(record: dict[str, dict], arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A record's arrays: from the checkpoint's binary item, or (checkpoints before it) base64 JSON."""
    return {name: arrays[v["array"]] if "array" in v else
            np.frombuffer(base64.b64decode(v["data"]), dtype=np.dtype(v["dtype"])).reshape(v["shape"])
            for name, v in record.items()}


class SamplerScorer:
    """roles.scoring="sampler": the reference and reward model copied to the sampler's mesh (`frozen`),
    scoring each sample there as soon as it is sampled."""

    def __init__(self, frozen: FrozenParams, shardings: FrozenParams, scoring_jit, mesh, lora_base):
        """frozen: the run's frozen trees on the trainer's mesh; shardings: the scorer's on the
        sampler's (`roles.scorer_shardings`); lora_base: a LoRA policy's base already there."""
        self.mesh, self.scoring_jit = mesh, scoring_jit
        self.frozen = FrozenParams(
            reference=None if frozen.reference is None else sharding.reshard(frozen.reference, shardings.reference),
            reward=None if frozen.reward is None else sharding.reshard(frozen.reward, shardings.reward),
            policy=lora_base)

    def score(self, out: sampling.SampleOutput) -> FrozenOutputs:
        """The reference log-probs [B, Lr] and raw model scores [B] of a sample (dispatched, not waited for)."""
        with sharding.mesh_context(self.mesh):
            ref_logprobs, model_scores = self.scoring_jit(self.frozen, out.prompt_tokens, out.prompt_mask,
                                                          out.tokens, out.mask)
        return FrozenOutputs(ref_logprobs, model_scores)


@dataclasses.dataclass
class Sampled:
    """A batch whose sampling is over: its sample (on the sampler's mesh), the version of the weights
    that began it, the frozen models' outputs (roles.scoring="sampler"; else None) and, from a
    multi-turn source, its episodes (host arrays; else None). Complete as it is."""

    sample: sampling.SampleOutput
    version: int
    frozen_outputs: FrozenOutputs | None = None
    episodes: MultiTurnOutput | None = None
    held_what = "its sample and scores"
    room_hint = ""
    decodes_more = False

    def advance(self, weights: roles.SyncedWeights, iteration: int) -> Sampled:
        return self

    def complete(self, weights: roles.SyncedWeights, iteration: int) -> Sampled:
        return self

    def result(self) -> Sampled:
        return self

    def held(self) -> Any:
        return self.sample, self.frozen_outputs

    def save(self, record: InFlightRecord) -> dict:
        """Its arrays (the frozen models' outputs are recomputed on restore: the same program on the
        same inputs)."""
        out = self.sample
        host = sharding.to_host({f.name: getattr(out, f.name) for f in dataclasses.fields(out)
                                 if getattr(out, f.name) is not None})
        entry = {"sample": record.refer({k: np.asarray(v) for k, v in host.items()})}
        if self.episodes is not None:
            fields = {f.name: getattr(self.episodes, f.name) for f in dataclasses.fields(MultiTurnOutput)}
            entry["episodes"] = record.refer({k: v for k, v in fields.items() if v is not None})
        return entry


def scored(out: sampling.SampleOutput, version: int, scorer: SamplerScorer | None,
           episodes: MultiTurnOutput | None = None) -> Sampled:
    """A finished sample, scored on the sampler's mesh when a scorer is there."""
    return Sampled(out, version, None if scorer is None else scorer.score(out), episodes)


def restore_sampled(entry: dict, arrays: dict[str, np.ndarray], mesh, scorer: SamplerScorer | None) -> Sampled:
    """A whole sample as `Sampled.save` kept it, back on the sampler's mesh (and scored there)."""
    out = sampling.SampleOutput(**sharding.put_batch(resolve_arrays(entry["sample"], arrays), mesh))
    episodes = MultiTurnOutput(**resolve_arrays(entry["episodes"], arrays)) if "episodes" in entry else None
    return scored(out, int(entry["version"]), scorer, episodes)


class Completed(Protocol):
    """A batch whose remaining work is dispatched: `result()` waits for it."""

    def result(self) -> Sampled: ...


class Batch(Protocol):
    """A batch in flight (see the module docstring)."""

    version: int  # the train step of the weights that began it
    held_what: str  # what it holds on the sampler's devices, in words (for the memory admission check)
    room_hint: str  # what else lowers that, for the same message ("" or " or fewer ...")
    decodes_more: bool  # advance/complete decode under the weights they get (else they ignore them)

    def advance(self, weights: roles.SyncedWeights, iteration: int) -> Batch: ...

    def complete(self, weights: roles.SyncedWeights, iteration: int) -> Completed: ...

    def held(self) -> Any: ...

    def save(self, record: InFlightRecord) -> dict: ...


class RolloutSource(Protocol):
    """One kind of rollout (see the module docstring). `beside_update`: its work runs on a thread
    beside the update, so the weights it gets must not be the (donated) train state's own."""

    beside_update: bool

    def begin(self, weights: roles.SyncedWeights, prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
              key: jax.Array, version: int) -> Batch: ...

    def restore(self, entry: dict, arrays: dict[str, np.ndarray]) -> Batch: ...

    def metrics(self, sampled: Sampled) -> dict[str, float]: ...

    def close(self) -> None: ...


class LargeStateWarning:
    """Says once a run that a batch saved mid-decode is large (its KV cache), past 256 MiB."""

    def __init__(self):
        self.said = False

    def __call__(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        nbytes = sum(a.nbytes for a in arrays.values())
        if nbytes > 2**28 and not self.said:
            self.said = True
            metrics_lib.warn(f"each partial rollout in flight is saved whole with the checkpoint: "
                             f"{nbytes / 2**30:.2f} GiB (its KV cache)")
        return arrays
