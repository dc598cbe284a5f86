"""Deterministic, resumable, per-process batching over a Source.

The order is one endless stream: epoch e visits the examples in the permutation
`np.random.default_rng((seed, e)).permutation(N)` (or 0..N-1 without shuffling), and epoch e + 1
follows without a gap, so a batch may hold the end of one epoch and the start of the next.
A global batch is the next `global_batch_size` stream items; process p of P takes the contiguous
block `[p * G/P, (p + 1) * G/P)` of it — the rows its devices hold in a batch-sharded global array
whose processes own consecutive device blocks (`jax.make_array_from_process_local_data`).
Together the processes see every example exactly once per epoch.

The whole position is two integers, the same on every process: `state()` returns
`{"epoch", "position", ...}` (JSON-serialisable, for the checkpoint) and `restore(state)` continues
the exact order, also with a different number of processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ppo_jax.data.sources import Source
from ppo_jax.data.tokenization import PreferenceBatch, PromptBatch, PromptTokenizer, SFTBatch

STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class RecordBatch:
    """This process's rows of one global batch.

    records: the records, in order. indices [b] int64: their indices in the source.
    epochs [b] int64: the epoch each row belongs to. valid [b] bool: False only on the filler rows
    of the last batch of `iterate_once`.
    """

    records: list[dict[str, Any]]
    indices: np.ndarray
    epochs: np.ndarray
    valid: np.ndarray


def epoch_order(num_examples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Visiting order of epoch `epoch`: [N] int64, a permutation of 0..N-1."""
    if not shuffle:
        return np.arange(num_examples, dtype=np.int64)
    return np.random.default_rng((seed, epoch)).permutation(num_examples).astype(np.int64)


def _resolve_processes(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"need 0 <= process_index < process_count, got process_index="
                         f"{process_index}, process_count={process_count}")
    return int(process_index), int(process_count)


def _check_batch(global_batch_size: int, process_count: int) -> int:
    if not isinstance(global_batch_size, int | np.integer) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    if global_batch_size % process_count:
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by the "
                         f"{process_count} processes; each process takes an equal share, so use a "
                         f"multiple of {process_count}")
    return int(global_batch_size) // process_count


def _fetch(source: Source, indices: np.ndarray) -> list[dict[str, Any]]:
    return [source[int(i)] for i in indices]


