"""Plot Focus-vs-dense attention speedup against sequence length from `focus-hf bench --json` files.

    python benchmarks/attention_plot.py RESULTS.json [MORE.json ...] --out benchmarks/results/attention_speedup.png

Needs matplotlib (`pip install focus-hf[bench]`). One line per (file, top_k) with measured speedups; dashed lines
show the ideal speedup (causal pairs / allowed pairs) of the same routing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="JSON files written by focus-hf bench --json")
    parser.add_argument("--out", required=True, help="PNG path")
    args = parser.parse_args()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for path in args.results:
        rows = json.loads(Path(path).read_text())
        for top_k in sorted({row["top_k"] for row in rows}):
            mine = sorted((row for row in rows if row["top_k"] == top_k), key=lambda row: row["seq_len"])
            label = f"top-{top_k}, {mine[0]['threads']} thread{'s' if mine[0]['threads'] > 1 else ''}"
            timed = [row for row in mine if row["speedup"] is not None]
            line = axis.plot([row["seq_len"] for row in timed], [row["speedup"] for row in timed], marker="o", label=label)
            axis.plot(
                [row["seq_len"] for row in mine],
                [row["ideal_speedup"] for row in mine],
                linestyle="--",
                color=line[0].get_color(),
                alpha=0.5,
            )
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("sequence length (tokens)")
    axis.set_ylabel("speedup over dense causal SDPA")
    first = json.loads(Path(args.results[0]).read_text())[0]
    axis.set_title(
        f"Focus hard attention, K={first['groups']}, w={first['window']}, {first['sinks']} sinks, "
        f"{first['heads']}x{first['head_dim']} heads / {first['kv_heads']} kv, {first['dtype']}\n"
        f"{first['device']}; dashed: ideal (causal pairs / allowed pairs)",
        fontsize=9,
    )
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
