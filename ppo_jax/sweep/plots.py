"""A sweep's figures: learning curves (each point's mean over seeds with its 95% band) and, per swept
field, each final metric against the field's values (one series per setting of the other fields)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np

from ppo_jax.figures import panels, save
from ppo_jax.sweep.results import PointRow, RunResult, stat


def mean_curve(curves: Sequence[tuple[np.ndarray, np.ndarray]]):
    """(steps, mean, half-width) over the seeds' curves, on the steps every seed logged."""
    common = sorted(set.intersection(*(set(steps.tolist()) for steps, _ in curves)))
    if not common:
        return None
    table = np.asarray([[dict(zip(steps.tolist(), values))[s] for s in common] for steps, values in curves])
    stats = [stat(table[:, i]) for i in range(len(common))]
    return (np.asarray(common), np.asarray([s.mean for s in stats]),
            np.nan_to_num(np.asarray([s.half_width for s in stats])))


def plot_curves(results: Sequence[RunResult], metrics: Sequence[str], path: str | None = None):
    """One panel per metric: each point's mean curve over its finished seeds, with its 95% band."""
    fig, axes = panels(len(metrics), (5.0, 3.6))
    groups: dict[str, list[RunResult]] = {}
    for result in results:
        if result.outcome.ok:
            groups.setdefault(result.outcome.run.short_label, []).append(result)
    for ax, metric in zip(axes, metrics):
        for label, group in groups.items():
            curves = [r.curves[metric] for r in group if metric in r.curves]
            curve = mean_curve(curves) if curves else None
            if curve is None:
                continue
            steps, mean, half = curve
            (line,) = ax.plot(steps, mean, label=f"{label} (n={len(curves)})")
            ax.fill_between(steps, mean - half, mean + half, color=line.get_color(), alpha=0.2)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if axes and axes[0].lines:  # one legend under the panels, as many columns as the labels' width allows
        handles, labels = axes[0].get_legend_handles_labels()
        width, height = fig.get_size_inches()
        label_inches = 0.06 * max(map(len, labels)) + 0.6  # a fontsize-8 character is ~0.06 in, plus the swatch
        ncol = max(1, min(len(labels), 3, int(width // label_inches)))
        fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
        legend_inches = 0.17 * math.ceil(len(labels) / ncol) + 0.15
        fig.set_size_inches(width, height + legend_inches)  # the panels keep their height
        fig.tight_layout(rect=(0, legend_inches / (height + legend_inches), 1, 1))
    else:
        fig.tight_layout()
    save(fig, path)
    return fig


def _number(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def plot_field(rows: Sequence[PointRow], field: str, metrics: Sequence[str], path: str | None = None):
    """Each final metric against the values of `field` (mean ± 95% interval), one series per setting
    of the other swept fields: a line over numeric values, points over named ones."""
    fig, axes = panels(len(metrics), (4.5, 3.4))
    series: dict[str, list[PointRow]] = {}
    for row in rows:
        rest = ", ".join(f"{f}={v}" for f, v in row.point if f != field) or field
        series.setdefault(rest, []).append(row)
    values = list(dict.fromkeys(dict(row.point)[field] for row in rows))
    numeric = all(_number(v) is not None for v in values)
    for ax, metric in zip(axes, metrics):
        for name, group in series.items():
            xs = [dict(r.point)[field] for r in group]
            x = [_number(v) for v in xs] if numeric else [values.index(v) for v in xs]
            mean = [r.stats[metric].mean for r in group]
            half = np.nan_to_num([r.stats[metric].half_width for r in group])
            ax.errorbar(x, mean, yerr=half, fmt="o-" if numeric else "o", capsize=3, label=name)
        if not numeric:
            ax.set_xticks(range(len(values)), values, rotation=20)
        ax.set_xlabel(field)
        ax.set_title(metric)
        ax.grid(alpha=0.3)
    if len(series) > 1 and axes:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    save(fig, path)
    return fig


def plot_sweep(results: Sequence[RunResult], rows: Sequence[PointRow], metrics: Sequence[str],
               curves: Sequence[str], fields: Sequence[str], sweep_dir: str) -> list[str]:
    """curves.png (the logged `curves` that some run has) and summary_<field>.png (the final
    `metrics`) per swept field under `sweep_dir`/plots; their paths."""
    directory = os.path.join(sweep_dir, "plots")
    paths = []
    logged = [m for m in curves if any(m in r.curves for r in results)]
    if logged:
        paths.append(os.path.join(directory, "curves.png"))
        plot_curves(results, logged, paths[0])
    for field in fields:
        paths.append(os.path.join(directory, f"summary_{field.replace('/', '_')}.png"))
        plot_field(rows, field, metrics, paths[-1])
    return paths
