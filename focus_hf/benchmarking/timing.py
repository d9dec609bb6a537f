"""Timing calls: wall-clock and process CPU seconds of a call (`time_call`, device-synchronised on CUDA), the medians
of repeated timings, and how many rounds a short timing needs (`rounds_to_reach`)."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from typing import TYPE_CHECKING, Callable, ContextManager, Optional

if TYPE_CHECKING:
    import torch


def time_call(
    function: Callable[[], torch.Tensor],
    steps: int = 1,
    context: Callable[[], ContextManager] = contextlib.nullcontext,
) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of one call (the mean of `steps` calls made back to back, inside one
    `context`). On a shared machine, CPU time is the steadier measure of single-threaded runs (other processes take
    turns on the cores, which inflates wall time unevenly). On CUDA the device is synchronised before and after, so
    that the time is that of the calls' kernels, not of their launches; a call too short for that synchronisation to
    be negligible (a decoding step) is timed over several `steps`."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    with context():
        for _ in range(steps):
            function()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def medians(times: list[tuple[float, float]]) -> tuple[Optional[float], Optional[float]]:
    """Median wall and CPU seconds, or (None, None) when nothing was timed."""
    if not times:
        return None, None
    return statistics.median(wall for wall, _ in times), statistics.median(cpu for _, cpu in times)


def rounds_to_reach(repeats: int, min_seconds: float, seconds: float) -> int:
    """How many rounds a length gets: `repeats`, or more where the baseline's best timing so far (`seconds`) is
    short - as many as it takes that timing to add up to `min_seconds` (a short timing on a shared CPU moves by a
    tenth from one run to the next; the best of many is steadier)."""
    return max(repeats, math.ceil(min_seconds / seconds))
