"""A run's mirror on Weights & Biases (`WandbSettings`, the `[wandb]` extra): the rows of metrics.jsonl
under the same names and steps, the settings as the W&B run's config, sample rows as tables, PNG
plots as images.

The workdir is the run: its W&B id is kept in <workdir>/wandb_run_id, so a resumed run (or a run
restarted before its first checkpoint) continues the same W&B run. Offline runs write their files
under <workdir>/wandb (or $WANDB_DIR); `wandb sync` sends them later. Process 0 opens it (the
callers' business: `MetricWriter` is active on process 0 only).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from etils import epath

from ppo_jax.config import WANDB_INSTALL, ConfigError, WandbSettings
from ppo_jax.metrics import MetricWriter

RUN_ID_FILE = "wandb_run_id"


def import_wandb():
    """The wandb module, or one line naming the extra (WandbSettings.validate raises it earlier)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(f"W&B logging needs the wandb package, which is not installed: {WANDB_INSTALL}") from None
    return wandb


def run_id(workdir: str) -> str:
    """The workdir's W&B run id: the one kept in <workdir>/wandb_run_id, or a new one, kept there."""
    path = epath.Path(workdir) / RUN_ID_FILE
    kept = path.read_text().strip() if path.exists() else ""
    if kept:
        return kept
    new = secrets.token_hex(6)  # W&B ids: letters and digits
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new + "\n")
    return new


def files_dir(workdir: str) -> str | None:
    """Where W&B writes its files: $WANDB_DIR, else the workdir (a remote workdir: W&B's default, ./wandb)."""
    return os.environ.get("WANDB_DIR") or (workdir if "://" not in workdir else None)


def _cell(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


class WandbRun:
    """One open W&B run; `open` starts or resumes it, `finish` closes it (safe to call twice)."""

    def __init__(self, wandb, run):
        self._wandb = wandb
        self.run = run
        # A resumed run restarts after its checkpoint; the steps an interrupted run logged past it are
        # already in W&B with the same values (resume is exact), and W&B refuses steps that go back.
        self._first_step = int(getattr(run, "step", 0) or 0)

    @classmethod
    def open(cls, settings: WandbSettings, workdir: str, *, config: Mapping[str, Any] | None = None,
             job_type: str = "") -> WandbRun:
        """settings.mode must not be "disabled". config: the run's settings (`config.to_dict`);
        job_type: what the run is ("ppo", "sft", "reward_model", "dpo", a demo stage)."""
        wandb = import_wandb()
        run = wandb.init(
            mode=settings.mode, project=settings.project, entity=settings.entity or None,
            name=settings.name or os.path.basename(os.path.normpath(workdir)),
            group=settings.group or None,  # None: W&B reads $WANDB_RUN_GROUP (the sweep's name)
            tags=list(settings.tags) or None, job_type=job_type or None, config=dict(config or {}),
            id=run_id(workdir), resume="allow", dir=files_dir(workdir),
            reinit="create_new")  # a second trainer in one process (the demo's stages) gets its own run
        return cls(wandb, run)

    def log(self, step: int, row: Mapping[str, float]) -> None:
        if step >= self._first_step:
            self.run.log(dict(row), step=int(step))

    def table(self, step: int, key: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Rows of dicts (keys may differ between rows: a missing cell is None) as one wandb.Table."""
        if step < self._first_step or not rows:
            return
        columns = list(dict.fromkeys(k for row in rows for k in row))
        data = [[_cell(row.get(k)) for k in columns] for row in rows]
        self.run.log({key: self._wandb.Table(columns=columns, data=data)}, step=int(step))

    def images(self, paths: Mapping[str, str]) -> None:
        """PNG files as wandb.Image, one key each."""
        if not paths:
            return
        self.run.log({key: self._wandb.Image(path) for key, path in paths.items()})

    def summary(self, values: Mapping[str, Any]) -> None:
        self.run.summary.update(dict(values))

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def metric_writer(workdir: str, *, resume_step: int = 0, wandb: WandbSettings | None = None,
                  run_config: Mapping[str, Any] | None = None, job_type: str = "",
                  tensorboard: bool = True) -> MetricWriter:
    """A run's `MetricWriter`, mirrored to W&B when its `wandb` section turns it on (None or mode
    "disabled": no W&B). run_config: the run's settings as a dict, the W&B run's config; job_type:
    what the run is ("ppo", "sft", ...)."""
    mirror = None
    if wandb is not None and wandb.enabled:
        mirror = lambda: WandbRun.open(wandb, workdir, config=run_config, job_type=job_type)  # noqa: E731
    return MetricWriter(workdir, resume_step=resume_step, mirror=mirror, tensorboard=tensorboard)
