"""The group-balance chart of an interpretability report: per layer, the share of tokens each Focus group routes.

Written as `group_balance.png` next to `interpretability.json` by `focus-hf inspect --out` and by `focus-hf card`,
which embeds it in the model card. A heatmap (layers x groups) coloured by share relative to a perfectly balanced
routing (1/K of the tokens per group), next to bars of each layer's largest group share with the 1/K line:
Sinkhorn balancing that failed shows up as one dark red column or bars far right of the line.

matplotlib is optional (`pip install "focus-hf[card]"`); without it `write_balance_chart` returns None and callers
leave the chart out.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any, Optional

BALANCE_CHART_NAME = "group_balance.png"
MATPLOTLIB_HINT = 'pip install "focus-hf[card]"'
_MAX_ANNOTATED_CELLS = 320  # above this the percentages in the cells become unreadable


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (checked without importing it)."""
    return importlib.util.find_spec("matplotlib") is not None


def balance_matrix(report: Any) -> tuple[list[Any], list[list[Optional[float]]]]:
    """Layer labels and, per layer, the token share of each of its K groups (None where a share is missing).

    Reads the `layers[].groups[].share` entries of a `focus_hf.interpret.report.inspect_groups` report (or its JSON);
    K is
    the layer's `num_groups` when given, else one more than its highest group number. Layers without any numeric
    share are skipped, so a partial or hand-written report gives a partial chart. Returns ([], []) when there is
    nothing to draw. Rows keep their own length (layers may differ in K).
    """
    if not isinstance(report, dict):
        return [], []
    labels: list[Any] = []
    rows: list[list[Optional[float]]] = []
    for layer in report.get("layers") or []:
        if not isinstance(layer, dict):
            continue
        shares: dict[int, float] = {}
        for group in layer.get("groups") or []:
            share = group.get("share") if isinstance(group, dict) else None
            index = group.get("group") if isinstance(group, dict) else None
            if (
                isinstance(index, int)
                and index >= 0
                and isinstance(share, (int, float))
                and not isinstance(share, bool)
            ):
                shares[index] = float(share)
        if not shares:
            continue
        declared = layer.get("num_groups")
        num_groups = max(declared if isinstance(declared, int) else 0, max(shares) + 1)
        labels.append(layer.get("layer", len(labels)))
        rows.append([shares.get(g) for g in range(num_groups)])
    return labels, rows


def write_balance_chart(report: Any, path: str | os.PathLike, *, title: Optional[str] = None) -> Optional[Path]:
    """Draw the group-balance chart of `report` into the PNG file `path` and return the path.

    Returns None (writing nothing) when matplotlib is not installed or the report holds no group shares.
    Rendering uses the Agg canvas directly, so it needs no display and leaves pyplot's global state alone.
    """
    labels, rows = balance_matrix(report)
    if not rows or not matplotlib_available():
        return None
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    width = max(len(row) for row in rows)
    shares = np.array([[math.nan if s is None else s for s in row] + [math.nan] * (width - len(row)) for row in rows])
    # share x K is 1 for a perfectly balanced routing, whatever a layer's K.
    groups_per_layer = np.array([len(row) for row in rows], dtype=float)
    ratio = shares * groups_per_layer[:, None]
    n_layers, n_groups = shares.shape
    top = float(np.nanmax(ratio)) if np.isfinite(ratio).any() else 1.0

    height = min(2.0 + 0.28 * n_layers, 30.0)
    figure = Figure(figsize=(10, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    heat_axes, bar_axes = figure.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [max(n_groups, 3), 3]})

    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(top, 2.0))
    colours = heat_axes.imshow(
        np.ma.masked_invalid(ratio), aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest"
    )
    heat_axes.set_facecolor("#d9d9d9")  # layers with fewer groups: grey cells
    heat_axes.set_xticks(range(n_groups), [str(g) for g in range(n_groups)])
    heat_axes.set_yticks(range(n_layers), [str(label) for label in labels])
    heat_axes.set_xlabel("group")
    heat_axes.set_ylabel("layer")
    heat_axes.set_title("share of tokens per group (white = 1/K, balanced)", fontsize=10)
    if n_layers * n_groups <= _MAX_ANNOTATED_CELLS:
        for (row, column), value in np.ndenumerate(shares):
            if math.isfinite(value):
                shade = float(norm(ratio[row, column]))
                heat_axes.text(column, row, f"{value:.0%}", ha="center", va="center", fontsize=7,
                               color="white" if shade < 0.2 or shade > 0.8 else "black")  # fmt: skip
    bar = figure.colorbar(colours, ax=heat_axes, location="bottom", shrink=0.8, aspect=40, pad=0.02)
    # The two halves of the scale differ (0..1 vs 1..max): ticks on both, or the lower half shows only "0".
    upper = norm.vmax
    bar.set_ticks([0.0, 0.5, 1.0, round(1 + (upper - 1) / 2, 1), round(upper, 1)])
    bar.set_label("share of tokens \u00f7 1/K  (1 = balanced, 0 = empty group)", fontsize=9)

    largest = np.nanmax(shares, axis=1)
    bar_axes.barh(range(n_layers), largest, color="#b2182b", height=0.7)
    for row, groups in enumerate(groups_per_layer):
        bar_axes.plot([1 / groups] * 2, [row - 0.45, row + 0.45], color="black", linestyle="--", linewidth=1)
    bar_axes.set_xlim(0, 1)
    bar_axes.xaxis.set_major_formatter(lambda value, _: f"{value:.0%}")
    bar_axes.set_xlabel("largest group's share")
    bar_axes.set_title("dominance per layer\n(dashed: 1/K, balanced)", fontsize=10)
    figure.suptitle(title or "Focus group balance", fontsize=12)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # No "Software" (matplotlib version) entry: the same report gives the same bytes, so a re-push uploads nothing.
    figure.savefig(path, format="png", metadata={"Software": None})
    return path
