"""`ppo-jax-sweep` (`python -m ppo_jax.cli.sweep`): a trainer over a grid of config values × seeds, one
process per run, then a table (mean ± 95% CI over seeds) and plots.

    ppo-jax-sweep --trainer=ppo --config=configs/ppo_toy.py --sweep_dir=runs/kl \\
        --grid=ppo.kl_coef=0.01,0.05,0.1 --grid=ppo.advantage_estimator=gae,grpo --seeds=3 \\
        --parallel=2 --config.train.iterations=20

Every `--config.<field>=<value>` applies to every run; each `--grid=FIELD=V1,V2,...` is a swept field
(the runs are the product of their values, or with --zip their i-th values together) and --seeds the
seeds (a count or a list). Each run is the trainer's own command in `<sweep_dir>/runs/<name>`; the
same command again resumes the sweep (finished runs are kept, the others run again and resume from
their checkpoints; a rerun's log is a new attempt-<k>.log, and an edited config file is refused).
Results: `<sweep_dir>/results.csv`, `results.md`, `plots/`. Bad specs are one
`error:` line before anything runs; a failed run is reported in the table and the sweep goes on
(unless --stop_on_failure), exiting 1 at the end.

A sweep schedules processes on this machine. Multi-host runs are launched, not nested: run each
point with `tpu_scripts/launch.sh` (or a cluster scheduler) with the same overrides, one workdir per
run, and this command's table over them (`--dry_run` prints every run's overrides).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from absl import app, flags

from ppo_jax.cli.common import fail, help_and_exit, wants_help
from ppo_jax.config import ConfigError
from ppo_jax.config_file import load_config
from ppo_jax.sweep import devices, plots, results, runner, spec

TRAINER = flags.DEFINE_enum("trainer", None, sorted(spec.TRAINERS), "What each run runs.")
CONFIG = flags.DEFINE_string("config", None, "The trainer's config file (the demo's own when not given).")
SWEEP_DIR = flags.DEFINE_string("sweep_dir", None, "One directory for the sweep: runs/, results and plots.")
GRID = flags.DEFINE_multi_string("grid", [], "FIELD=V1,V2,...: a swept config field (repeat for more fields).")
ZIP = flags.DEFINE_bool("zip", False, "Take the --grid fields' i-th values together (a list of points) "
                        "instead of every combination.")
SEEDS = flags.DEFINE_string("seeds", "3", "Seeds per point: a count (3: seeds 0, 1, 2) or a list (0,4,7).")
PARALLEL = flags.DEFINE_integer("parallel", 1, "Runs at a time, each a whole process: they share the CPU cores; "
                                "on GPUs each gets its own GPUs, or a share of one GPU's memory when there are fewer "
                                "GPUs than runs; refused on a TPU host (one process opens its chips).", lower_bound=1)
METRICS = flags.DEFINE_list("metrics", None, "Final metrics in the table and plots (default: the trainer's "
                            "own); a summary.json key (dotted for nested values) or a metrics.jsonl name.")
CURVES = flags.DEFINE_list("curves", None, "Logged metrics whose learning curves are plotted (default: the "
                           "trainer's own, e.g. eval/accuracy for the verifiable task).")
STOP_ON_FAILURE = flags.DEFINE_bool("stop_on_failure", False, "Start no new run after one fails.")
DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print each run's command and exit.")


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the sweep's own argv, the `--config.<field>` overrides for every run, with a separate value kept
    next to its flag)."""
    own, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config."):
            overrides.append(arg)
            if "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                overrides.append(argv[i + 1])
                i += 1
        else:
            own.append(arg)
        i += 1
    return own, overrides


def _report(outcome: runner.Outcome, done: int, total: int) -> None:
    run = outcome.run
    if not outcome.ran_now:
        print(f"[{done}/{total}] {run.name}: finished earlier, kept", flush=True)
        return
    status = "finished" if outcome.ok else f"FAILED (exit {outcome.returncode})"
    print(f"[{done}/{total}] {run.name}: {status} in {outcome.seconds:.1f} s: {outcome.last_line}", flush=True)


def run_environment(sweep_dir: str, environ=os.environ) -> dict[str, str]:
    """The runs' environment: this process's, unbuffered, and $WANDB_RUN_GROUP (unless set) the sweep's name, so a
    config with wandb.mode on groups its W&B runs by sweep."""
    group = environ.get("WANDB_RUN_GROUP") or os.path.basename(os.path.abspath(sweep_dir))
    return dict(environ, PYTHONUNBUFFERED="1", WANDB_RUN_GROUP=group)


def sweep(overrides: list[str]) -> int:
    trainer = spec.TRAINERS[TRAINER.value]
    config_file = CONFIG.value or trainer.default_config_file()
    if config_file is None:
        raise ConfigError(f"--trainer={TRAINER.value} needs --config=FILE (its config file)")
    config_file = os.path.abspath(config_file)
    config = load_config(config_file)
    axes = [spec.parse_axis(text) for text in GRID.value]
    runs = spec.expand(axes, spec.parse_seeds(SEEDS.value), zipped=ZIP.value)
    spec.check_runs(runs, config, overrides)
    metrics = tuple(METRICS.value or trainer.metrics)
    command = runner.trainer_command(trainer.module, config_file, overrides)
    if DRY_RUN.value:
        for run in runs:
            print(" ".join(command(run, runner.run_dir(SWEEP_DIR.value, run))))
        return 0
    env = run_environment(SWEEP_DIR.value)
    slot_envs, shares = devices.slot_environments(PARALLEL.value, devices.local_accelerators(env), env)
    runner.write_manifest(SWEEP_DIR.value, {"trainer": TRAINER.value, "config": config_file,
                                            "config_sha256": runner.config_sha256(config_file), "overrides": overrides,
                                            "runs": [[run.name, run.overrides()] for run in runs]})
    points = len({run.point for run in runs})
    print(f"sweep: {len(runs)} runs of {TRAINER.value} ({len(runs) // points} seeds x {points} points), "
          f"{PARALLEL.value} at a time{f' ({shares})' if shares else ''}, in {SWEEP_DIR.value}", flush=True)
    outcomes = runner.run_sweep(runs, SWEEP_DIR.value, command, parallel=PARALLEL.value,
                                stop_on_failure=STOP_ON_FAILURE.value, slot_envs=slot_envs, report=_report)
    fields = [axis.field for axis in axes]
    curves = tuple(CURVES.value or trainer.curves)
    read = [results.read_run(SWEEP_DIR.value, outcome, metrics, trainer.log, curves) for outcome in outcomes]
    rows = results.aggregate(read, metrics)
    csv_path, md_path = results.write_tables(rows, metrics, fields, SWEEP_DIR.value)
    figures = plots.plot_sweep(read, rows, metrics, curves, fields, SWEEP_DIR.value)
    with open(md_path) as f:
        print("\n" + f.read())
    print(f"results: {csv_path}, {md_path}; plots: {', '.join(figures)}")
    failed = [o for o in outcomes if not o.ok]
    if failed:
        print(f"{len(failed)} of {len(outcomes)} runs did not finish; the same command runs them again", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> None:
    own, overrides = split_overrides(list(sys.argv if argv is None else argv))
    if wants_help(own):
        help_and_exit(__doc__, "trainer")
    flags.mark_flags_as_required(["trainer", "sweep_dir"])

    def run(args):
        if len(args) > 1:
            raise app.UsageError(f"unexpected arguments {args[1:]}")
        try:
            code = sweep(overrides)
        except ConfigError as e:
            fail(str(e))
        sys.exit(code)

    app.run(run, argv=own)


if __name__ == "__main__":
    main()
