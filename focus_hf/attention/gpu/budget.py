"""How much temporary memory each part of the GPU path may hold at once: a fixed share of the call's output.

A prefill's peak memory is its inputs, its output and log-sum-exp, and the temporaries of whichever part runs - the
window band's packed copies, the own-group pass's sorted copies, the sinks' float32 scores. Dense flash attention
holds the first three alone, so the path's peak over dense is set by the temporaries: each part takes its heads or
its rows in runs whose temporaries fit `temporary_bytes`, a share of the output's bytes, so that the ratio to dense is
the same at every length (benchmarks/results/gpu/host-operations/ has it at 32 / 8 heads).

A short call runs each part in one piece instead: its time is made of launches, which pieces multiply, and its
temporaries (about 20 KiB per query row at 32 / 8 heads of 64 in bfloat16) are small in absolute terms. Where pieces
start is `FOCUS_HF_GPU_ONE_PIECE_ROWS` (query rows, default `ONE_PIECE_ROWS`), read at every call: set high, every
call runs in one piece (less launching, more memory).
"""

from __future__ import annotations

import os
import sys

import torch

# Temporaries of one part at a time, as a share of the call's output (the queries' size).
TEMPORARY_SHARE = 1 / 6
# Calls of at most this many query rows (batch x queries) run each part in one piece, unless ONE_PIECE_ROWS_ENV
# says otherwise.
ONE_PIECE_ROWS = 32768
ONE_PIECE_ROWS_ENV = "FOCUS_HF_GPU_ONE_PIECE_ROWS"


def one_piece_rows() -> int:
    """The most query rows (batch x queries) a call may have and still run each part in one piece:
    FOCUS_HF_GPU_ONE_PIECE_ROWS where set (an integer >= 0; 0 puts every call in pieces), else ONE_PIECE_ROWS."""
    value = os.environ.get(ONE_PIECE_ROWS_ENV, "").strip()
    if not value:
        return ONE_PIECE_ROWS
    try:
        rows = int(value)
    except ValueError:
        rows = -1
    if rows < 0:
        raise ValueError(
            f"{ONE_PIECE_ROWS_ENV} must be a whole number of query rows >= 0 (default {ONE_PIECE_ROWS}), not "
            f"{value!r}; unset it for the default"
        )
    return rows


def temporary_bytes(query: torch.Tensor) -> int:
    """The bytes of temporaries one part of the GPU path may hold at once for a call with these queries [batch, heads,
    q, dim]: unbounded up to `one_piece_rows()` query rows, else TEMPORARY_SHARE of the output."""
    if query.shape[0] * query.shape[2] <= one_piece_rows():
        return sys.maxsize
    return int(query.numel() * query.element_size() * TEMPORARY_SHARE)


def runs_of(count: int, per_item: int, budget: int, fixed: int = 0) -> int:
    """How many of `count` items (heads, rows) one run takes when each holds `per_item` bytes and the run `fixed`
    more: as many as fit `budget`, at least one."""
    return max(1, min(count, (budget - fixed) // max(per_item, 1)))
