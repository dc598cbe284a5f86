"""A sweep's results: each run's final metrics and learning curves, pooled over seeds into a mean and
a 95% confidence interval per point, written as CSV and Markdown.

A final metric `m` is read from the run's `summary.json` (dotted keys reach nested values:
`seconds.total`), else from the last row of its metrics log that holds `m`. The interval is
Student's t over the seeds: mean ± t(0.975, n - 1) · s / √n, s the sample standard deviation; one
seed gives no interval.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from collections.abc import Sequence

import numpy as np

from ppo_jax.sweep.runner import Outcome, run_dir

SUMMARY = "summary.json"


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One run's final metrics (NaN where it has none) and learning curves: metric -> (steps, values)."""

    outcome: Outcome
    final: dict[str, float]
    curves: dict[str, tuple[np.ndarray, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Stat:
    """A metric over the seeds of one point: mean, the half-width of its 95% interval (NaN for one
    seed), and how many seeds had it."""

    mean: float
    half_width: float
    n: int

    def text(self, digits: int = 4) -> str:
        if self.n == 0:
            return "–"
        if math.isnan(self.half_width):
            return f"{self.mean:.{digits}g}"
        return f"{self.mean:.{digits}g} ± {self.half_width:.2g}"


@dataclasses.dataclass(frozen=True)
class PointRow:
    """One row of the table: a point, its seeds' runs (how many finished), and each metric's Stat."""

    label: str
    point: tuple[tuple[str, str], ...]
    runs: int
    finished: int
    stats: dict[str, Stat]
    failures: tuple[str, ...]  # "<run name>: <its last line>" for each failed run


def read_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut short by a kill: the rows before it stand
                    continue
    return rows


def _summary_value(summary: dict, dotted: str) -> float | None:
    node = summary
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def read_run(sweep_dir: str, outcome: Outcome, metrics: Sequence[str], log_file: str,
             curves: Sequence[str] = ()) -> RunResult:
    """Its final `metrics` and the learning curves of the logged metrics `curves`."""
    workdir = run_dir(sweep_dir, outcome.run)
    summary_path = os.path.join(workdir, SUMMARY)
    summary = {}
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
    rows = read_log(os.path.join(workdir, log_file))
    final = {}
    for metric in metrics:
        value = _summary_value(summary, metric)
        if value is None:
            values = [row[metric] for row in rows if isinstance(row.get(metric), (int, float))]
            value = float(values[-1]) if values else math.nan
        final[metric] = value if outcome.ok else math.nan  # a failed run's numbers are not results
    curve_of = {}
    for metric in curves:
        points = [(row["step"], row[metric]) for row in rows
                  if "step" in row and isinstance(row.get(metric), (int, float))]
        if points:
            steps, values = zip(*points)
            curve_of[metric] = (np.asarray(steps), np.asarray(values, np.float64))
    return RunResult(outcome, final, curve_of)


def stat(values: Sequence[float]) -> Stat:
    """Mean and 95% t-interval half-width of the finite values."""
    from scipy import stats  # (scipy comes with jax)

    x = np.asarray([v for v in values if math.isfinite(v)], np.float64)
    if x.size == 0:
        return Stat(math.nan, math.nan, 0)
    if x.size == 1:
        return Stat(float(x[0]), math.nan, 1)
    half = stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
    return Stat(float(x.mean()), float(half), int(x.size))


def aggregate(results: Sequence[RunResult], metrics: Sequence[str]) -> list[PointRow]:
    """Rows in the order the points first appear, each pooling its seeds."""
    groups: dict[tuple, list[RunResult]] = {}
    for result in results:
        groups.setdefault(result.outcome.run.point, []).append(result)
    rows = []
    for point, group in groups.items():
        failures = tuple(f"{r.outcome.run.name}: {r.outcome.last_line or 'exit ' + str(r.outcome.returncode)}"
                         for r in group if r.outcome.returncode not in (0, None))
        rows.append(PointRow(label=group[0].outcome.run.label, point=point, runs=len(group),
                             finished=sum(r.outcome.ok for r in group),
                             stats={m: stat([r.final[m] for r in group]) for m in metrics}, failures=failures))
    return rows


def write_tables(rows: Sequence[PointRow], metrics: Sequence[str], fields: Sequence[str], sweep_dir: str
                 ) -> tuple[str, str]:
    """results.csv (one column per swept field; mean, ci95 and n per metric) and results.md (mean ± CI).
    Returns their paths."""
    csv_path, md_path = os.path.join(sweep_dir, "results.csv"), os.path.join(sweep_dir, "results.md")
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*fields, "runs", "finished",
                         *[f"{m}{suffix}" for m in metrics for suffix in ("_mean", "_ci95", "_n")]])
        for row in rows:
            values = dict(row.point)
            writer.writerow([values.get(field, "") for field in fields] + [row.runs, row.finished]
                            + [x for m in metrics for x in (row.stats[m].mean, row.stats[m].half_width, row.stats[m].n)])
    lines = ["| " + " | ".join([*fields, "finished", *metrics]) + " |",
             "|" + "---|" * (len(fields) + 1) + "---:|" * len(metrics)]
    for row in rows:
        values = dict(row.point)
        lines.append("| " + " | ".join([*(values.get(field, "") for field in fields), f"{row.finished}/{row.runs}",
                                         *(row.stats[m].text() for m in metrics)]) + " |")
    failures = [failure for row in rows for failure in row.failures]
    note = ("\nMean ± half-width of the 95% confidence interval (Student's t) over each point's finished "
            "seeds.\n")
    if failures:
        note += "\nFailed runs (not in the means):\n" + "".join(f"- {failure}\n" for failure in failures)
    with open(md_path, "w") as f:
        f.write("\n".join(lines) + "\n" + note)
    return csv_path, md_path
