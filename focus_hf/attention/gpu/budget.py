"""How much temporary memory each part of the GPU path may hold at once: a fixed share of the call's output.

A prefill's peak memory is its inputs, its output and log-sum-exp, and the temporaries of whichever part runs - the
window band's packed copies, the own-group pass's sorted copies, the sinks' float32 scores. Dense flash attention
holds the first three alone, so the path's peak over dense is set by the temporaries: each part takes its heads or
its rows in runs whose temporaries fit `temporary_bytes`, a share of the output's bytes, so that the ratio to dense is
the same at every length (benchmarks/results/gpu/host-operations/ has it at 32 / 8 heads).

A short call runs each part in one piece instead: its time is made of launches, which pieces multiply, and its
temporaries (about 20 KiB per query row at 32 / 8 heads of 64 in bfloat16) are small in absolute terms.
"""

from __future__ import annotations

import sys

import torch

# Temporaries of one part at a time, as a share of the call's output (the queries' size).
TEMPORARY_SHARE = 1 / 6
# Calls of at most this many query rows (batch x queries) run each part in one piece.
ONE_PIECE_ROWS = 32768


def temporary_bytes(query: torch.Tensor) -> int:
    """The bytes of temporaries one part of the GPU path may hold at once for a call with these queries [batch, heads,
    q, dim]: unbounded up to ONE_PIECE_ROWS query rows, else TEMPORARY_SHARE of the output."""
    if query.shape[0] * query.shape[2] <= ONE_PIECE_ROWS:
        return sys.maxsize
    return int(query.numel() * query.element_size() * TEMPORARY_SHARE)


def runs_of(count: int, per_item: int, budget: int, fixed: int = 0) -> int:
    """How many of `count` items (heads, rows) one run takes when each holds `per_item` bytes and the run `fixed`
    more: as many as fit `budget`, at least one."""
    return max(1, min(count, (budget - fixed) // max(per_item, 1)))
