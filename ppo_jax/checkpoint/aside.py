"""Setting aside: what must never be read again (a damaged step, a damaged or foreign frozen tree, a
step directory that holds no checkpoint) is renamed `<name>.corrupt` (`.corrupt.2`, ... when taken),
never deleted. Process 0 renames; in a multi-process run the others wait for it.

A step directory holds no checkpoint when it has neither Orbax's `_CHECKPOINT_METADATA` file nor the
state item (`99/x`, an empty `99/`: a directory a person or another tool made). Orbax lists it as a
step all the same, so it would be the step every resume tries first; the manager sets such
directories aside when it opens. A step Orbax wrote and that was damaged since is not one of these:
restore reads it and says what is damaged.
"""

from __future__ import annotations

import jax
from etils import epath
from jax.experimental import multihost_utils

from ppo_jax import metrics as metrics_lib

CORRUPT_SUFFIX = ".corrupt"
ORBAX_METADATA = "_CHECKPOINT_METADATA"  # written by Orbax into every step it commits


def target(path: epath.Path, suffix: str = CORRUPT_SUFFIX) -> epath.Path:
    """Where `path` is moved to: `<name><suffix>`, numbered when that is taken."""
    moved = path.parent / (path.name + suffix)
    n = 1
    while moved.exists():
        n += 1
        moved = path.parent / f"{path.name}{suffix}.{n}"
    return moved


def _sync(tag: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"ppo_jax {tag}")


def set_aside(path: epath.Path, suffix: str = CORRUPT_SUFFIX) -> epath.Path:
    """Renames `path` (process 0; the others wait) so nothing reads it again; returns the new path."""
    moved = target(path, suffix)
    if jax.process_index() == 0:
        path.rename(moved)
    _sync(f"set aside {path.name}")
    return moved


def _lacks(step_dir: epath.Path, state_item: str) -> str | None:
    """What makes `step_dir` no checkpoint, or None when Orbax wrote it (whole or damaged)."""
    if (step_dir / ORBAX_METADATA).exists() or (step_dir / state_item).exists():
        return None
    contents = sorted(p.name for p in step_dir.iterdir())
    held = f"it holds {', '.join(contents[:5])}{', ...' if len(contents) > 5 else ''}" if contents else "it is empty"
    return f"no {ORBAX_METADATA} file, no {state_item}/ directory; {held}"


def holds_checkpoint(step_dir: epath.Path, state_item: str) -> bool:
    """Whether Orbax wrote `step_dir` (whole or damaged), not a person or another tool."""
    return _lacks(step_dir, state_item) is None


def set_aside_steps_without_checkpoint(directory: epath.Path, steps, state_item: str) -> list[int]:
    """Sets aside each of `steps` whose directory holds no checkpoint, one `warning:` line each
    (process 0); returns those steps. Every process looks before any renames, so all agree."""
    found = [(step, lacks, target(directory / str(step))) for step in steps
             if (lacks := _lacks(directory / str(step), state_item)) is not None]
    if not found:
        return []
    _sync("found steps without a checkpoint")
    for step, lacks, moved in found:
        if jax.process_index() == 0:
            (directory / str(step)).rename(moved)
        metrics_lib.warn(f"{directory / str(step)} is named like a checkpoint step but holds none ({lacks}); "
                         f"moved to {moved}, never read as step {step}")
    _sync("set aside steps without a checkpoint")
    return [step for step, _, _ in found]
