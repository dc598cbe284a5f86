"""Runs a sweep's processes, one after another or N at a time, and resumes an interrupted sweep.

Each run is its trainer's command line in its own workdir (`<sweep_dir>/runs/<run name>`, which the
trainer creates: the sweep writes nothing into it, so a trainer that wants an empty or its own
directory gets one), its output in `<sweep_dir>/logs/<run name>.log`, its outcome in
`<sweep_dir>/logs/<run name>.json` (return code, seconds, command).
A run whose record says it finished (return code 0) is not run again; any other run is, in the same
workdir, so a trainer that resumes from its checkpoints (PPO, SFT, RM, DPO) picks up where it
stopped. The sweep directory's `sweep.json` holds the expanded runs: a second invocation must ask for
the same sweep, else it is refused (a new --sweep_dir keeps both).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

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


def log_path(sweep_dir: str, run: Run, suffix: str = ".log") -> str:
    """The run's output (".log") or outcome record (".json"), beside its workdir."""
    return os.path.join(sweep_dir, "logs", run.name + suffix)


def write_manifest(sweep_dir: str, manifest: dict) -> None:
    """Records the sweep (trainer, config, overrides, runs) or checks that it is the one recorded."""
    path = os.path.join(sweep_dir, MANIFEST)
    if os.path.exists(path):
        with open(path) as f:
            recorded = json.load(f)
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
    path = log_path(sweep_dir, run, ".json")
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


def run_sweep(runs: Sequence[Run], sweep_dir: str, command: Callable[[Run, str], list[str]], *,
              parallel: int = 1, stop_on_failure: bool = False, env: dict | None = None,
              report: Callable[[Outcome, int, int], None] | None = None) -> list[Outcome]:
    """Runs every run not yet finished, `parallel` at a time; returns all runs' outcomes in order.

    command(run, workdir) -> argv of the run's process. `report(outcome, done, total)` is called as
    each run ends (and for each finished run skipped). With `stop_on_failure` no new run starts once
    one has failed (those running finish)."""
    outcomes = {run.index: recorded_outcome(sweep_dir, run) for run in runs}
    pending = [run for run in runs if not outcomes[run.index].ok]
    done = 0
    for run in runs:
        if outcomes[run.index].ok:
            done += 1
            if report:
                report(outcomes[run.index], done, len(runs))
    running: dict[int, tuple[subprocess.Popen, float, str, object]] = {}
    failed = False
    try:
        while pending or running:
            while pending and len(running) < parallel and not (failed and stop_on_failure):
                run = pending.pop(0)
                os.makedirs(os.path.join(sweep_dir, "logs"), exist_ok=True)
                log = open(log_path(sweep_dir, run), "w")
                argv = command(run, run_dir(sweep_dir, run))
                process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
                running[run.index] = (process, time.perf_counter(), log, argv)
            if not running:
                break
            time.sleep(0.2)
            for index, (process, start, log, argv) in list(running.items()):
                if process.poll() is None:
                    continue
                log.close()
                del running[index]
                run = outcomes[index].run
                outcome = Outcome(run, process.returncode, time.perf_counter() - start,
                                  _last_line(log_path(sweep_dir, run)), ran_now=True)
                _write_record(log_path(sweep_dir, run, ".json"), outcome, argv)
                outcomes[index] = outcome
                failed |= not outcome.ok
                done += 1
                if report:
                    report(outcome, done, len(runs))
    finally:  # Ctrl-C: stop the children too; their records stay unwritten, so they run again on resume
        for process, *_ in running.values():
            process.terminate()
        for process, *_ in running.values():
            process.wait()
    return [outcomes[run.index] for run in runs]


def _write_record(path: str, outcome: Outcome, argv: list[str]) -> None:
    record = {"returncode": outcome.returncode, "seconds": round(outcome.seconds, 2),
              "last_line": outcome.last_line, "command": argv}
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
