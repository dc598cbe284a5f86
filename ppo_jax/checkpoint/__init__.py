"""Checkpoints: the only package that imports Orbax.

Modules: `manager` (CheckpointManager), `reading` (a read's failure as one line, the read target),
`aside` (renaming what must not be read again), `trees` (paths, shapes, the restore-target check),
`verify` (leaf checksums), `layout` (stacked / per-layer layer layouts), `payloads` (the JSON
items), `errors`.

A run directory holds numbered step checkpoints and, under `frozen/`, trees saved once:

    <directory>/
      12/state/...        trainable state (any pytree of jax.Arrays; typed PRNG keys included)
      12/extra/...        JSON: data position, shuffle state, config (whatever the caller passes)
      12/checksums/...    JSON: one checksum per state leaf, compared after every restore
      12/metrics/...      JSON metrics, written only when a best metric is tracked
      11.corrupt/         a step found damaged on restore (renamed, never deleted)
      99.corrupt/         a directory named like a step that held no checkpoint (renamed on open)
      frozen/reference/   trees saved once (reference / reward params)

What Orbax gives us and we rely on (each one is exercised in tests/test_checkpoint.py):
- Atomic commits: a step is written to `<step>.orbax-checkpoint-tmp` and renamed when complete, so
  a process killed mid-save leaves only a tmp directory that the next manager ignores (and removes).
- Asynchronous saves: `save` returns once arrays are copied off the devices; the write continues in
  the background. A failed background write is reported (as `CheckpointSaveError`) by the next
  `save`, `wait` or `close`; the old checkpoints are deleted only after a new one has committed.
- Restores onto any mesh: the caller's abstract target carries the shardings to restore onto.
- Multi-process: every process calls every method; Orbax decides which process writes what.

Restore targets are checked against the checkpoint's metadata before any array is read, so a
checkpoint from a different model names the first differing path and both shapes. Restored arrays
are checked against the checksums written at save time: a flipped byte reads back as a different
number, not as an error. `restore_newest_valid` falls back past damaged steps and says why.

Layer layouts: `compute.layer_loop` runs a model's layers stacked ([L, ...] leaves, the scan) or per
layer (`layers_0 ...`), "auto" choosing per platform, so a checkpoint may hold the other layout than
the run restoring it. A stored tree that differs from the target only in that is read in its own
layout, verified, and converted onto the target's shardings (said once, as a `warning:` line);
checksums compare across layouts without converting anything.
"""

from ppo_jax.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
)
from ppo_jax.checkpoint.manager import CheckpointManager, committed_steps
from ppo_jax.checkpoint.step_items import RestoredStep

__all__ = ["CheckpointCorruptError", "CheckpointError", "CheckpointManager", "RestoredStep", "CheckpointMismatchError", "CheckpointNotFoundError",
           "CheckpointSaveError", "committed_steps"]
