"""The k-step off-policy pipeline (rollout.off_policy_steps = k): the sampler runs k batches ahead of
the trainer, each stamped with the policy version (train step) whose weights began it. It knows no
kind of rollout: whatever a batch is (a whole sample, one decoded in segments, episodes), it is a
`Batch` of its `RolloutSource` (`rl/rollout_source.py`).

Iteration i (θ_i: the weights before update i; k = 1 shown, k > 1 the same with batches i+1 .. i+k
in flight):

    complete batch i under θ_i          (dispatched first: the trainer waits for it)
    advance batches i+1 .. i+k-1 under θ_i   (a segment each; nothing for a whole sample)
    begin batch i+k under θ_i
    -> wait for batch i; host rewards; experience i; update i   (the sampler's work goes on meanwhile)

The first iteration begins batches 0 .. k with θ_0 (batch j's lag is j until the pipeline is full,
then k); the last k iterations begin none. Same prompts and keys, in the same order, for every k.
The batches in flight at a checkpoint are saved with it (`record`; their arrays in the checkpoint's
binary item), so a resumed run continues with the very rollouts the uninterrupted one would have
used.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np

from ppo_jax import metrics as metrics_lib
from ppo_jax import sharding
from ppo_jax.config import ConfigError
from ppo_jax.data.prompt_stream import PromptStream
from ppo_jax.rl import roles
from ppo_jax.rl.rollout_source import Batch, InFlightRecord, RolloutSource, Sampled


def _size(nbytes: int) -> str:
    """Bytes in the largest binary unit (KiB, MiB, GiB) that leaves at least 1 of it."""
    power, unit = next(((p, u) for p, u in ((30, "GiB"), (20, "MiB")) if nbytes >= 2 ** p), (10, "KiB"))
    return f"{nbytes / 2 ** power:.2f} {unit}"


@dataclasses.dataclass
class InFlightPipeline:
    """The batches in flight (`queue`, oldest first: batches step, step + 1, ... at the start of
    `next`) of `source`, fed by `prompts` with the keys `fold_in(sample_key, batch)`."""

    source: RolloutSource
    prompts: PromptStream
    sample_key: jax.Array
    steps_ahead: int  # rollout.off_policy_steps (0: on-policy, each batch begun and finished in its iteration)
    iterations: int  # train.iterations: no batch is begun past the last
    sampler_devices: list
    queue: collections.deque[Batch] = dataclasses.field(default_factory=collections.deque)

    def key(self, batch: int) -> jax.Array:
        return jax.random.fold_in(self.sample_key, batch)

    def decodes(self, iteration: int) -> bool:
        """Whether `next(..., iteration)` decodes anything, so needs the weights: a batch begins, or one
        in flight decodes more. (The last iterations of a whole-sample run only collect.)"""
        begins = not self.queue or iteration + len(self.queue) <= self._last(iteration)
        return begins or any(batch.decodes_more for batch in self.queue)

    def _last(self, iteration: int) -> int:
        """The newest batch in flight once `next(..., iteration)` returns."""
        return min(iteration + self.steps_ahead, self.iterations - 1)

    def next(self, weights: roles.SyncedWeights | None, iteration: int) -> Sampled:
        """The batch of `iteration` (waited for), the pipeline moved on as the module docstring says.
        weights: None only where `decodes(iteration)` is False."""
        last = self._last(iteration)
        if not self.queue:  # a run's first iteration (or on-policy): batch `iteration` begins now
            self._begin(weights, iteration, iteration)
            self._check_room(more=last - iteration)
        current = self.queue.popleft().complete(weights, iteration)
        self.queue = collections.deque(batch.advance(weights, iteration) for batch in self.queue)
        while iteration + 1 + len(self.queue) <= last:
            self._begin(weights, iteration + 1 + len(self.queue), iteration)
        return current.result()

    def _begin(self, weights: roles.SyncedWeights, batch: int, version: int) -> None:
        self.queue.append(self.source.begin(weights, *self.prompts.next_batch(), self.key(batch), version))

    def _check_room(self, more: int) -> None:
        """With a fresh run's first batch in flight and `more` to join it: each will hold what the
        first holds on the sampler's devices (measured), so refuse in one line, before the others are
        dispatched, when that does not fit their free memory. Devices that report none (a CPU) are
        not checked."""
        if more < 1:
            return
        free = sharding.free_device_bytes(self.sampler_devices)
        if free is None:
            return
        first = self.queue[0]
        each = sharding.device_bytes(first.held())
        if more * each <= free:
            return
        raise ConfigError(f"rollout.off_policy_steps={self.steps_ahead}: a batch in flight holds {_size(each)} per "
                          f"sampler device ({first.held_what}, measured on the first), so the {more} that join it "
                          f"need {_size(more * each)}, but {_size(free)} are free there; use "
                          f"rollout.off_policy_steps={free // each if each else 0} or less{first.room_hint}")

    def record(self) -> InFlightRecord:
        """The batches in flight, oldest first (waits for them): each its version and its arrays."""
        record = InFlightRecord([], {})
        for batch in self.queue:
            record.records.append({"version": batch.version, **batch.save(record)})
        return record

    def restore(self, records: list[dict] | dict | None, step: int, arrays: dict[str, np.ndarray] | None) -> None:
        """The batches a checkpoint of train step `step` saved in flight (`InFlightRecord.records`, their
        arrays in `arrays`), back on the sampler's mesh. Reads the older formats too: the arrays as
        base64 JSON, and one step's (one sample's arrays, or None), which the weights before the step's
        update drew."""
        arrays = arrays or {}
        if isinstance(records, dict):  # the one-step format
            records = [{"version": step - 1, "sample": records}]
        records = records or []
        if len(records) > self.steps_ahead:
            metrics_lib.warn(f"the checkpoint holds {len(records)} rollouts sampled ahead, but this run has "
                             f"rollout.off_policy_steps={self.steps_ahead}: the prompts of the last "
                             f"{len(records) - self.steps_ahead} are skipped")
            records = records[:self.steps_ahead]
        self.queue = collections.deque(self.source.restore(r, arrays) for r in records)
