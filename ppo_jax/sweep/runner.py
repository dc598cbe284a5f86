"""Runs a sweep's processes, one after another or N at a time, and resumes an interrupted sweep.

Each run is its trainer's command line in its own workdir (`<sweep_dir>/runs/<run name>`, which the
trainer creates: the sweep writes nothing into it, so a trainer that wants an empty or its own
directory gets one), the output of its k-th attempt in `<sweep_dir>/logs/<run name>.attempt-<k>.log`
(a resumed run keeps the log of the attempt that failed), the outcome of its latest attempt in
`<sweep_dir>/logs/<run name>.json` (return code, seconds, command, attempt, log).
A run whose record says it finished (return code 0) is not run again; any other run is, in the same
workdir, so a trainer that resumes from its checkpoints (PPO, SFT, RM, DPO) picks up where it
stopped. The sweep directory's `sweep.json` holds the expanded runs and the config file's content
hash: a second invocation must ask for the same sweep from the same config, else it is refused (a
new --sweep_dir keeps both).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from ppo_jax.config import ConfigError
from ppo_jax.sweep.spec import Run

MANIFEST = "sweep.json"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one run ended: return code (0 = finished; None = not run), wall seconds, the last line it
    printed (its `done: ...` or `error: ...`), and whether this invocation ran it."""

    run: Run
    returncode: int | None
    seconds: float
    last_line: str
    ran_now: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_dir(sweep_dir: str, run: Run) -> str:
    return os.path.join(sweep_dir, "runs", run.name)


def record_path(sweep_dir: str, run: Run) -> str:
    """The record of the run's latest attempt (how it ended), beside its logs."""
    return os.path.join(sweep_dir, "logs", run.name + ".json")


def attempt_log_path(sweep_dir: str, run: Run, attempt: int) -> str:
    """The output of the run's `attempt`-th process (1, 2, ...: each resume is one more)."""
    return os.path.join(sweep_dir, "logs", f"{run.name}.attempt-{attempt}.log")


def next_attempt(sweep_dir: str, run: Run) -> int:
    """1 + the attempts whose logs are there: a new attempt never writes over an earlier one's log."""
    attempt = 1
    while os.path.exists(attempt_log_path(sweep_dir, run, attempt)):
        attempt += 1
    return attempt


