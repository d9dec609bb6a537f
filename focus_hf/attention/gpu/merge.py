"""Folding one part of a query's keys into what the other parts gave, by log-sum-exp: the GPU path's parts (`gpu_path`,
`window`) are disjoint sets of pairs, each returning its output and natural-log log-sum-exp (`NEG` and output 0 for a
row without a visible key, which then weighs 0)."""

from __future__ import annotations

import torch


def merge_heads(
    output: torch.Tensor, lse: torch.Tensor, heads: slice, part: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """Fold `part` [batch, h, q, dim] with `part_lse` [batch, h, q] (a disjoint key set) into query heads `heads` of
    `output` [batch, heads, q, dim] and float32 `lse` [batch, heads, q], in place.

    With t = logaddexp(lse, part_lse) the merged output is o exp(lse - t) + part exp(part_lse - t), and the two
    weights are 1 - s and s for s = sigmoid(part_lse - lse): one `lerp` of the output towards the part, computed in
    float32 inside the kernel, whose only temporaries are the [batch, h, q] weights - no float32 copy of the rows. The
    weight is rounded to the output's dtype (a relative 2^-9 in bfloat16, the output's own rounding)."""
    held = lse[:, heads]
    new = part_lse.float()
    share = torch.sigmoid(new - held)
    lse[:, heads] = torch.logaddexp(held, new)
    output[:, heads].lerp_(part.to(output.dtype), share.unsqueeze(-1).to(output.dtype))
