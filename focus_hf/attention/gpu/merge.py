"""Folding one part of a query's keys into what the other parts gave, by log-sum-exp: the GPU path's parts (`gpu_path`,
`window`) are disjoint sets of pairs, each returning its output and natural-log log-sum-exp (`NEG` and output 0 for a
row without a visible key, which then weighs 0)."""

from __future__ import annotations

import torch

# Query rows merged at a time (float32 temporaries of this many rows of the merged heads).
MERGE_ROWS = 65536


def merge_heads(
    output: torch.Tensor, lse: torch.Tensor, heads: slice, part: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """Fold `part` [batch, h, q, dim] with `part_lse` [batch, h, q] (a disjoint key set) into query heads `heads` of
    `output` [batch, heads, q, dim] and float32 `lse` [batch, heads, q], in place, MERGE_ROWS rows at a time in
    float32: o = o exp(lse - t) + part exp(part_lse - t), lse = t = logaddexp(lse, part_lse)."""
    for start in range(0, output.shape[2], MERGE_ROWS):
        rows = slice(start, start + MERGE_ROWS)
        held, held_lse = output[:, heads, rows], lse[:, heads, rows]
        new_lse = part_lse[:, :, rows].float()
        total = torch.logaddexp(held_lse, new_lse)
        merged = held.float() * torch.exp(held_lse - total).unsqueeze(-1)
        merged.addcmul_(part[:, :, rows].float(), torch.exp(new_lse - total).unsqueeze(-1))
        output[:, heads, rows] = merged.to(output.dtype)
        lse[:, heads, rows] = total
