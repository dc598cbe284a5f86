"""The manager: numbered step checkpoints (state + JSON extra + metrics) and trees saved once."""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies_lib

from ppo_jax.checkpoint import aside, payloads, reading, trees, verify
from ppo_jax.checkpoint.aside import CORRUPT_SUFFIX
from ppo_jax.checkpoint.errors import (CheckpointCorruptError, CheckpointError, CheckpointNotFoundError,
                                       CheckpointSaveError)
from ppo_jax.checkpoint.step_items import ARRAYS_ITEM, CHECKSUM_ITEM, EXTRA_ITEM, STATE_ITEM, RestoredStep

FROZEN_SUBDIR = "frozen"
_FROZEN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_TMP_MARKER = ".orbax-checkpoint-tmp"


def _as_path(directory) -> epath.Path:
    text = os.fspath(directory)
    if "://" not in text:  # local path: Orbax wants it absolute
        text = os.path.abspath(text)
    return epath.Path(text)


def _advice(cause: BaseException) -> str:
    """What to check after a save failed with `cause`: the disk, unless the JAX runtime failed (a
    collective between the run's processes, e.g. because one of them stopped, or a device)."""
    chain: list[BaseException] = []
    while cause is not None and cause not in chain and len(chain) < 8:  # what Orbax raised, and why
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    if any(isinstance(e, jax.errors.JaxRuntimeError) for e in chain):
        return ("The JAX runtime failed, not the disk: a device, or a collective between the run's processes "
                "(one of them may have stopped; a multi-process run names it)")
    return "Check that the directory is writable and the disk has free space"


def committed_steps(directory) -> list[int]:
    """The steps in `directory` whose save completed, ascending, read from the files alone: no
    manager and no collective, so any thread may ask, e.g. while a process of the run is lost. A save
    cut short left a tmp directory, never one of these (a resume ignores and removes it)."""
    path = _as_path(directory)
    try:
        if "://" in os.fspath(path):  # no atomic rename there: Orbax marks the steps it finished
            steps = ocp.path.step.checkpoint_steps(path)
        else:  # a step is renamed from its tmp directory once complete
            steps = [int(p.name) for p in path.iterdir() if p.name.isdigit() and p.is_dir()]
        return sorted(s for s in steps if aside.holds_checkpoint(path / str(s), STATE_ITEM))
    except OSError:
        return []


