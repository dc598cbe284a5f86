"""The JSON items of a step (`extra` and `metrics`): checked before a save starts, so a bad value never
leaves a half-written step."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

def _first_non_json(value, path="") -> str | None:
    """Path of the first value json cannot encode, or None."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{path}[{k!r}] (keys must be strings)"
            found = _first_non_json(v, f"{path}[{k!r}]")
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _first_non_json(v, f"{path}[{i}]")
            if found:
                return found
        return None
    if value is None or isinstance(value, (str, bool, int, float)):
        return None
    return f"{path} ({type(value).__name__})"


def check_extra(extra) -> dict:
    if not isinstance(extra, Mapping):
        raise TypeError(
            f"checkpoint `extra` must be a dict of JSON values, got {type(extra).__name__}")
    bad = _first_non_json(extra)
    if bad:
        raise TypeError(
            f"checkpoint `extra` holds a value JSON cannot store at extra{bad}; convert it to "
            "int/float/str/bool/list/dict (e.g. int(x), x.tolist()) or save arrays in the state")
    return dict(extra)


def check_metrics(metrics, best_metric: str | None) -> dict | None:
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"checkpoint `metrics` must be a dict name -> number, got {type(metrics).__name__}")
    clean = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise TypeError(f"checkpoint metric names must be strings, got {name!r}")
        try:
            clean[name] = float(np.asarray(value).item())
        except (TypeError, ValueError):
            raise TypeError(
                f"checkpoint metric {name!r} must be a scalar number, got {type(value).__name__}"
            ) from None
    if best_metric is not None and best_metric not in clean:
        raise KeyError(
            f"checkpoint metrics lack the tracked best metric {best_metric!r} (have "
            f"{sorted(clean)}); pass it, or pass metrics=None for a checkpoint that only counts "
            "as recent")
    return clean