class BatchIterator:
    """Endless iterator of this process's RecordBatch slices, in a seeded per-epoch order.

    global_batch_size: rows per global batch across all processes (a multiple of process_count);
      this process gets `global_batch_size // process_count` rows per step.
    process_index, process_count: default to `jax.process_index()` / `jax.process_count()`.
    """

    def __init__(self, source: Source, global_batch_size: int, seed: int = 0,
                 shuffle: bool = True, process_index: int | None = None,
                 process_count: int | None = None):
        self.source = source
        self.num_examples = len(source)
        if self.num_examples < 1:
            raise ValueError(f"source {source!r} is empty")
        if not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.process_index, self.process_count = _resolve_processes(process_index, process_count)
        self.global_batch_size = int(global_batch_size)
        self.local_batch_size = _check_batch(global_batch_size, self.process_count)
        self.epoch = 0
        self.position = 0  # stream index within `epoch`, 0 <= position < num_examples
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            # Keep only epochs at or after the current one: memory stays O(N) per live epoch.
            self._orders = {e: o for e, o in self._orders.items() if e >= self.epoch}
            self._orders[epoch] = epoch_order(self.num_examples, self.seed, epoch, self.shuffle)
        return self._orders[epoch]

    def _stream(self, epoch: int, position: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """`count` stream items from (epoch, position): (indices [count], epochs [count])."""
        epoch += position // self.num_examples
        position %= self.num_examples
        indices, epochs = [], []
        while count > 0:
            take = min(count, self.num_examples - position)
            indices.append(self._order(epoch)[position:position + take])
            epochs.append(np.full(take, epoch, dtype=np.int64))
            count -= take
            epoch, position = epoch + 1, 0
        return np.concatenate(indices), np.concatenate(epochs)

    def next_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """This process's (indices, epochs) of the next global batch; advances the position."""
        offset = self.process_index * self.local_batch_size
        indices, epochs = self._stream(self.epoch, self.position + offset, self.local_batch_size)
        advanced = self.position + self.global_batch_size
        self.epoch += advanced // self.num_examples
        self.position = advanced % self.num_examples
        return indices, epochs

    def __iter__(self) -> Iterator[RecordBatch]:
        return self

    def __next__(self) -> RecordBatch:
        indices, epochs = self.next_indices()
        return RecordBatch(records=_fetch(self.source, indices), indices=indices, epochs=epochs,
                           valid=np.ones(len(indices), dtype=bool))

    def state(self) -> dict[str, Any]:
        """The position as a JSON-serialisable dict (identical on every process)."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "position": self.position,
                "seed": self.seed, "shuffle": self.shuffle, "num_examples": self.num_examples}

    def restore(self, state: dict[str, Any]) -> None:
        """Continues from `state()`; the seed, shuffling and dataset size must match."""
        missing = [k for k in ("epoch", "position") if k not in state]
        if missing:
            raise KeyError(f"data loader state lacks {missing}; expected the dict from state()")
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle),
                          ("num_examples", self.num_examples)):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"cannot restore the data order: the checkpoint has {key}={state[key]!r} but "
                    f"this loader has {key}={mine!r}; the same data, seed and shuffling are needed "
                    f"to continue the exact order")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_examples:
            raise ValueError(f"data loader state out of range: epoch={epoch}, position={position} "
                             f"for {self.num_examples} examples")
        self.epoch, self.position = epoch, position
        self._orders = {}

    def metrics(self) -> dict[str, float]:
        """Fractional epoch count for logging."""
        return {"data/epoch": self.epoch + self.position / self.num_examples}


def iterate_once(source: Source, global_batch_size: int, process_index: int | None = None,
                 process_count: int | None = None) -> Iterator[RecordBatch]:
    """One pass in source order (evaluation): ceil(N / G) batches of fixed size.

    The last global batch is filled up with repeats of the last example, flagged `valid=False`,
    so every batch has the same shape.
    """
    process_index, process_count = _resolve_processes(process_index, process_count)
    local = _check_batch(global_batch_size, process_count)
    n = len(source)
    for start in range(0, n, global_batch_size):
        stream = start + process_index * local + np.arange(local, dtype=np.int64)
        valid = stream < n
        indices = np.minimum(stream, n - 1)
        yield RecordBatch(records=_fetch(source, indices), indices=indices,
                          epochs=np.zeros(local, dtype=np.int64), valid=valid)


# --------------------------------------------------------------------------------------------


def max_across_processes(value: int) -> int:
    """The largest `value` over all JAX processes (identity with one process)."""
    if jax.process_count() == 1:
        return int(value)
    return int(np.max(multihost_utils.process_allgather(np.asarray(value, dtype=np.int32))))


KINDS = ("prompt", "sft", "preference")


class PromptLoader:
    """BatchIterator + PromptTokenizer: endless tokenized batches of this process's rows.

    kind: "prompt" -> PromptBatch [b, Lq]; "sft" -> SFTBatch [b, L]; "preference" ->
      PreferenceBatch [b, L] (b = global_batch_size // process_count).
    The padded length is the bucket of the longest row in the GLOBAL batch: each process finds its
    own bucket and `agree_length` takes the maximum over processes, so every process builds arrays
    of one shape. The default uses a cross-process gather when JAX runs several processes; pass
    `agree_length=lambda n: n` for processes that are simulated, or a fixed-length function.
    The records of the latest batch are kept in `last_records` (for sample logging).
    """

    def __init__(self, source: Source, tokenizer: PromptTokenizer, global_batch_size: int,
                 kind: str = "prompt", seed: int = 0, shuffle: bool = True,
                 process_index: int | None = None, process_count: int | None = None,
                 agree_length: Callable[[int], int] | None = None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind = kind
        self.tokenizer = tokenizer
        self.batches = BatchIterator(source, global_batch_size, seed=seed, shuffle=shuffle,
                                     process_index=process_index, process_count=process_count)
        self.agree_length = max_across_processes if agree_length is None else agree_length
        self.last_records: RecordBatch | None = None

    @property
    def local_batch_size(self) -> int:
        return self.batches.local_batch_size

    def tokenize(self, batch: RecordBatch) -> PromptBatch | SFTBatch | PreferenceBatch:
        name = getattr(self.batches.source, "name", "source")
        labels: Sequence[str] = [f"{name}[{i}]" for i in batch.indices]
        tok = self.tokenizer
        if self.kind == "prompt":
            prompts = []
            for label, record in zip(labels, batch.records):
                if "prompt" not in record:
                    raise KeyError(f"{label}: record has no 'prompt' field (it has {sorted(record)})")
                prompts.append(record["prompt"])
            rows = tok.encode_prompts(prompts, labels)
            return tok.pad_prompts(rows, self.agree_length(tok.prompt_length(rows)))
        if self.kind == "sft":
            encoded = tok.encode_sft(batch.records, labels)
            length = tok.sequence_length([ids for ids, _ in encoded])
            return tok.pad_sft(encoded, self.agree_length(length))
        encoded = tok.encode_preferences(batch.records, labels)
        length = tok.sequence_length([ids for pair in encoded for ids, _ in pair])
        return tok.pad_preferences(encoded, self.agree_length(length))

    def __iter__(self):
        return self

    def __next__(self) -> PromptBatch | SFTBatch | PreferenceBatch:
        records = next(self.batches)
        self.last_records = records
        return self.tokenize(records)

    def state(self) -> dict[str, Any]:
        return self.batches.state()

    def restore(self, state: dict[str, Any]) -> None:
        self.batches.restore(state)

    def metrics(self) -> dict[str, float]:
        return {**self.batches.metrics(), **self.tokenizer.metrics()}
