"""Recall audit: how much of the frozen model's own attention a Focus adapter's hard pattern keeps.

For every routed layer and kv head, over the queries that have keys beyond the window, the audit reports the
share of the model's attention mass (from a dense pass of the base model) that lands on keys the hard pattern
keeps: the window and sinks alone, the adapter's top-k groups on top of them, an oracle that picks the best k
groups for each query given the same key groups (no router with these key groups can keep more), and a key oracle
that keeps, for each query, as many distant keys as the adapter's probes reach but the ones with the most mass
(no selector of that density that makes one choice per layer can keep more: the gap between the two oracles is what
grouping the keys costs). Heads listed in `dense_heads` keep everything. Lost mass is where quality goes, before
any perplexity is measured.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from torch import nn

from focus_hf.attention.pattern import probed_distant_keys, probed_mask
from focus_hf.fitting.capture import capture_layers, distant_attention, query_positions
from focus_hf.tuner.controls import focus_layers


@dataclass
class HeadRecall:
    """Attention mass kept for one (layer, kv head), averaged over its query heads and the audited queries."""

    layer: int
    kv_head: int
    local: float  # window + sinks only (what StreamingLLM keeps)
    adapter: float  # local + the adapter's probed groups (1.0 for a dense head)
    oracle: float  # local + the best top-k groups per query, given the adapter's key groups
    dense: bool = False
    key_oracle: float = 0.0  # local + the best single keys, as many per query as the adapter's probes reach


@dataclass
class RecallAudit:
    """The result of `audit_recall`; `rows` holds one `HeadRecall` per (layer, kv head)."""

    top_k: int
    num_groups: int
    window: int
    sink_tokens: int
    seq_len: int
    sequences: int
    queries_per_sequence: int
    rows: list[HeadRecall] = field(default_factory=list)

    def mean(self, name: str) -> float:
        """Mean of a `HeadRecall` field over every (layer, kv head)."""
        return sum(getattr(row, name) for row in self.rows) / max(len(self.rows), 1)

    def to_dict(self) -> dict:
        summary = {name: self.mean(name) for name in ("local", "adapter", "oracle", "key_oracle")}
        return {
            **{k: v for k, v in asdict(self).items() if k != "rows"},
            "mean": summary,
            "rows": [asdict(r) for r in self.rows],
        }

    def save_json(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=1)

    def table(self) -> str:
        """A readable per-layer table (kv heads side by side) of the kept shares, in percent."""
        layers = sorted({row.layer for row in self.rows})
        heads = sorted({row.kv_head for row in self.rows})
        by_key = {(row.layer, row.kv_head): row for row in self.rows}
        header = "layer | " + " | ".join(f"kv{h} local/adapter/oracle/key oracle" for h in heads)
        lines = [header, "-" * len(header)]
        for layer in layers:
            cells = []
            for head in heads:
                row = by_key[(layer, head)]
                mark = " dense" if row.dense else ""
                cells.append(
                    f"{100 * row.local:5.1f} /{100 * row.adapter:5.1f} /{100 * row.oracle:5.1f}"
                    f" /{100 * row.key_oracle:5.1f}{mark}"
                )
            lines.append(f"{layer:5d} | " + " | ".join(cells))
        lines.append(
            f"mean  | local {100 * self.mean('local'):.1f}%  adapter top-{self.top_k} {100 * self.mean('adapter'):.1f}%"
            f"  oracle {100 * self.mean('oracle'):.1f}%  key oracle {100 * self.mean('key_oracle'):.1f}%"
        )
        return "\n".join(lines)

    def save_png(self, path: str | os.PathLike) -> None:
        """Heatmaps (layer x kv head) of the mass the adapter loses and the mass the oracle would lose."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as error:
            raise ImportError("The audit PNG needs matplotlib: pip install 'focus-hf[card]'.") from error
        layers = sorted({row.layer for row in self.rows})
        heads = sorted({row.kv_head for row in self.rows})
        grids = {name: torch.zeros(len(layers), len(heads)) for name in ("adapter", "oracle")}
        for row in self.rows:
            for name, grid in grids.items():
                grid[layers.index(row.layer), heads.index(row.kv_head)] = 100 * (1 - getattr(row, name))
        top = float(max(grid.max() for grid in grids.values())) or 1.0
        figure, axes = plt.subplots(1, 2, figsize=(2.2 + 1.1 * len(heads) * 2, 1.5 + 0.22 * len(layers)))
        titles = {"adapter": f"lost by the adapter (top-{self.top_k})", "oracle": "lost by the oracle"}
        for axis, (name, grid) in zip(axes, grids.items()):
            image = axis.imshow(grid.numpy(), aspect="auto", cmap="magma_r", vmin=0, vmax=top)
            axis.set_title(titles[name], fontsize=9)
            axis.set_xlabel("kv head")
            axis.set_ylabel("layer")
            axis.set_xticks(range(len(heads)), [str(h) for h in heads])
            axis.set_yticks(range(len(layers)), [str(layer) for layer in layers], fontsize=6)
        figure.colorbar(image, ax=list(axes), label="% of attention mass lost (queries beyond the window)")
        figure.suptitle(
            f"Focus recall audit: K={self.num_groups}, w={self.window}, {self.sink_tokens} sinks, "
            f"{self.sequences} x {self.seq_len} tokens",
            fontsize=9,
        )
        figure.savefig(path, dpi=110)
        plt.close(figure)


