"""Training-free sparse attention baselines on the same axes as Focus: what a user could run without training.

- `streaming`: window + sinks only (StreamingLLM): every distant key but the sinks is dropped.
- `blocks`: block selection at a given density (Quest / MInference-style): keys and queries are cut into blocks of
  `BLOCK` tokens; for each query block and head, the distant key blocks whose mean-pooled key scores highest against
  the mean-pooled query block are kept, as many as `density` x the distant blocks; window and sinks stay.

Both run as a dense masked attention (quality only: no sparse kernel is timed for them). They are registered with
transformers' attention registry and read their settings from `SETTINGS`.
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "lc_baseline"
BLOCK = 64
SETTINGS = {"kind": "streaming", "window": 128, "sinks": 4, "density": 0.125}


def _allowed(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Bool [heads or 1, q, kv] pairs the baseline keeps (causal), for one sequence with q == kv."""
    seq = query.shape[-2]
    positions = torch.arange(seq, device=query.device)
    distance = positions[:, None] - positions[None, :]
    local = (distance >= 0) & ((distance <= SETTINGS["window"]) | (positions[None, :] < SETTINGS["sinks"]))
    if SETTINGS["kind"] == "streaming":
        return local[None]
    blocks = math.ceil(seq / BLOCK)
    pad = blocks * BLOCK - seq
    heads = query.shape[0]
    keys = key.repeat_interleave(heads // key.shape[0], dim=0)
    pooled_q = torch.nn.functional.pad(query, (0, 0, 0, pad)).view(heads, blocks, BLOCK, -1).mean(2)
    pooled_k = torch.nn.functional.pad(keys, (0, 0, 0, pad)).view(heads, blocks, BLOCK, -1).mean(2)
    scores = pooled_q @ pooled_k.transpose(1, 2)  # [heads, query block, key block]
    index = torch.arange(blocks, device=query.device)
    # Distant key blocks of query block b: those entirely before its window (b - kb >= window / BLOCK + 1).
    reach = SETTINGS["window"] // BLOCK + 1
    distant = index[:, None] - index[None, :] >= reach
    scores = scores.masked_fill(~distant[None], float("-inf"))
    count = (distant.sum(1).float() * SETTINGS["density"]).ceil().long()  # blocks kept per query block
    order = scores.argsort(dim=-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, index.expand_as(order))
    chosen = (rank < count[None, :, None]) & distant[None]
    selected = chosen.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :seq, :seq]
    return local[None] | (selected & (distance >= 0)[None])


def baseline_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    batch, heads, seq, dim = query.shape
    scaling = dim**-0.5 if scaling is None else scaling
    outputs = []
    for b in range(batch):
        allowed = _allowed(query[b], key[b])
        keys = key[b].repeat_interleave(heads // key.shape[1], dim=0)
        values = value[b].repeat_interleave(heads // key.shape[1], dim=0)
        bias = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(~allowed, float("-inf"))
        out = torch.nn.functional.scaled_dot_product_attention(query[b], keys, values, attn_mask=bias, scale=scaling)
        outputs.append(out.transpose(0, 1))
    return torch.stack(outputs), None


def kept_density(seq: int) -> float:
    """Share of the causal pairs the baseline keeps at `seq` tokens (for the trade-off plot)."""
    query = torch.randn(1, seq, 8)
    return float(_allowed(query, query).sum()) / (seq * (seq + 1) / 2)


AttentionInterface.register(NAME, baseline_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
