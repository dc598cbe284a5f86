"""Figures without pyplot, shared by the demo's and the sweep's plots: a Figure of panels, saved as a PNG.

No global matplotlib backend is touched (Agg renders the PNG; a notebook displays the returned Figure
inline).
"""

from __future__ import annotations

import math
import os

import numpy as np


def panels(n: int, panel_size: tuple[float, float], *, per_row: int = 3):
    """(Figure, its n Axes as a list): one row of up to `per_row` panels, more rows when n is larger;
    each panel `panel_size` inches (width, height)."""
    # Imported here, not at the top: matplotlib.figure takes one to three seconds to import on a busy
    # CPU and only drawing needs it (a `--config.plots=false` run never imports it).
    from matplotlib.figure import Figure

    rows, cols = (1, n) if n <= per_row else (math.ceil(n / per_row), per_row)
    fig = Figure(figsize=(panel_size[0] * cols, panel_size[1] * rows))
    flat = list(np.atleast_1d(fig.subplots(rows, cols)).reshape(-1))
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def save(fig, path: str | None) -> None:
    """Writes `fig` as a PNG at `path` (its directory made); nothing when path is None."""
    if path is not None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fig.savefig(path, dpi=110, bbox_inches="tight")  # nothing drawn outside the axes is cut off
