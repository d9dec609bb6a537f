"""Prefix sums along the sequence of `[batch, seq, groups]` tensors that stay fast on a GPU.

torch's CUDA scan runs a dimension that is not the innermost one with one thread per column walking the whole
sequence: routing's `[batch, seq, K]` prefix sums along `seq` get batch x K threads (8 for one sample, K = 8), each
adding 256K numbers in turn. Measured on an H200 (commit 3056b1b, `benchmarks/results/gpu/profile.json`): the ten
float64 prefix sums of one 256K-token routing call took 504 ms, more than the attention they route (dense flash SDPA
of the same layer: 973 ms). Here the sequence is cut into chunks of `CHUNK`: a scan inside every chunk (many
columns, `CHUNK` steps each), the same scan of the chunks' totals (recursively), and each chunk's total before it
added back. Every step adds to a running value as one scan would, so nothing cancels; on the CPU torch's own scan is
already fast and runs unchanged.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# Tokens per chunk: short enough that one column's walk is brief, long enough that the chunks' totals are few.
CHUNK = 128


def sequence_cumsum(values: torch.Tensor, chunked: bool | None = None) -> torch.Tensor:
    """`torch.cumsum(values, dim=1)` for `[batch, seq, groups]` values.

    Args:
        values: the tensor to sum along its second dimension.
        chunked: scan by chunks (see the module docstring); None: where torch's own scan is slow, i.e. off the CPU
            and outside torch.compile (whose generated scan has no such column walk).
    """
    return _scan(values, torch.cumsum, torch.add, chunked)


def sequence_logcumsumexp(values: torch.Tensor, chunked: bool | None = None) -> torch.Tensor:
    """`torch.logcumsumexp(values, dim=1)` for `[batch, seq, groups]` values (`chunked` as in `sequence_cumsum`)."""
    return _scan(values, torch.logcumsumexp, torch.logaddexp, chunked)


def _chunked_by_default(values: torch.Tensor) -> bool:
    """Where torch's own scan walks columns: off the CPU, outside torch.compile (whose generated scan does not)."""
    return values.device.type != "cpu" and not torch.compiler.is_compiling()


def _scan(
    values: torch.Tensor,
    scan: Callable[..., torch.Tensor],
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    chunked: bool | None,
) -> torch.Tensor:
    if chunked is None:
        chunked = _chunked_by_default(values)
    batch, seq, groups = values.shape
    if not chunked or seq <= CHUNK:
        return scan(values, dim=1)
    chunks = -(-seq // CHUNK)
    # The padding is finite (no inf in any gradient) and last: a scan is causal, so it reaches only dropped outputs.
    padded = F.pad(values, (0, 0, 0, chunks * CHUNK - seq))
    inner = scan(padded.view(batch, chunks, CHUNK, groups), dim=2)
    before = _scan(inner[:, :-1, -1], scan, combine, True)  # the chunks' totals up to each chunk but the last
    # The first chunk has nothing before it: kept as is rather than combined with an identity (log space has none
    # that is exact for every value).
    later = combine(inner[:, 1:], before[:, :, None])
    return torch.cat([inner[:, :1], later], dim=1).view(batch, chunks * CHUNK, groups)[:, :seq]
