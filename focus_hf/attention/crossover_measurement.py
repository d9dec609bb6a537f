"""How "auto"'s crossover is measured: both sides of a call timed through the function that dispatches it.

A crossover (`crossover`) is the key count below which the short-call side of "auto" - on the CPU the pattern as one
dense masked call, on the GPU path the base model's attention - runs faster than the sparse path. `measure` times the
two sides (entries of the table of paths, `paths.measured_paths`) at lengths 256, 512, ... (1K to 256K on the GPU
path) through `hard.hard_attention`, told which entry to run, on random inputs laid out as a model hands them over and
with the per-step work of a decoding step; `find_crossover` stops at the first two consecutive lengths where the sparse
path wins by WIN_MARGIN.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Optional

import torch

from focus_hf.attention.paths import measured_paths, path_platform
from focus_hf.attention.pattern import FocusPattern

if TYPE_CHECKING:
    from focus_hf.attention.crossover import Shape

LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)
# The dense masked call builds an n x n bias, so it is never chosen above this many keys, measured or not.
MAX_LENGTH = LENGTHS[-1]
# Stop measuring (and keep the dense call up to the last length measured) once a calibration has taken this long.
BUDGET_S = 8.0
SINKS = 4
# The sparse path must be at least this much faster (dense / sparse time) to count as a win. Near the crossover the
# two are within the timing noise of a busy machine, and a wrong call costs more on the sparse side: a decode
# crossover measured at 1,024 keys with best-of timings (sparse 1.27x) ran 0.6-0.8x against dense in the benchmark.
WIN_MARGIN = 1.1
# The GPU path's measurement: lengths, and the seconds of timed calls it may take. On an H200 (32 / 8 heads, d 64,
# K=8, w=128, bf16) flash SDPA took 0.24 ms at 1K and 0.93 s at 256K, the GPU path 4.9 ms and 0.42 s at top-1.
GPU_LENGTHS = tuple(1024 << doubling for doubling in range(9))
GPU_BUDGET_S = 30.0
# A crossover the GPU path never reached: every query attends as the base model.
NEVER = 1 << 62


def find_crossover(
    time_at: Callable[[int], Optional[tuple[float, float]]],
    lengths: tuple[int, ...] = LENGTHS,
    budget_s: float = BUDGET_S,
    clock: Callable[[], float] = time.perf_counter,
    never_won: Optional[int] = None,
) -> tuple[int, list[dict]]:
    """The first of two consecutive lengths at which the sparse path beats the dense side by WIN_MARGIN, and the
    timings.

    `time_at(n)` returns (dense seconds, sparse seconds) at n keys, or None where it cannot measure (out of memory).
    If the sparse path never wins twice in a row within the lengths (or the budget runs out, or a length cannot be
    measured), the crossover is `never_won` - or, where that is None (the CPU), the length after the last one
    measured, capped at MAX_LENGTH: the dense call stays where it was seen to win.
    """
    rows: list[dict] = []
    start = clock()
    for index, length in enumerate(lengths):
        timed = time_at(length)
        if timed is None:
            break
        rows.append({"length": length, "dense_s": timed[0], "sparse_s": timed[1]})
        if len(rows) >= 2 and all(row["sparse_s"] * WIN_MARGIN <= row["dense_s"] for row in rows[-2:]):
            return rows[-2]["length"], rows
        if clock() - start > budget_s:
            following = lengths[index + 1] if index + 1 < len(lengths) else length
            return (min(following, MAX_LENGTH) if never_won is None else never_won), rows
    return (min(lengths[-1], MAX_LENGTH) if never_won is None else never_won), rows


def random_inputs(shape: Shape, length: int, queries: int, device: torch.device, generator: torch.Generator) -> dict:
    """Random q/k/v and routing of the shape's kind over `length` tokens, with queries for the last `queries` of them,
    laid out as a model hands them to the attention function: a prefill's q/k/v token-major (projections viewed
    [batch, heads, tokens, dim]), a decoding step's keys and values head-major (a KV cache), its query one token."""
    dtype = getattr(torch, shape.dtype)
    decode = shape.kind == "decode"

    def states(heads: int, n: int) -> torch.Tensor:
        tokens = torch.randn(1, n, heads, shape.head_dim, generator=generator).to(device, dtype)
        return tokens.transpose(1, 2).contiguous() if decode else tokens.transpose(1, 2)

    scores = torch.rand(1, length, shape.num_groups, generator=generator)
    key_groups = scores.argmax(dim=-1)
    if shape.kind in ("probe", "separate"):  # queries probe groups of their own, independent of the key's group
        scores = torch.rand(1, length, shape.num_groups, generator=generator)
    query_groups = scores.argsort(dim=-1, descending=True)[..., : shape.top_k]  # else: own group first
    return {
        "query": states(shape.heads, queries),
        "key": states(shape.kv_heads, length),
        "value": states(shape.kv_heads, length),
        "query_groups": query_groups[:, length - queries :].to(device),
        "key_groups": key_groups.to(device),
        "key_sink": (torch.arange(length) < SINKS)[None].to(device),
    }


