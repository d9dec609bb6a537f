"""Retrieval heads: the few heads that copy a token from far back, and whether the adapter's routing keeps it.

Averaged over all queries, a head that retrieves loses little mass (most queries never look far back), yet the
queries that do are the ones that answer "what was the pass key?". This audit looks only at *distant copy
events*: a position t whose next token continues an n-gram that occurred earlier beyond the window (t's last
`context` tokens and the next token equal the tokens ending at some distant s). A head that retrieves puts its
attention on the copied token s at t (the induction / retrieval-head pattern). Per (layer, kv head) the audit
reports that copy mass in the dense model and the part of it that the adapter's hard pattern drops (s outside the
query's probed groups). The heads dropping the most are the ones to keep dense (DuoAttention calibrates its
full-attention heads on synthetic retrieval text for the same reason).

Any text with long-range repeats works; `focus_hf.data.retrieval_documents` makes it on purpose.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from focus_hf.fitting.capture import LayerCapture, capture_layers
from focus_hf.tuner.controls import focus_layers


@dataclass
class HeadRetrieval:
    """Copy mass of one (layer, kv head), averaged over the copy events (max over its query heads per event)."""

    layer: int
    kv_head: int
    copy_mass: float  # attention on the distant copied token in the dense model
    dropped: float  # the part of it outside the adapter's probed groups (0 for a dense head)
    dense: bool = False


@dataclass
class RetrievalAudit:
    """The result of `audit_retrieval`; `rows` holds one `HeadRetrieval` per (layer, kv head)."""

    top_k: int
    window: int
    events: int
    rows: list[HeadRetrieval] = field(default_factory=list)

    def ranked(self) -> list[HeadRetrieval]:
        """Rows from the most dropped copy mass to the least (dense heads last)."""
        return sorted(self.rows, key=lambda row: (row.dense, -row.dropped))

    def table(self, count: int = 12) -> str:
        """The `count` heads that drop the most copy mass, in percent."""
        lines = ["layer kv | copy mass | dropped by the adapter"]
        for row in self.ranked()[:count]:
            mark = " (dense)" if row.dense else ""
            copied, dropped = 100 * row.copy_mass, 100 * row.dropped
            lines.append(f"{row.layer:5d} {row.kv_head:2d} | {copied:8.1f}% | {dropped:6.1f}%{mark}")
        return "\n".join(lines)


def copy_events(ids: torch.Tensor, window: int, sinks: int, context: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Distant copy events of one sequence `ids` [seq]: (query positions t [e], copied positions s [e]).

    t is an event when ids[t - context + 1 .. t + 1] also ends at s (ids[s - context .. s] equal, s beyond the
    window of t and not a sink); the pair is kept only when that n-gram occurs once before, so the event names one
    source unambiguously.
    """
    ids = ids.reshape(-1).tolist()
    seen: dict[tuple[int, ...], list[int]] = {}
    queries, sources = [], []
    width = context + 1
    for end in range(width - 1, len(ids)):
        gram = tuple(ids[end - width + 1 : end + 1])
        earlier = seen.setdefault(gram, [])
        t = end - 1
        distant = [s for s in earlier if t - s > window and s >= sinks]
        if len(earlier) == 1 and distant:
            queries.append(t)
            sources.append(distant[0])
        earlier.append(end)
    return torch.tensor(queries, dtype=torch.long), torch.tensor(sources, dtype=torch.long)