def config_sha256(config_spec: str) -> str:
    """The content hash of a config file (`path.py` or `path.py:arg`): a sweep resumed after its file
    was edited would mix runs of two configs under one table. (What the file imports is not hashed.)"""
    with open(config_spec.partition(":")[0], "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_manifest(sweep_dir: str, manifest: dict) -> None:
    """Records the sweep (trainer, config, its `config_sha256`, overrides, runs) or checks that it is
    the one recorded; a config file edited since is refused by name."""
    path = os.path.join(sweep_dir, MANIFEST)
    if os.path.exists(path):
        with open(path) as f:
            recorded = json.load(f)
        if "config_sha256" not in recorded:  # recorded before the sweep hashed its config
            manifest = {k: v for k, v in manifest.items() if k != "config_sha256"}
        if recorded.get("config_sha256") != manifest.get("config_sha256") and recorded.get("config") == manifest.get("config"):
            raise ConfigError(f"the config file {manifest['config']} changed since this sweep started (its sha256 "
                              f"is recorded in {path}): resuming would mix two configs in one table; restore the "
                              "file, or use a new --sweep_dir")
        if recorded != manifest:
            changed = sorted(k for k in set(recorded) | set(manifest) if recorded.get(k) != manifest.get(k))
            raise ConfigError(f"--sweep_dir={sweep_dir} holds another sweep ({', '.join(changed)} differ from "
                              f"{path}); resume it with the same flags, or use a new --sweep_dir")
        return
    os.makedirs(sweep_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(path + ".tmp", path)


def recorded_outcome(sweep_dir: str, run: Run) -> Outcome:
    """The run's outcome as its record says (returncode None: never ran, or was interrupted)."""
    path = record_path(sweep_dir, run)
    if not os.path.exists(path):
        return Outcome(run, None, 0.0, "")
    with open(path) as f:
        record = json.load(f)
    return Outcome(run, record["returncode"], record["seconds"], record["last_line"])


def _last_line(log_path: str) -> str:
    with open(log_path, errors="replace") as f:
        lines = [line.strip() for line in f.read().splitlines()[-200:] if line.strip()]
    done = [line for line in lines if line.startswith(("done:", "error:", "already complete:"))]
    return (done or lines or [""])[-1][:300]


@dataclasses.dataclass
class _Running:
    """A run's process while it runs: the slot (and so the environment) it holds, when it started, its
    open log, its argv and which attempt it is."""

    process: subprocess.Popen
    slot: int
    start: float
    log: object
    argv: list[str]
    attempt: int


def run_sweep(runs: Sequence[Run], sweep_dir: str, command: Callable[[Run, str], list[str]], *,
              parallel: int = 1, stop_on_failure: bool = False, slot_envs: Sequence[Mapping[str, str]] | None = None,
              report: Callable[[Outcome, int, int], None] | None = None) -> list[Outcome]:
    """Runs every run not yet finished, `parallel` at a time; returns all runs' outcomes in order.

    command(run, workdir) -> argv of the run's process. slot_envs: the environment of each of the
    `parallel` slots (`ppo_jax.sweep.devices`: each its share of the accelerators; None: this
    process's). `report(outcome, done, total)` is called as each run ends (and for each finished run
    skipped). With `stop_on_failure` no new run starts once one has failed (those running finish)."""
    if slot_envs is not None and len(slot_envs) != parallel:
        raise ValueError(f"{len(slot_envs)} slot environments for parallel={parallel}")
    outcomes = {run.index: recorded_outcome(sweep_dir, run) for run in runs}
    pending = [run for run in runs if not outcomes[run.index].ok]
    done = 0
    for run in runs:
        if outcomes[run.index].ok:
            done += 1
            if report:
                report(outcomes[run.index], done, len(runs))
    running: dict[int, _Running] = {}
    failed = False
    try:
        while pending or running:
            while pending and len(running) < parallel and not (failed and stop_on_failure):
                run = pending.pop(0)
                slot = min(set(range(parallel)) - {r.slot for r in running.values()})
                running[run.index] = _start(run, sweep_dir, command, slot, None if slot_envs is None else slot_envs[slot])
            if not running:
                break
            time.sleep(0.2)
            for index, started in list(running.items()):
                if started.process.poll() is None:
                    continue
                started.log.close()
                del running[index]
                outcome = _finish(outcomes[index].run, sweep_dir, started)
                outcomes[index] = outcome
                failed |= not outcome.ok
                done += 1
                if report:
                    report(outcome, done, len(runs))
    finally:  # Ctrl-C: stop the children too; their records stay unwritten, so they run again on resume
        for started in running.values():
            started.process.terminate()
        for started in running.values():
            started.process.wait()
    return [outcomes[run.index] for run in runs]


def _start(run: Run, sweep_dir: str, command: Callable[[Run, str], list[str]], slot: int,
           env: Mapping[str, str] | None) -> _Running:
    """Starts the run's next attempt in `slot`, its output to a log of its own."""
    os.makedirs(os.path.join(sweep_dir, "logs"), exist_ok=True)
    attempt = next_attempt(sweep_dir, run)
    log = open(attempt_log_path(sweep_dir, run, attempt), "w")
    argv = command(run, run_dir(sweep_dir, run))
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=None if env is None else dict(env))
    return _Running(process, slot, time.perf_counter(), log, argv, attempt)


def _finish(run: Run, sweep_dir: str, started: _Running) -> Outcome:
    """The ended attempt's outcome, recorded beside its log."""
    log = attempt_log_path(sweep_dir, run, started.attempt)
    outcome = Outcome(run, started.process.returncode, time.perf_counter() - started.start, _last_line(log),
                      ran_now=True)
    _write_record(record_path(sweep_dir, run), outcome, started.argv, attempt=started.attempt, log=log)
    return outcome


def _write_record(path: str, outcome: Outcome, argv: list[str], *, attempt: int, log: str) -> None:
    record = {"returncode": outcome.returncode, "seconds": round(outcome.seconds, 2),
              "last_line": outcome.last_line, "command": argv, "attempt": attempt, "log": os.path.basename(log)}
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=2)
    os.replace(path + ".tmp", path)


def trainer_command(module: str, config_file: str | None, base_overrides: Sequence[str]
                    ) -> Callable[[Run, str], list[str]]:
    """argv of one run: `python -m <module> [--config=FILE] --workdir=DIR <base overrides> <the run's>`."""
    def command(run: Run, workdir: str) -> list[str]:
        config = [f"--config={config_file}"] if config_file else []
        return [sys.executable, "-m", module, *config, f"--workdir={workdir}", *base_overrides, *run.overrides()]

    return command