def _active_adapter(layer) -> str:
    name = layer._active_router()
    if name is None:
        raise ValueError("The Focus adapter is disabled; enable it before auditing it.")
    return name


@torch.no_grad()
def audit_recall(
    model: nn.Module,
    sequences: Iterable[torch.Tensor],
    *,
    top_k: Optional[int] = None,
    queries_per_sequence: Optional[int] = 1024,
    seed: int = 0,
    progress: bool = True,
) -> RecallAudit:
    """Measure, per layer and kv head, the share of the model's attention mass the hard pattern keeps.

    Args:
        model: a model with an active Focus adapter.
        sequences: token id tensors [seq] (a [n, seq] tensor is read row by row).
        top_k: groups each query probes; None uses the adapter's (or `set_routing`'s) value.
        queries_per_sequence: random queries beyond the window per sequence (None: all of them).
        seed: seed of the query sample.
        progress: show a progress bar.

    Returns:
        A `RecallAudit` (`.table()`, `.save_json(path)`, `.save_png(path)`).
    """
    layers = focus_layers(model)
    adapter = _active_adapter(layers[0])
    settings = layers[0].focus_settings[adapter]
    top_k = top_k or layers[0].top_k_override or settings.top_k
    dense = {tuple(pair) for pair in settings.dense_heads or []}
    sums: dict[tuple[int, int], torch.Tensor] = {}
    counts: dict[tuple[int, int], int] = {}
    generator = torch.Generator().manual_seed(seed)
    sequences = list(sequences)
    seq_len = 0
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        tqdm = None
    bar = tqdm(total=len(sequences) * len(layers), desc="recall audit", disable=not progress) if tqdm else None
    for ids in sequences:
        ids = ids.reshape(-1)
        seq_len = max(seq_len, len(ids))
        captures = capture_layers(model, ids)
        queries = query_positions(len(ids), settings.window, queries_per_sequence, generator)
        for layer in layers:
            capture = captures[layer.layer_index]
            routing, _ = layer.route_tokens(adapter, capture.hidden[None], top_k=top_k)
            attention = distant_attention(
                capture,
                queries,
                window=settings.window,
                sinks=settings.sink_tokens,
                key_groups=routing.key_groups[0],
                num_groups=settings.num_groups,
                keep_counts=probed_key_counts(routing, queries, settings.window, settings.num_groups),
            )
            probes = routing.top_groups[0, attention.queries].cpu()
            probed = probed_mask(probes, settings.num_groups)
            kept = attention.local + (attention.group_mass * probed).sum(-1)
            best = attention.group_mass.mean(0).topk(top_k, dim=-1).indices
            chosen = torch.zeros_like(probed).scatter_(1, best, True)
            oracle = attention.local + (attention.group_mass * chosen).sum(-1)
            heads = capture.query.shape[0]
            kv_heads = capture.key.shape[0]
            per_kv = heads // kv_heads
            for kv in range(kv_heads):
                part = slice(kv * per_kv, (kv + 1) * per_kv)
                key_oracle = attention.local[part] + attention.best_mass[part]
                values = torch.stack(
                    [attention.local[part].sum(), kept[part].sum(), oracle[part].sum(), key_oracle.sum()]
                ).double()
                key = (layer.layer_index, kv)
                sums[key] = sums.get(key, torch.zeros(4, dtype=torch.float64)) + values
                counts[key] = counts.get(key, 0) + kept[part].numel()
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    rows = []
    for (layer_index, kv), total in sorted(sums.items()):
        local, kept, oracle, key_oracle = (total / counts[(layer_index, kv)]).tolist()
        is_dense = (layer_index, kv) in dense
        full = 1.0 if is_dense else None
        rows.append(HeadRecall(layer_index, kv, local, full or kept, full or oracle, is_dense, full or key_oracle))
    return RecallAudit(
        top_k=top_k,
        num_groups=settings.num_groups,
        window=settings.window,
        sink_tokens=settings.sink_tokens,
        seq_len=seq_len,
        sequences=len(sequences),
        queries_per_sequence=queries_per_sequence or 0,
        rows=rows,
    )


def probed_key_counts(routing, queries: torch.Tensor, window: int, num_groups: int) -> torch.Tensor:
    """[n] distant keys (beyond the window, not sinks) in the groups each query of `queries` probes (sample 0)."""
    own, probes, sink = routing.key_groups[0].cpu(), routing.top_groups[0].cpu(), routing.sink[0].cpu()
    return probed_distant_keys(probes, own, sink, window, num_groups)[queries]


def calibrate_dense_heads(audit: RecallAudit, count: int) -> list[list[int]]:
    """The `count` (layer, kv head) pairs that lose the most attention mass under the adapter, for `dense_heads`.

    Already dense heads stay dense and count towards `count`.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}.")
    ranked = sorted(audit.rows, key=lambda row: (not row.dense, row.adapter))
    return sorted([row.layer, row.kv_head] for row in ranked[:count])
