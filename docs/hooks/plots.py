"""The pictures of the docs, drawn from the committed JSON (matplotlib, no display) into docs/img/ by
`generated.py`, which records in each PNG the digest of the files it read.

Each function returns PNG bytes; `PLOTS` maps the name a page links to (`img/<name>`) to its function. Nothing
here is typed in: every point is a row of a committed JSON file (read through `figures.rows`).
"""

from __future__ import annotations

import io
from typing import Callable

import figures
from figures import (
    AS_SAVED,
    ATTENTION,
    ATTENTION_DECODE,
    ATTENTION_QUERY_ROUTER,
    LC_SPEED,
    MODEL_STEPS,
    MODEL_STEPS_STATIC,
)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    _pyplot().close(figure)
    return buffer.getvalue()


def _tokens(count: float, _position: object = None) -> str:
    return f"{count / 1024:g}K" if count >= 1024 else f"{count:g}"


def _lengths(axis, label: str) -> None:
    from matplotlib.ticker import FuncFormatter

    axis.set_xscale("log", base=2)
    axis.xaxis.set_major_formatter(FuncFormatter(_tokens))
    axis.set_xlabel(label)
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.grid(alpha=0.3, which="both")


def attention_speed() -> bytes:
    """One attention layer: prefill speedup over dense SDPA by length (per routing and top-k), decoding by cache."""
    from matplotlib.ticker import FuncFormatter

    plt = _pyplot()
    figure, (prefill, decode) = plt.subplots(1, 2, figsize=(11, 4.2))
    for path, routing, style in ((ATTENTION, "own group", "-"), (ATTENTION_QUERY_ROUTER, "query router", "--")):
        for top_k, color in ((1, "tab:blue"), (2, "tab:orange")):
            points = sorted((r["seq_len"], r["speedup"]) for r in figures.rows(path) if r["top_k"] == top_k)
            prefill.plot(*zip(*points), style, marker="o", color=color, label=f"top-{top_k}, {routing}")
    ideal = sorted((r["seq_len"], r["ideal_speedup"]) for r in figures.rows(ATTENTION) if r["top_k"] == 1)
    prefill.plot(*zip(*ideal), ":", color="grey", label="top-1 ideal (pair count)")
    _lengths(prefill, "tokens")
    prefill.set_ylabel("speedup over dense causal SDPA")
    prefill.set_title("prefill (one layer, K=8, w=128)", fontsize=10)
    prefill.legend(fontsize=8)
    for top_k, color in ((1, "tab:blue"), (2, "tab:orange")):
        points = sorted((r["cache_len"], r["speedup"]) for r in figures.rows(ATTENTION_DECODE) if r["top_k"] == top_k)
        decode.plot(*zip(*points), marker="o", color=color, label=f"top-{top_k}, one new token")
    _lengths(decode, "tokens in the KV cache")
    decode.set_yscale("log", base=2)
    decode.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}x"))
    decode.set_title("decoding (one layer, K=8, w=128)", fontsize=10)
    decode.legend(fontsize=8)
    first = figures.rows(ATTENTION)[0]
    figure.suptitle(f"{first['processor']}, {first['threads']} threads, {first['dtype']}, backend auto", fontsize=9)
    figure.tight_layout()
    return _png(figure)


def model_speed() -> bytes:
    """SmolLM2-135M with the committed adapter: prefill speedup by prompt length, and decoding steps."""
    plt = _pyplot()
    figure, (prefill, decode) = plt.subplots(1, 2, figsize=(11, 4.2))
    points = sorted((r["seq_len"], r["speedup"]) for r in figures.rows(LC_SPEED) if r["variant"] == AS_SAVED)
    prefill.plot(*zip(*points), marker="o", color="tab:blue", label="committed adapter (as saved)")
    _lengths(prefill, "prompt tokens")
    prefill.set_ylabel("speedup over the base model")
    prefill.set_title("prefill (whole model)", fontsize=10)
    prefill.legend(fontsize=8)
    for path, cache, color in ((MODEL_STEPS, "dynamic", "tab:blue"), (MODEL_STEPS_STATIC, "static", "tab:green")):
        points = sorted((r["prompt_len"], r["speedup"]) for r in figures.rows(path) if r["variant"].startswith("Focus"))
        decode.plot(*zip(*points), marker="o", color=color, label=f"{cache} KV cache")
    _lengths(decode, "prompt tokens")
    decode.set_title("decoding steps after a prompt (whole model)", fontsize=10)
    decode.legend(fontsize=8)
    figure.suptitle("SmolLM2-135M-Instruct, CPU, 2 threads", fontsize=9)
    figure.tight_layout()
    return _png(figure)


def tradeoff() -> bytes:
    """Perplexity against the share of attention pairs computed, at 8K tokens: Focus settings and baselines."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(9, 5))
    rows = figures.ppl_rows(seq_len=8192, data="python-docs")
    top = 1.16  # window + sinks alone loses far more: drawn at the top edge
    styles = {
        "focus": ("o", "tab:blue", "Focus (distilled adapter, fixed top-k)"),
        "blocks": ("^", "tab:purple", "block selection (training-free)"),
        "streaming": ("s", "tab:red", "window + sinks (training-free)"),
        "dense": ("*", "black", "dense"),
    }
    labelled = set()
    adaptive: dict[tuple, list[dict]] = {}
    for row in rows:
        if row.get("probe_mass") is not None:
            adaptive.setdefault((row["window"], len(row["dense_heads"]), row["top_k"]), []).append(row)
            continue
        marker, color, label = styles[row["kind"]]
        saved = row["variant"] == AS_SAVED
        axis.plot(
            row["density"],
            min(row["ppl_ratio"], top),
            marker,
            color="tab:green" if saved else color,
            markersize=12 if saved else 8,
            label="committed adapter" if saved else (None if row["kind"] in labelled else label),
        )
        labelled.add(row["kind"])
        if row["ppl_ratio"] > top:
            axis.annotate(
                f"off scale: {row['ppl_ratio']:.2f}x",
                (row["density"], top),
                fontsize=7,
                xytext=(6, -4),
                textcoords="offset points",
            )
    for (window, dense, top_k), points in sorted(adaptive.items()):
        if top_k != 2:
            continue
        points.sort(key=lambda r: r["probe_mass"])
        axis.plot(
            [r["density"] for r in points],
            [r["ppl_ratio"] for r in points],
            ".-",
            color="tab:cyan",
            label="Focus, adaptive probing" if "adaptive" not in labelled else None,
        )
        labelled.add("adaptive")
    axis.set_xscale("log")
    axis.set_ylim(0.99, top + 0.01)
    axis.set_xlabel("share of causal attention pairs computed (log)")
    axis.set_ylabel("perplexity / dense perplexity")
    axis.set_title("SmolLM2-135M-Instruct, python-docs held-out, 8,192 tokens", fontsize=10)
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)
    figure.tight_layout()
    return _png(figure)


PLOTS: dict[str, Callable[[], bytes]] = {
    "attention_speed.png": attention_speed,
    "model_speed.png": model_speed,
    "tradeoff.png": tradeoff,
}