class CheckpointManager:
    """Asynchronous step checkpoints (state + JSON extra) plus trees saved once.

    Keeps the newest `max_to_keep` steps and, when `best_metric` is set, also the best step by
    `metrics[best_metric]` (`best_mode` "max" or "min"; a NaN metric ranks worst). Saves happen
    only at steps that are multiples of `save_interval_steps` (or with `force=True`). Opening sets
    aside (`aside`) each directory named like a step that holds no checkpoint, with a `warning:` line.
    Every process of a multi-process run must make the same calls.
    """

    def __init__(self, directory, *, max_to_keep: int = 3, best_metric: str | None = None,
                 best_mode: str = "max", save_interval_steps: int = 1, async_save: bool = True):
        if not isinstance(max_to_keep, numbers.Integral) or max_to_keep < 1:
            raise ValueError(
                f"checkpoint max_to_keep must be an integer >= 1, got {max_to_keep!r}")
        if best_mode not in ("max", "min"):
            raise ValueError(f"checkpoint best_mode must be 'max' or 'min', got {best_mode!r}")
        if not isinstance(save_interval_steps, numbers.Integral) or save_interval_steps < 1:
            raise ValueError(
                f"checkpoint save_interval_steps must be an integer >= 1, got {save_interval_steps!r}")
        if best_metric is not None and not isinstance(best_metric, str):
            raise TypeError(
                f"checkpoint best_metric must be a metric name (str), got {best_metric!r}")
        self._directory = _as_path(directory)
        self._best_metric = best_metric
        self._best_mode = best_mode
        self._async = bool(async_save)
        self._pending_step: int | None = None
        self._frozen_checkpointer = None
        self._closed = False
        self._said_relayout = False  # a tree was read in the other layer layout (warned once)

        policies = [policies_lib.LatestN(n=int(max_to_keep))]
        if best_metric is not None:
            # n=1: the single best step survives however old it is; steps saved without metrics
            # compete only on recency (LatestN above).
            policies.append(policies_lib.BestN(
                get_metric_fn=self._rank, reverse=(best_mode == "min"), n=1,
                keep_checkpoints_without_metrics=False))
        # Due at multiples of the interval, or when JAX's preemption service (TPU) says every
        # process reached the preemption sync point. Not Orbax's default "first save always"
        # rule: whether to save the initial state is the caller's call (`force=True`).
        save_policy = policies_lib.AnySavePolicy([
            policies_lib.FixedIntervalPolicy(int(save_interval_steps)),
            policies_lib.PreemptionCheckpointingPolicy(),
        ])
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=int(save_interval_steps),
            save_decision_policy=save_policy,
            # best_fn makes Orbax store the metrics and answer best_step(); what is deleted is
            # decided by the preservation policy alone.
            best_fn=self._rank if best_metric is not None else None,
            best_mode=best_mode,
            preservation_policy=policies_lib.AnyPreservationPolicy(policies),
            cleanup_tmp_directories=True,  # leftovers of saves killed mid-way
            enable_async_checkpointing=self._async,
            create=True,
        )
        # Orbax removes these in the background on open; remember them for error messages.
        self._incomplete_at_open = self._incomplete_saves()
        try:
            self._manager = ocp.CheckpointManager(
                self._directory, options=options,
                # Handlers named up front so a fresh manager can read metadata before any save.
                item_handlers={STATE_ITEM: ocp.StandardCheckpointHandler(),
                               EXTRA_ITEM: ocp.JsonCheckpointHandler(),
                               CHECKSUM_ITEM: ocp.JsonCheckpointHandler(),
                               ARRAYS_ITEM: ocp.StandardCheckpointHandler()})
        except OSError as e:
            raise CheckpointSaveError(
                f"cannot create or open the checkpoint directory {self._directory}: {e}; choose "
                "a writable directory (e.g. the run's workdir on a disk with free space)") from e
        # A stray `99/` would be the newest step, the first every resume tries, and unreadable.
        if aside.set_aside_steps_without_checkpoint(self._directory, self._manager.all_steps(), STATE_ITEM):
            self._manager.reload()

    # ------------------------------------------------------------------ queries

    @property
    def directory(self) -> epath.Path:
        return self._directory

    def all_steps(self) -> list[int]:
        """Complete (committed) steps, ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def best_step(self) -> int | None:
        """Best step by the tracked metric (the latest one when no metric is tracked)."""
        return self._manager.best_step()

    def metrics(self, step: int) -> dict | None:
        """The metrics saved with `step` (only stored when a best metric is tracked)."""
        return self._manager.metrics(step)

    def reached_preemption(self, step: int) -> bool:
        """True once every process reached JAX's preemption sync point (TPU maintenance events).

        Always False where JAX's preemption service is not running (CPU, single process).
        """
        return bool(self._manager.reached_preemption(int(step)))

    def _rank(self, metrics) -> float:
        value = float(metrics[self._best_metric])
        if math.isnan(value):
            return -math.inf if self._best_mode == "max" else math.inf
        return value

    def _incomplete_saves(self) -> list[str]:
        try:
            return sorted(p.name for p in self._directory.iterdir() if _TMP_MARKER in p.name)
        except OSError:
            return []

    # ------------------------------------------------------------------ save

    def save(self, step: int, state, *, extra: Mapping[str, Any], metrics: Mapping[str, Any] | None = None,
             force: bool = False, arrays: Mapping[str, Any] | None = None) -> bool:
        """Starts saving `state` (pytree of jax.Arrays), `extra` (JSON) and `arrays` ({name: host
        array}, names of letters, digits and '_'; restored into extra[ARRAYS_ITEM]) as `step`.

        Returns False (and writes nothing) when the step is not due by `save_interval_steps` or
        is not newer than the latest saved step, unless `force`. Returns once the arrays are off
        the devices when saving asynchronously. Raises CheckpointSaveError if this or the
        previous asynchronous save failed (the checkpoints committed before it stay intact; when
        it was the previous one, this step was not started: call `save` again).
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"checkpoint step must be a non-negative integer, got {step!r}")
        step = int(step)
        trees.check_state_leaves(state)
        extra = payloads.check_extra(extra)
        metrics = payloads.check_metrics(metrics, self._best_metric)
        self._raise_if_previous_save_failed()
        if force and step in self._manager.all_steps():
            raise CheckpointError(
                f"checkpoint step {step} already exists in {self._directory}; saves never overwrite "
                "a committed step")
        items = {STATE_ITEM: ocp.args.StandardSave(state), EXTRA_ITEM: ocp.args.JsonSave(extra),
                 CHECKSUM_ITEM: ocp.args.JsonSave(verify.record(state))}
        if arrays:
            items[ARRAYS_ITEM] = ocp.args.StandardSave(dict(arrays))
        args = ocp.args.Composite(**items)
        try:
            saved = self._manager.save(step, args=args, metrics=metrics, force=force)
        except Exception as e:  # synchronous part (or a synchronous save) failed
            self._manager.reload()
            raise self._save_error(step, e) from e
        if saved:
            self._pending_step = step
            if not self._async:
                self._raise_if_previous_save_failed()
        return saved

    def _save_error(self, step: int | None, cause: BaseException) -> CheckpointSaveError:
        kept = self.all_steps()
        which = f"checkpoint step {step}" if step is not None else "the previous checkpoint"
        kept_text = (f"the committed checkpoints {kept} are intact and resume uses step {kept[-1]}"
                     if kept else "no earlier checkpoint exists")
        return CheckpointSaveError(
            f"saving {which} to {self._directory} failed: "
            f"{type(cause).__name__}: {cause}. {_advice(cause)}; {kept_text}")

    def _raise_if_previous_save_failed(self) -> None:
        """Blocks on the save in flight; turns its failure into a CheckpointSaveError."""
        step, self._pending_step = self._pending_step, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            # Orbax already dropped the failed step from its list; reload from disk so that steps
            # it scheduled for deletion (still on disk: deletion follows a commit) are listed.
            self._manager.reload()
            raise self._save_error(step, e) from e

    # ------------------------------------------------------------------ restore

    def restore(self, step: int | None = None, *, abstract_state) -> tuple[Any, dict]:
        """(state, extra) of `step` (default: the latest complete step).

        `abstract_state` is the target tree of jax.ShapeDtypeStruct(shape, dtype, sharding=...)
        (jax.Arrays also work): arrays are read straight onto those shardings, so the mesh may
        differ from the one the checkpoint was written on.
        """
        self._check_open()
        self._raise_if_previous_save_failed()
        steps = self.all_steps()
        if not steps:
            raise self._no_checkpoint_error()
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise CheckpointNotFoundError(
                f"checkpoint step {step} is not in {self._directory}; available steps: {steps}")
        abstract = trees.to_abstract(abstract_state)
        what = f"checkpoint step {step} in {self._directory}"
        step_dir = self._directory / str(step)
        try:
            stored = self._manager.item_metadata(step)[STATE_ITEM]
        except Exception as e:
            raise reading.read_error(what, "its metadata failed to load", e) from e
        if stored is None:
            if (step_dir / STATE_ITEM).exists():
                raise CheckpointCorruptError(f"{what} is damaged: its {STATE_ITEM}/_METADATA file is missing")
            raise CheckpointError(f"{what} has no '{STATE_ITEM}' item; it was not written by ppo_jax")
        read_as, relayout = reading.read_target(getattr(stored, "tree", stored), abstract, what)
        # Checkpoints written before checksums existed restore unverified.
        verified = (step_dir / CHECKSUM_ITEM).exists()
        items = {STATE_ITEM: ocp.args.StandardRestore(read_as), EXTRA_ITEM: ocp.args.JsonRestore()}
        if verified:
            items[CHECKSUM_ITEM] = ocp.args.JsonRestore()
        if (step_dir / ARRAYS_ITEM).exists():
            items[ARRAYS_ITEM] = ocp.args.StandardRestore()
        with reading.quiet_abandoned_reads():
            restored = reading.read(lambda: self._manager.restore(step, args=ocp.args.Composite(**items)),
                                    what, "it could not be read")
        state = restored[STATE_ITEM]
        if verified:
            verify.check_restored(what, state, restored[CHECKSUM_ITEM])
        extra = dict(restored[EXTRA_ITEM] or {})
        if ARRAYS_ITEM in items:
            extra[ARRAYS_ITEM] = {name: np.asarray(a) for name, a in restored[ARRAYS_ITEM].items()}
        return self._in_target_layout(state, abstract, relayout, what), extra

    def _in_target_layout(self, tree, abstract, to: str | None, what: str):
        """Said once per manager: a resume converts its step and its frozen trees alike."""
        tree = reading.to_target_layout(tree, abstract, to, what, say=not self._said_relayout)
        self._said_relayout |= to is not None
        return tree

    def _no_checkpoint_error(self) -> CheckpointNotFoundError:
        partial = sorted(set(self._incomplete_at_open) | set(self._incomplete_saves()))
        note = (f" (incomplete saves, ignored: {', '.join(partial)})" if partial else "")
        return CheckpointNotFoundError(
            f"no complete checkpoint in {self._directory}{note}; check the path, or start without restoring")

    def restore_newest_valid(self, *, abstract_state) -> RestoredStep:
        """The newest step that reads and verifies (as `restore`). Each newer step found damaged is
        renamed `<step>.corrupt` (kept for inspection, ignored from then on) and named in
        `skipped`; a checkpoint of a different model is an error here, not damage."""
        self._check_open()
        self._raise_if_previous_save_failed()
        if not self.all_steps():
            raise self._no_checkpoint_error()
        skipped: list[str] = []
        for step in reversed(self.all_steps()):
            try:
                state, extra = self.restore(step, abstract_state=abstract_state)
            except CheckpointCorruptError as e:
                skipped.append(f"{e} (moved to {self._set_aside(self._directory / str(step))})")
                continue
            return RestoredStep(step, state, extra, tuple(f"{line}; resuming from step {step}" for line in skipped))
        raise CheckpointCorruptError(
            f"no checkpoint in {self._directory} is intact: {'; '.join(skipped)}. Start the run in a new "
            "workdir (or move the checkpoints directory away)")

    def _set_aside(self, path: epath.Path, suffix: str = CORRUPT_SUFFIX) -> epath.Path:
        """Renames a step or frozen tree so nothing reads it again, without deleting it."""
        moved = aside.set_aside(path, suffix)
        self._manager.reload()
        return moved

    def read_extra(self, step: int | None = None) -> tuple[int, dict]:
        """(step, extra JSON) of `step` (default: the latest) without reading any array."""
        self._check_open()
        self._raise_if_previous_save_failed()
        steps = self.all_steps()
        if not steps:
            raise CheckpointNotFoundError(f"no complete checkpoint in {self._directory}")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise CheckpointNotFoundError(
                f"checkpoint step {step} is not in {self._directory}; available steps: {steps}")
        restored = self._manager.restore(step, args=ocp.args.Composite(**{EXTRA_ITEM: ocp.args.JsonRestore()}))
        return step, dict(restored[EXTRA_ITEM] or {})

    # ------------------------------------------------------------------ frozen trees

    def _frozen_path(self, name: str) -> epath.Path:
        if not isinstance(name, str) or not _FROZEN_NAME.match(name) or _TMP_MARKER in name:
            raise ValueError(
                f"frozen tree name must be letters, digits, '_', '-', '.', got {name!r}")
        return self._directory / FROZEN_SUBDIR / name

    def has_frozen(self, name: str) -> bool:
        """Whether a complete frozen tree `name` exists (saves in flight do not count)."""
        return self._frozen_path(name).exists()

    def save_frozen(self, name: str, tree) -> dict:
        """Starts saving `tree` once under frozen/<name> (asynchronous like `save`). Returns the
        tree's checksums: record them with the steps that depend on the tree and pass them to
        `restore_frozen`, which then also proves the tree is the one those steps used."""
        self._check_open()
        path = self._frozen_path(name)
        trees.check_state_leaves(tree)
        record = verify.record(tree)
        if self._frozen_checkpointer is None:
            handler = ocp.StandardCheckpointHandler()
            self._frozen_checkpointer = (ocp.AsyncCheckpointer(handler) if self._async
                                         else ocp.Checkpointer(handler))
        self._wait_frozen()
        if path.exists():
            raise CheckpointError(
                f"frozen tree {name!r} already exists at {path}; frozen trees are saved once "
                "(restore it with restore_frozen)")
        try:
            self._frozen_checkpointer.save(path, args=ocp.args.StandardSave(tree))
        except Exception as e:
            raise CheckpointSaveError(
                f"saving frozen tree {name!r} to {path} failed: {type(e).__name__}: {e}. {_advice(e)}") from e
        if not self._async:
            self._wait_frozen()
        return record

    def _wait_frozen(self) -> None:
        if self._frozen_checkpointer is None or not self._async:
            return  # a synchronous Checkpointer has committed when `save` returned (and no wait method)
        try:
            self._frozen_checkpointer.wait_until_finished()
        except Exception as e:
            raise CheckpointSaveError(
                f"saving a frozen tree under {self._directory / FROZEN_SUBDIR} failed: "
                f"{type(e).__name__}: {e}. {_advice(e)}") from e

    def restore_frozen(self, name: str, abstract, *, checksums: dict | None = None):
        """The frozen tree `name`, read onto the shardings in `abstract` (as in `restore`).

        checksums: what `save_frozen` returned; the restored tree must match them, or
        CheckpointCorruptError says the tree is damaged or not the one they were taken of.
        """
        self._check_open()
        path = self._frozen_path(name)
        self._wait_frozen()
        if not path.exists():
            root = self._directory / FROZEN_SUBDIR
            have = sorted(p.name for p in root.iterdir() if _TMP_MARKER not in p.name) \
                if root.exists() else []
            raise CheckpointNotFoundError(
                f"no frozen tree {name!r} at {path}; frozen trees present: {have or 'none'}")
        abstract = trees.to_abstract(abstract)
        what = f"frozen tree {name!r} at {path}"
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
            try:
                stored = checkpointer.metadata(path).item_metadata
            except Exception as e:
                raise reading.read_error(what, "its metadata failed to load", e) from e
            if stored is None:
                raise CheckpointCorruptError(f"{what} is damaged: its _METADATA file is missing")
            read_as, relayout = reading.read_target(getattr(stored, "tree", stored), abstract, what)
            with reading.quiet_abandoned_reads():
                tree = reading.read(lambda: checkpointer.restore(path, args=ocp.args.StandardRestore(read_as)),
                                    what, "it could not be read")
        if checksums is not None:
            verify.check_restored(what, tree, checksums)
        return self._in_target_layout(tree, abstract, relayout, what)

    def set_aside_frozen(self, name: str, suffix: str = CORRUPT_SUFFIX) -> epath.Path:
        """Renames frozen/<name> (damaged, or not the run's) so it is never read again; returns
        the new path. A later `save_frozen(name, ...)` writes a fresh one."""
        self._check_open()
        self._wait_frozen()
        return self._set_aside(self._frozen_path(name), suffix)

    # ------------------------------------------------------------------ lifecycle

    def wait(self) -> None:
        """Blocks until every save in flight has committed.

        Raises CheckpointSaveError if one failed (the committed checkpoints stay intact).
        """
        if self._closed:
            return
        try:
            self._raise_if_previous_save_failed()
        finally:
            self._wait_frozen()

    def close(self) -> None:
        """Waits for saves in flight, then releases Orbax's threads. Safe to call twice."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._manager.close()
            if self._frozen_checkpointer is not None:
                self._frozen_checkpointer.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"checkpoint manager for {self._directory} is closed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