def _copy_mass(capture: LayerCapture, queries: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """[heads, e]: each head's attention probability on the copied token, per event."""
    query = capture.query.float()[:, queries]  # heads, e, d
    key = capture.key.float()
    keys = key.repeat_interleave(query.shape[0] // key.shape[0], dim=0)  # heads, seq, d
    logits = torch.einsum("hed,hkd->hek", query, keys) * capture.scaling
    if capture.softcap is not None:
        logits = torch.tanh(logits / capture.softcap) * capture.softcap
    future = torch.arange(keys.shape[1], device=query.device)[None, :] > queries.to(query.device)[:, None]
    probs = torch.softmax(logits.masked_fill(future[None], float("-inf")), dim=-1)
    return probs.gather(2, sources.to(query.device)[None, :, None].expand(probs.shape[0], -1, 1))[..., 0].cpu()


@torch.no_grad()
def audit_retrieval(
    model: nn.Module,
    sequences: Iterable[torch.Tensor],
    *,
    top_k: Optional[int] = None,
    context: int = 2,
    progress: bool = True,
) -> RetrievalAudit:
    """Per (layer, kv head): attention the dense model pays to distant copied tokens, and what the adapter drops.

    Args:
        model: a model with an active Focus adapter.
        sequences: token id tensors [seq] with long-range repeats (e.g. `focus_hf.data.retrieval_documents`).
        top_k: groups each query probes; None uses the adapter's (or `set_routing`'s) value.
        context: tokens before the copied one that must match (see `copy_events`).
        progress: show a progress bar.

    Returns:
        A `RetrievalAudit`; `retrieval_dense_heads(audit, n)` picks the heads to keep dense.
    """
    from tqdm.auto import tqdm

    layers = focus_layers(model)
    adapter = layers[0]._active_router()
    if adapter is None:
        raise ValueError("The Focus adapter is disabled; enable it before auditing it.")
    settings = layers[0].focus_settings[adapter]
    top_k = top_k or layers[0].top_k_override or settings.top_k
    dense = {tuple(pair) for pair in settings.dense_heads or []}
    sequences = [ids.reshape(-1) for ids in sequences]
    totals: dict[tuple[int, int], torch.Tensor] = {}
    events = 0
    for ids in tqdm(sequences, desc="retrieval audit", disable=not progress):
        queries, sources = copy_events(ids, settings.window, settings.sink_tokens, context)
        if len(queries) == 0:
            continue
        events += len(queries)
        captures = capture_layers(model, ids)
        for layer in layers:
            capture = captures[layer.layer_index]
            routing, _ = layer.route_tokens(adapter, capture.hidden[None], top_k=top_k)
            probed = routing.top_groups[0, queries.to(routing.top_groups.device)].cpu()  # e, top_k
            source_groups = routing.key_groups[0, sources.to(routing.key_groups.device)].cpu()
            kept = (probed == source_groups[:, None]).any(-1)
            mass = _copy_mass(capture, queries, sources)  # heads, e
            per_kv = mass.shape[0] // capture.key.shape[0]
            for kv in range(capture.key.shape[0]):
                best = mass[kv * per_kv : (kv + 1) * per_kv].max(0).values
                key = (layer.layer_index, kv)
                values = torch.stack([best.sum(), (best * ~kept).sum()]).double()
                totals[key] = totals.get(key, torch.zeros(2, dtype=torch.float64)) + values
    rows = []
    for (layer_index, kv), total in sorted(totals.items()):
        copy_mass, dropped = (total / max(events, 1)).tolist()
        is_dense = (layer_index, kv) in dense
        rows.append(HeadRetrieval(layer_index, kv, copy_mass, 0.0 if is_dense else dropped, is_dense))
    return RetrievalAudit(top_k=top_k, window=settings.window, events=events, rows=rows)


def retrieval_dense_heads(audit: RetrievalAudit, count: int, keep: Iterable[Iterable[int]] = ()) -> list[list[int]]:
    """`keep` plus the `count` (layer, kv head) pairs that drop the most copy mass, for `FocusConfig.dense_heads`."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}.")
    pairs = {tuple(pair) for pair in keep}
    wanted = len(pairs) + count
    for row in audit.ranked():
        if len(pairs) >= wanted:
            break
        pairs.add((row.layer, row.kv_head))
    return sorted(list(pair) for pair in pairs)