# The sides of a crossover, each an entry of the table of paths (`paths.measured_paths`): the short-call side, the
# sparse path of the call's kind, and on the CPU that sparse path in torch operations alone (`native.torch_path`: a
# processor the C kernels are slow on - an unknown one, a build for an older target - then costs nothing).
SIDES = ("dense", "sparse", "sparse-torch")
SPARSE_SIDES = ("sparse", "sparse-torch")
# A row's own time of each sparse side, where both are timed (its "sparse_s" is the faster of them).
SIDE_TIMES = {"sparse": "kernels_s", "sparse-torch": "torch_s"}
# A timing: (untimed preparation, the timed calls, how many steps they make).
Timing = tuple[Callable[[], object], Callable[[], object], int]


def dispatched_calls(
    shape: Shape, length: int, device: torch.device, generator: torch.Generator, call: Callable[..., torch.Tensor]
) -> dict[str, Timing]:
    """What `auto` runs at `length` keys for `shape`, on each side: `call` (the function that dispatches a model's
    calls, `hard.hard_attention`, told the side's entry of the table of paths) with the arguments a model gives it -
    own_group as the routing knows it; a decoding step with the layer's copy of the distant keys, which each step
    brings up to date (on the CPU the group-sorted copy, one key appended per step as in generate(); on the GPU path
    the paged copy, timed over FILE_EVERY consecutive steps, so that its ring writes and its one filing count)."""
    from focus_hf.attention.cpu.grouped_keys import one_step_behind
    from focus_hf.attention.cpu.native import native_kernels
    from focus_hf.attention.gpu.paged_keys import FILE_EVERY, PagedKeys

    decode = shape.kind == "decode"
    gpu = path_platform(device, "auto") == "gpu"
    steps = FILE_EVERY if decode and gpu else 1
    inputs = random_inputs(shape, length + steps - 1, 1 if decode else length, device, generator)
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    pattern = FocusPattern(
        inputs["query_groups"],
        inputs["key_groups"],
        inputs["key_sink"],
        shape.num_groups,
        shape.window,
        sink_tokens=SINKS,
        own_group=shape.kind in ("shared", "decode"),  # `random_inputs`: queries probe their own group first
    )
    options = {"scaling": shape.head_dim**-0.5, "backend": "auto"}
    entries = measured_paths("gpu" if gpu else "cpu", decode)
    if gpu or native_kernels() is None:
        entries.pop("sparse-torch", None)

    def nothing() -> None:
        return None

    if not decode:
        return {
            side: (nothing, functools.partial(call, query, key, value, pattern, **options, path=entry.name), 1)
            for side, entry in entries.items()
        }
    if not gpu:
        routing = (pattern.key_groups, pattern.key_sink, shape.num_groups, shape.window)
        grouped, rewind = one_step_behind(key, value, *routing)
        options["key_copy"] = [grouped]
        return {
            side: (rewind, functools.partial(call, query, key, value, pattern, **options, path=entry.name), 1)
            for side, entry in entries.items()
        }
    paged = PagedKeys(shape.num_groups, shape.window)

    def step(n: int, name: str) -> torch.Tensor:
        """The step whose newest key is n - 1 (the same query each step: the keys are what changes)."""
        keys = replace(pattern, key_groups=pattern.key_groups[:, :n], key_sink=pattern.key_sink[:, :n])
        return call(query, key[:, :, :n], value[:, :, :n], keys, **options, path=name, key_copy=paged)

    def rebuilt() -> None:  # the copy as generate() leaves it before the first timed step
        paged.invalidate()
        step(length - 1, entries["sparse"].name)

    def run(name: str) -> None:
        for n in range(length, length + steps):
            step(n, name)

    return {
        "dense": (nothing, functools.partial(run, entries["dense"].name), steps),
        "sparse": (rebuilt, functools.partial(run, entries["sparse"].name), steps),
    }


def measure(
    shape: Shape,
    device: torch.device,
    call: Callable[..., torch.Tensor],
    lengths: Optional[tuple[int, ...]] = None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[int, list[dict]]:
    """Time `call` - the function that dispatches "auto"'s calls, `hard.hard_attention` - on the short-call side
    against the sparse path (`dispatched_calls`) at each of `lengths` (default LENGTHS, GPU_LENGTHS on the GPU path);
    see `find_crossover`. Where the sparse path runs both in the C kernels and in torch operations (CPU), the faster of
    the two is the sparse time at each length, and each row names it ("sparse_path", with both times). On the GPU path
    the budget counts the timed calls only (a length's first call compiles FlexAttention's kernels), a length that
    runs out of memory ends the measurement, and where the GPU path never wins the crossover is NEVER. `clock`: the
    timer (tests give recorded timings)."""
    gpu = path_platform(device, "auto") == "gpu"
    timed_s = [0.0]  # the GPU path's budget: seconds of timed calls

    def timed(function: Callable[[], object]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock()
        function()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = clock() - start
        timed_s[0] += seconds
        return seconds

    generator = torch.Generator().manual_seed(0)

    def time_at(length: int, sparse_only: bool = False) -> Optional[tuple[Optional[float], float]]:
        try:
            calls = dispatched_calls(shape, length, device, generator, call)
            if sparse_only:
                calls = {side: timing for side, timing in calls.items() if side != "dense"}
            # CPU decoding steps take a fraction of a millisecond: many repetitions; prefills (and runs of GPU decoding
            # steps): the median of three (one timing at 4K and beyond once put a crossover where the sparse path then
            # ran 0.68x of dense), within the budget.
            repeats = 31 if shape.kind == "decode" and not gpu else 3
            for prepare, run, _ in calls.values():  # warm-up
                prepare()
                run()
            times: dict[str, list[float]] = {side: [] for side in calls}
            for _ in range(repeats):  # alternating, so that all see the same machine
                for side, (prepare, run, steps) in calls.items():
                    prepare()
                    times[side].append(timed(run) / steps)
        except torch.OutOfMemoryError:
            if not gpu:
                raise
            return None  # the longer lengths will not fit either: the base attention stays there
        # Medians: a best-of favours the path of many small calls, whose typical time varies the most.
        medians = {side: statistics.median(values) for side, values in times.items()}
        sparse = {side: medians[side] for side in SPARSE_SIDES if side in medians}
        fastest = min(sparse, key=sparse.__getitem__)
        sparse_rows[length] = {"sparse_path": fastest, **{SIDE_TIMES[side]: value for side, value in sparse.items()}}
        return medians.get("dense"), sparse[fastest]

    sparse_rows: dict[int, dict] = {}
    lengths = (GPU_LENGTHS if gpu else LENGTHS) if lengths is None else lengths
    started = clock()
    with torch.inference_mode():
        if gpu:
            search = {"budget_s": GPU_BUDGET_S, "clock": lambda: timed_s[0], "never_won": NEVER}
        else:
            search = {"clock": clock}
        crossover, rows = find_crossover(time_at, lengths, **search)
        # Which sparse path is the faster can change with the length (the C kernels' key blocks stream from beyond
        # the core's cache on long calls): the two are timed on at the longer lengths, within the budget.
        if any(SIDE_TIMES["sparse-torch"] in row for row in sparse_rows.values()):
            for length in lengths[len(rows) :]:
                if clock() - started > 2 * BUDGET_S:
                    break
                _, sparse_s = time_at(length, sparse_only=True)
                rows.append({"length": length, "dense_s": None, "sparse_s": sparse_s})
    return crossover, [dict(row, **sparse_rows.get(row["length"], {})) for row in rows]
