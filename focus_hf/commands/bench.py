"""`focus-hf bench`: time hard-mode Focus attention against dense causal attention, one attention layer.

Inputs are random q/k/v; the routing comes from a random-init router (a FocusLayer-style projection and centroids
on random hidden states, causal Sinkhorn via `routing.route_tokens`), so groups are balanced as in a real model.
Dense (`scaled_dot_product_attention(is_causal=True, enable_gqa=True)`) and Focus are timed alternately in the
same loop and the median is kept (on CUDA the dense baseline runs on torch's flash kernel where it takes the inputs,
and every call is timed between device synchronisations); `--peak-memory` instead runs one Focus call per length in
a fresh process and reports its peak resident memory (on CUDA: torch's peak allocated GPU memory, in one process),
after a warm-up call at a shorter length. `--decode` times one new query against a KV cache of each length (dense
SDPA vs Focus's decode path, alternately); `--calibrate` measures where "auto" switches from the dense masked call to
the sparse path on this machine (`attention/crossover.py`), stores it in the cache and prints it. `--json` rows are
written as they are measured, each with the device, package versions, git commit, date and command.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import itertools
import json
import multiprocessing
import resource
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from focus_hf.benchmarking.layer import (
    Case,
    allowed_pair_count,
    dense_call,
    dense_kernel,
    focus_call,
    layer_fields,
    make_case,
)
from focus_hf.benchmarking.records import (
    RowLog,
    gpu_path_backend,
    gpu_path_fields,
    machine_fields,
    other_cores,
    rows_or_error,
)
from focus_hf.benchmarking.timing import medians, time_call

if TYPE_CHECKING:
    import torch

# Dense attention beyond this many bytes of q/k/v/output is reported as skipped rather than run.
DENSE_MEMORY_FRACTION = 0.5


def dense_skip_reason(
    args: argparse.Namespace, seq_len: int, dtype: torch.dtype, device: torch.device
) -> Optional[str]:
    """Why dense attention is not run at `seq_len`, or None."""
    import torch

    if args.dense_max_seq_len is not None and seq_len > args.dense_max_seq_len:
        return f"skipped: above --dense-max-seq-len {args.dense_max_seq_len}"
    element = torch.finfo(dtype).bits // 8
    needed = seq_len * (2 * args.heads + 2 * args.kv_heads) * args.head_dim * element
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        available = psutil.virtual_memory().available
    if needed > DENSE_MEMORY_FRACTION * available:
        return f"skipped: needs ~{needed / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available"
    return None


def repeats_at(args: argparse.Namespace, seq_len: int) -> int:
    """Fewer repetitions on long sequences: halved per doubling above 16,384 tokens, never below 2."""
    return max(2, min(args.repeats, args.repeats * 16384 // seq_len))


def bench_length(args: argparse.Namespace, seq_len: int, device: torch.device, dtype: torch.dtype) -> list[dict]:
    from focus_hf.attention.crossover import auto_path, crossover_entry, on_gpu_path, race_pending
    from focus_hf.attention.hard import forget_fallbacks, hard_attention, path_kind, paths_run

    forget_fallbacks()  # the row counts its own length's fallbacks (`gpu_path_fields`)
    case = make_case(args, seq_len, device, dtype)
    skip = dense_skip_reason(args, seq_len, dtype, device)
    dense = dense_call(case)
    calls = {top_k: focus_call(args, case, top_k) for top_k in args.top_k}
    crossovers, racing, kinds = {}, {}, {}
    for top_k, routing in case.routing.items():
        kinds[top_k] = kind = path_kind(routing.top_groups, routing.key_groups, False, routing.own_groups is None)
        crossovers[top_k] = crossover_used(args, case, top_k, kind)
        racing[top_k] = args.backend == "auto" and race_pending(
            case.query, case.key, top_k, args.groups, args.window, kind, hard_attention
        )
    dense_context, kernel = dense_kernel(case.query, case.key, causal=True)
    dense_times: list[tuple[float, float]] = []
    focus_times: dict[int, list[tuple[float, float]]] = {top_k: [] for top_k in args.top_k}
    # Warm-up (allocator, kernels); too expensive to repeat at long lengths on the CPU. On a GPU every length warms
    # Focus up (kernels compiled for a shape are compiled at its first call), and dense up to 64K tokens.
    cuda = device.type == "cuda"
    if skip is None and (seq_len <= 16384 or (cuda and seq_len <= 65536)):
        time_call(dense, context=dense_context)
    for top_k, call in calls.items():
        # A length far beyond those "auto" measured runs on both sparse paths once, timed (`crossover`): not here.
        if seq_len <= 16384 or cuda or racing[top_k]:
            time_call(call)
    meter = other_cores(device)
    ran: dict[int, dict[str, int]] = {}  # the entries of the table of paths that a timed call ran, by top_k
    for _ in range(repeats_at(args, seq_len)):
        if skip is None:
            dense_times.append(time_call(dense, context=dense_context))
        for top_k, call in calls.items():
            before = paths_run()
            focus_times[top_k].append(time_call(call))
            ran[top_k] = {name: count - before.get(name, 0) for name, count in paths_run().items()}
            ran[top_k] = {name: count for name, count in ran[top_k].items() if count}
    others = meter()
    dense_s, dense_cpu_s = medians(dense_times)
    paths, races = {}, {}
    for top_k in args.top_k if args.backend == "auto" else ():
        layer = (case.query, case.key, top_k, args.groups, args.window, kinds[top_k], hard_attention)
        # what "auto" ran: on the CPU "dense" (the masked call), "sparse" (the C kernels) or "sparse-torch"; on the
        # GPU path the entries that ran ("base", "gpu-sparse", or both, split by query)
        paths[top_k] = " + ".join(ran.get(top_k, {})) if on_gpu_path(device) else auto_path(*layer)
        if racing[top_k]:  # the race's row: each sparse path's time on the warm-up call
            races[top_k] = crossover_entry(*layer)["timings"][-1]
    rows = []
    causal_pairs = seq_len * (seq_len + 1) // 2
    for top_k in args.top_k:
        focus_s, focus_cpu_s = medians(focus_times[top_k])
        fraction = allowed_pair_count(case.routing[top_k], args.window, args.groups) / causal_pairs
        rows.append(
            {
                "seq_len": seq_len,
                "dense_s": dense_s,
                "focus_s": focus_s,
                "speedup": None if dense_s is None else dense_s / focus_s,
                "dense_cpu_s": dense_cpu_s,
                "focus_cpu_s": focus_cpu_s,
                "cpu_speedup": None if dense_cpu_s is None else dense_cpu_s / focus_cpu_s,
                "pairs_fraction": fraction,
                "ideal_speedup": 1.0 / fraction,
                "dense_note": skip,
                "dense_kernel": kernel,
                "repeats": len(focus_times[top_k]),
                "backend": args.backend,
                "top_k": top_k,
                **layer_fields(args),
                "dtype": args.dtype,
                "query_router": args.query_router,
                "dense_below": crossovers[top_k],
                "focus_path": paths.get(top_k),
                "focus_paths": ran.get(top_k),
                "race": races.get(top_k),
                "other_cores_busy": others,
                **gpu_path_fields(args, device),
                **machine_fields(device),
            }
        )
    return rows


def crossover_used(args: argparse.Namespace, case: Case, top_k: int, kind: str, decode: bool = False) -> Optional[int]:
    """The key count below which backend "auto" runs the dense masked call for this case (measured now if not known
    yet, so that no timed call pays for the calibration); None for other backends."""
    if args.backend != "auto":
        return None
    from focus_hf.attention.crossover import dense_below
    from focus_hf.attention.hard import hard_attention

    query = case.query[:, :, -1:] if decode else case.query
    return dense_below(query, case.key, top_k, args.groups, args.window, kind, hard_attention)


def paged_decode_times(
    args: argparse.Namespace, cache_len: int, device: torch.device, dtype: torch.dtype, compiled: bool = False
) -> tuple[list[tuple[float, float]], dict[int, list[tuple[float, float]]], str]:
    """The GPU path's decoding steps (`gpu_path.decode_from_paged_keys`): per repetition, FILE_EVERY consecutive steps
    from a cache of `cache_len` keys on, as generate() makes them - each step's ring write, and the one filing of
    positions that left the window among them - through a paged copy built (untimed) before the first; dense SDPA over
    the same growing caches. `compiled`: both steps under torch.compile (dynamic shapes; compiled in the untimed
    warm-up). Returns (dense times, Focus times by top_k, the dense kernel's name), seconds per step."""
    import torch
    import torch.nn.functional as F

    from focus_hf.attention.gpu.paged_keys import FILE_EVERY, PagedKeys
    from focus_hf.attention.hard import hard_attention
    from focus_hf.attention.pattern import FocusPattern

    case = make_case(args, cache_len + FILE_EVERY, device, dtype)
    key, value = case.key.contiguous(), case.value.contiguous()  # a KV cache is head-major
    scaling = args.head_dim**-0.5
    lengths = range(cache_len, cache_len + FILE_EVERY)
    dense_context, kernel = dense_kernel(case.query[:, :, -1:], key, causal=False)

    def dense_step(n: int) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            case.query[:, :, n - 1 : n], key[:, :, :n], value[:, :, :n], enable_gqa=True
        )

    dense_call = torch.compile(dense_step, dynamic=True) if compiled else dense_step

    def dense_steps() -> None:
        for n in lengths:
            dense_call(n)

    def focus_steps(top_k: int) -> Callable[[], None]:
        routing = case.routing[top_k]
        store = PagedKeys(args.groups, args.window)

        def step(n: int) -> torch.Tensor:
            groups = (routing.top_groups[:, n - 1 : n], routing.key_groups[:, :n], routing.sink[:, :n])
            pattern = FocusPattern(*groups, args.groups, args.window)
            query = case.query[:, :, n - 1 : n]
            return hard_attention(
                query, key[:, :, :n], value[:, :, :n], pattern, scaling=scaling, backend=args.backend, key_copy=store
            )

        call = torch.compile(step, dynamic=True) if compiled else step

        def steps() -> None:
            for n in lengths:
                call(n)

        def rebuilt() -> Callable[[], None]:
            store.invalidate()
            step(cache_len - 1)  # the copy as generate() leaves it before the first timed step
            return steps

        return rebuilt

    focus = {top_k: focus_steps(top_k) for top_k in args.top_k}
    time_call(dense_steps, context=dense_context)  # warm-up (and FlexAttention's compilation)
    for prepare in focus.values():
        time_call(prepare())
    dense_times: list[tuple[float, float]] = []
    focus_times: dict[int, list[tuple[float, float]]] = {top_k: [] for top_k in args.top_k}
    per_step = len(lengths)
    for _ in range(args.decode_repeats):
        wall, cpu = time_call(dense_steps, context=dense_context)
        dense_times.append((wall / per_step, cpu / per_step))
        for top_k, prepare in focus.items():
            wall, cpu = time_call(prepare())
            focus_times[top_k].append((wall / per_step, cpu / per_step))
    return dense_times, focus_times, kernel


def decode_length(args: argparse.Namespace, cache_len: int, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Per-token latency of one new query against a KV cache of `cache_len` tokens (itself included, as in
    transformers): dense SDPA and Focus (`hard.hard_attention`, which takes `decode_attention` - on the GPU path
    `gpu_path.decode_from_paged_keys`, `paged_decode_times` - unless "auto" finds the dense masked call faster at this
    length), timed alternately."""
    import torch
    import torch.nn.functional as F

    from focus_hf.attention.cpu.grouped_keys import one_step_behind
    from focus_hf.attention.cpu.native_decode import serves
    from focus_hf.attention.hard import forget_fallbacks, hard_attention
    from focus_hf.attention.pattern import FocusPattern, probes

    forget_fallbacks()  # the rows count their own cache length's fallbacks (`gpu_path_fields`)
    case = make_case(args, cache_len, device, dtype)
    # A KV cache is head-major ([batch, kv_heads, n, dim] contiguous), not token-major like fresh projections.
    case = Case(case.query[:, :, -1:].contiguous(), case.key.contiguous(), case.value.contiguous(), case.routing)
    scaling = args.head_dim**-0.5

    def dense() -> torch.Tensor:
        return F.scaled_dot_product_attention(case.query, case.key, case.value, enable_gqa=True)

    def focus_for(top_k: int) -> Callable[[], torch.Tensor]:
        routing = case.routing[top_k]
        # As in generate(): the group-sorted copy of the distant keys lacks the key that has just left the window,
        # which each timed step appends.
        grouped, rewind = one_step_behind(
            case.key, case.value, routing.key_groups, routing.sink, args.groups, args.window
        )

        groups = (routing.top_groups[:, -1:], routing.key_groups, routing.sink, args.groups, args.window)
        pattern = FocusPattern(*groups, own_group=routing.own_groups is None)

        def step() -> torch.Tensor:
            rewind()
            return hard_attention(
                case.query, case.key, case.value, pattern, scaling=scaling, backend=args.backend, key_copy=[grouped]
            )

        return step

    crossovers = {top_k: crossover_used(args, case, top_k, "decode", decode=True) for top_k in args.top_k}
    repeats = args.decode_repeats
    gpu_path = gpu_path_backend(args, device)
    timings = []  # (compiled, dense times, Focus times by top_k)
    others = None  # cores other processes kept busy while the CPU steps were timed
    if gpu_path:
        from focus_hf.attention.gpu.paged_keys import FILE_EVERY

        steps = FILE_EVERY
        for compiled in (False, True) if args.compile else (False,):
            dense_times, focus_times, kernel = paged_decode_times(args, cache_len, device, dtype, compiled)
            timings.append((compiled, dense_times, focus_times))
    else:
        calls = {top_k: focus_for(top_k) for top_k in args.top_k}
        dense_context, kernel = dense_kernel(case.query, case.key, causal=False)
        steps = decode_steps(args, device)
        for _ in range(3):  # warm-up
            time_call(dense, context=dense_context)
            for call in calls.values():
                time_call(call)
        dense_times: list[tuple[float, float]] = []
        focus_times: dict[int, list[tuple[float, float]]] = {top_k: [] for top_k in args.top_k}
        meter = other_cores(device)
        for _ in range(repeats):
            dense_times.append(time_call(dense, steps, dense_context))
            for top_k, call in calls.items():
                focus_times[top_k].append(time_call(call, steps))
        timings.append((False, dense_times, focus_times))
        others = meter()
    rows = []
    positions = torch.arange(cache_len, device=device)
    # What the group-sorted copy's attention runs on: the C kernel of `attention/cpu/native_decode.py`, or torch
    # operations.
    native = device.type == "cpu" and serves(dtype, args.heads, args.kv_heads, args.head_dim)
    decode_kernel = "FlexAttention (paged copy)" if gpu_path else "C" if native else "torch"
    for (compiled, dense_times, focus_times), top_k in itertools.product(timings, args.top_k):
        dense_s, dense_cpu_s = medians(dense_times)
        routing = case.routing[top_k]
        focus_s, focus_cpu_s = medians(focus_times[top_k])
        # Keys the new token may attend to: its probed groups, the window and the sinks.
        reachable = probes(routing.top_groups[:, -1:], routing.key_groups)[0, 0]
        reachable |= (positions >= cache_len - 1 - args.window) | routing.sink[0]
        fraction = float(reachable.float().mean())
        crossover = crossovers[top_k]
        copy = "paged copy" if gpu_path else "group-sorted copy"
        short = "base attention" if gpu_path else "dense-masked"  # "auto"'s side below its crossover
        path = short if crossover is not None and cache_len < crossover else copy
        rows.append(
            {
                "mode": "decode",
                "cache_len": cache_len,
                "dense_s": dense_s,
                "focus_s": focus_s,
                "speedup": dense_s / focus_s,
                "dense_cpu_s": dense_cpu_s,
                "focus_cpu_s": focus_cpu_s,
                "cpu_speedup": dense_cpu_s / focus_cpu_s if focus_cpu_s else None,
                "keys_fraction": fraction,
                "ideal_speedup": 1.0 / fraction,
                "focus_path": path if args.backend == "auto" else copy,
                "decode_kernel": decode_kernel,
                "dense_kernel": kernel,
                "dense_below": crossover,
                "other_cores_busy": others,
                "repeats": repeats,
                "steps_per_timing": steps,
                "compiled": compiled,
                "backend": args.backend,
                "top_k": top_k,
                "groups": args.groups,
                "window": args.window,
                "sinks": args.sinks,
                "heads": args.heads,
                "kv_heads": args.kv_heads,
                "head_dim": args.head_dim,
                "dtype": args.dtype,
                **gpu_path_fields(args, device),
                **machine_fields(device),
            }
        )
    return rows


def decode_steps(args: argparse.Namespace, device: torch.device) -> int:
    """Decoding steps per timing: `--decode-steps`, else 1 on the CPU and 10 on a GPU, where one step takes tens of
    microseconds and the synchronisation around a single one would weigh in its time."""
    if args.decode_steps is not None:
        return args.decode_steps
    return 10 if device.type == "cuda" else 1


def decode_rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, log: RowLog) -> None:
    import torch

    print(
        f"{'cache':>8} {'top_k':>5} {'dense_ms':>9} {'focus_ms':>9} {'speedup':>8} {'ideal':>7} {'path':>12}",
        flush=True,
    )
    with torch.inference_mode():
        for cache_len in args.seq_lens:
            measure = functools.partial(decode_length, args, cache_len, device, dtype)
            for row in rows_or_error(measure, log, "cache_len", cache_len, device):
                log.add(row)
                print(
                    f"{cache_len:>8} {row['top_k']:>5} {row['dense_s'] * 1e3:>9.3f} {row['focus_s'] * 1e3:>9.3f} "
                    f"{row['speedup']:>7.2f}x {row['ideal_speedup']:>6.2f}x {row['focus_path']:>12}"
                    + (" (compiled)" if row.get("compiled") else ""),
                    flush=True,
                )


def timing_text(row: dict) -> str:
    """One measured length of a crossover: "keys: dense ms / sparse ms", "(torch)" where the sparse path's torch
    operations were the faster, "-" for a length where only the sparse paths were timed."""
    dense = "-" if row["dense_s"] is None else f"{row['dense_s'] * 1e3:.2f}"
    torch_path = " (torch)" if row.get("sparse_path") == "sparse-torch" else ""
    return f"{row['length']}: {dense}/{row['sparse_s'] * 1e3:.2f}{torch_path}"


def calibrate_rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, log: RowLog) -> None:
    """Measure the crossover of every path "auto" may take for this shape (replacing cached values) and print it."""
    import torch

    from focus_hf.attention.crossover import calibrate, make_shape
    from focus_hf.attention.hard import hard_attention

    query = torch.empty(1, args.heads, 1, args.head_dim, dtype=dtype, device=device)
    key = torch.empty(1, args.kv_heads, 1, args.head_dim, dtype=dtype, device=device)
    print(f"{'top_k':>5} {'path':>9} {'dense_below':>11}  timings (keys: dense ms / sparse ms)", flush=True)
    for top_k in args.top_k:
        for kind in ("shared", "probe" if top_k == 1 else "separate", "decode"):
            shape = make_shape(query, key, top_k, args.groups, args.window, kind)
            entry = calibrate(shape, device, hard_attention)
            timings = "  ".join(timing_text(row) for row in entry["timings"])
            print(f"{top_k:>5} {kind:>9} {entry['dense_below']:>11}  {timings}", flush=True)
            log.add(
                {
                    "mode": "calibrate",
                    "top_k": top_k,
                    "kind": kind,
                    "dense_below": entry["dense_below"],
                    "timings": entry["timings"],
                    "groups": args.groups,
                    "window": args.window,
                    "heads": args.heads,
                    "kv_heads": args.kv_heads,
                    "head_dim": args.head_dim,
                    "dtype": args.dtype,
                    **machine_fields(device),
                }
            )
    from focus_hf.attention.crossover import cache_path

    print(f"stored in {cache_path()}", flush=True)


# Tokens of the warm-up call before a peak-memory measurement (`peak_memory_child`): above every crossover of "auto",
# so that the warm-up runs the sparse path too.
PEAK_MEMORY_WARM_UP_TOKENS = 16384


def peak_memory_child(
    args: argparse.Namespace, seq_len: int, top_k: Optional[int], queue: multiprocessing.Queue
) -> None:
    """Runs in a fresh process: one Focus call (or with top_k None one dense causal SDPA call on the same inputs),
    after a warm-up call at up to PEAK_MEMORY_WARM_UP_TOKENS tokens; reports RSS before it and the process's peak RSS
    (MiB)."""
    import psutil
    import torch

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    with torch.inference_mode():
        # One call at a shorter length first, on the same path: the library code that torch and the C kernels page
        # in on first use (~0.6 MiB for dense SDPA, ~2-3 MiB for Focus in a fresh process) is not what the call
        # holds, and a model pays it once, at its first layer.
        warm_up = make_case(args, min(seq_len, PEAK_MEMORY_WARM_UP_TOKENS), device, dtype)
        (dense_call(warm_up) if top_k is None else focus_call(args, warm_up, top_k))()
        del warm_up
        case = make_case(args, seq_len, device, dtype)
        call = dense_call(case) if top_k is None else focus_call(args, case, top_k)
        # Building the inputs touches more memory than they keep (the hidden states the routing is computed from):
        # without a reset the process's peak could be that of the setup rather than the call.
        peak_reset = reset_peak_rss()
        before = psutil.Process().memory_info().rss
        call()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    queue.put(
        {
            "seq_len": seq_len,
            "variant": "dense SDPA" if top_k is None else "Focus",
            "top_k": top_k,
            "rss_before_call_mib": before / 2**20,
            "peak_rss_mib": peak_kib / 2**10,
            "peak_reset_before_call": peak_reset,
            "warm_up_tokens": min(seq_len, PEAK_MEMORY_WARM_UP_TOKENS),
        }
    )


def reset_peak_rss() -> bool:
    """Reset the process's peak resident set size (Linux: /proc/self/clear_refs "5"); False where not possible, in
    which case the peak measured afterwards may include earlier work.

    Freed heap pages are first handed back to the system (glibc's malloc_trim): pages the setup freed but still
    holds would otherwise be reused by the call without raising the RSS, and make what it adds look smaller by a
    varying amount.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


def peak_memory_rows(args: argparse.Namespace, log: RowLog) -> None:
    """Peak RSS of dense causal SDPA and of Focus at each top_k, each call in a fresh process (same inputs)."""
    import torch

    context = multiprocessing.get_context("spawn")
    for seq_len in args.seq_lens:
        for top_k in [None, *args.top_k]:
            queue = context.Queue()
            process = context.Process(target=peak_memory_child, args=(args, seq_len, top_k, queue))
            process.start()
            process.join()
            if process.exitcode != 0:
                log.add({"seq_len": seq_len, "top_k": top_k, "error": f"exit code {process.exitcode}"})
                continue
            row = queue.get()
            row.update(backend=args.backend, groups=args.groups, window=args.window, sinks=args.sinks, dtype=args.dtype)
            log.add({**row, **machine_fields(torch.device(args.device))})
            print(json.dumps(row), flush=True)


def cuda_peak_memory_rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, log: RowLog) -> None:
    """On a GPU: the peak of the memory torch allocates during one dense causal SDPA call and one Focus call per top_k
    on the same inputs, after warm-up calls at up to PEAK_MEMORY_WARM_UP_TOKENS tokens, and for Focus one more at the
    full length (what is compiled per shape is compiled before the measured call). One process suffices (unlike the
    CPU's resident memory, the allocator's peak can be reset before each call); the inputs are allocated before it,
    so `peak_allocated_mib` includes them, as the CPU rows' peak RSS does."""
    import torch

    from focus_hf.attention.hard import forget_fallbacks

    for seq_len in args.seq_lens:
        forget_fallbacks()  # the rows count their own length's fallbacks (`gpu_path_fields`)
        with torch.inference_mode():
            warm_up = make_case(args, min(seq_len, PEAK_MEMORY_WARM_UP_TOKENS), device, dtype)
            context, kernel = dense_kernel(warm_up.query, warm_up.key, causal=True)
            time_call(dense_call(warm_up), context=context)
            for top_k in args.top_k:
                time_call(focus_call(args, warm_up, top_k))
            del warm_up
            case = make_case(args, seq_len, device, dtype)
            for top_k in [None, *args.top_k]:
                call = dense_call(case) if top_k is None else focus_call(args, case, top_k)
                row = {"seq_len": seq_len, "variant": "dense SDPA" if top_k is None else "Focus", "top_k": top_k}
                try:
                    if top_k is not None:
                        time_call(call)
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                    with context() if top_k is None else contextlib.nullcontext():
                        output = call()
                    torch.cuda.synchronize(device)
                    peak = torch.cuda.max_memory_allocated(device)
                    del output
                    row.update(
                        allocated_before_call_mib=before / 2**20,
                        peak_allocated_mib=peak / 2**20,
                        added_by_call_mib=(peak - before) / 2**20,
                    )
                except Exception as error:  # noqa: BLE001 - out of memory, or a failing path: say so, measure the rest
                    row["error"] = f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]
                    torch.cuda.empty_cache()
                row.update(
                    warm_up_tokens=min(seq_len, PEAK_MEMORY_WARM_UP_TOKENS),
                    full_length_warm_up=top_k is not None,
                    dense_kernel=kernel if top_k is None else None,
                    backend=args.backend,
                    groups=args.groups,
                    window=args.window,
                    sinks=args.sinks,
                    heads=args.heads,
                    kv_heads=args.kv_heads,
                    head_dim=args.head_dim,
                    dtype=args.dtype,
                    **(gpu_path_fields(args, device) if top_k is not None else {}),
                    **machine_fields(device),
                )
                log.add(row)
                shown = ("seq_len", "variant", "top_k", "peak_allocated_mib", "added_by_call_mib", "error")
                print(json.dumps({key: row[key] for key in shown if key in row}), flush=True)
            del case


def run(args: argparse.Namespace) -> int:
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    log = RowLog(args.json)
    if args.calibrate:
        calibrate_rows(args, device, dtype, log)
    elif args.decode:
        decode_rows(args, device, dtype, log)
    elif args.peak_memory and device.type == "cuda":
        cuda_peak_memory_rows(args, device, dtype, log)
    elif args.peak_memory:
        peak_memory_rows(args, log)
    else:
        print(
            f"{'seq_len':>8} {'top_k':>5} {'dense_s':>9} {'focus_s':>9} {'speedup':>8} {'cpu_x':>7} {'ideal':>7}"
            f"{'  path' if args.backend == 'auto' else ''}",
            flush=True,
        )
        with torch.inference_mode():
            for seq_len in args.seq_lens:
                measure = functools.partial(bench_length, args, seq_len, device, dtype)
                for row in rows_or_error(measure, log, "seq_len", seq_len, device):
                    log.add(row)
                    dense = "-" if row["dense_s"] is None else f"{row['dense_s']:.4f}"
                    speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
                    cpu_speedup = "-" if row["cpu_speedup"] is None else f"{row['cpu_speedup']:.2f}x"
                    print(
                        f"{seq_len:>8} {row['top_k']:>5} {dense:>9} {row['focus_s']:>9.4f} {speedup:>8} "
                        f"{cpu_speedup:>7} {row['ideal_speedup']:>6.2f}x  {row['focus_path'] or ''}".rstrip(),
                        flush=True,
                    )
    if args.json and not log.rows:  # nothing measured: still an (empty) result file, as before
        Path(args.json).write_text("[]\n")
    return 1 if log.failed else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from focus_hf.commands.options import add_option

    parser = subparsers.add_parser("bench", help="time hard-mode Focus attention against dense causal attention")
    add_option(
        parser, "--seq-len",
        dest="seq_lens",
        old=("--seq-lens",),
        type=int,
        nargs="+",
        default=[1024, 4096, 16384],
        help="sequence lengths, each timed (with --decode: KV cache lengths)",
    )
    add_option(parser, "--num-groups", dest="groups", type=int, default=8, old=("--groups",), help="number of groups K")
    add_option(
        parser, "--top-k", type=int, nargs="+", default=[1], help="groups per query; several are timed in one loop"
    )
    add_option(parser, "--window", type=int, default=128, help="local window w")
    add_option(parser, "--sink-tokens", dest="sinks", type=int, default=4, old=("--sinks",), help="sink tokens")
    add_option(parser, "--heads", type=int, default=9, help="query heads")
    add_option(parser, "--kv-heads", type=int, default=3, help="key/value heads")
    add_option(parser, "--head-dim", type=int, default=64, help="head dimension")
    add_option(
        parser, "--backend", default="auto", choices=["auto", "sdpa", "flash", "gpu-path", "reference", "stock"],
        help="Focus backend ('stock': the former name of 'gpu-path')",
    )  # fmt: skip
    add_option(parser, "--repeats", type=int, default=5, help="timed repetitions (fewer above 16,384 tokens)")
    add_option(
        parser, "--dense-max-seq-len", type=int, default=None, help="do not time dense attention above this length"
    )
    add_option(parser, "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="q/k/v dtype")
    add_option(parser, "--device", default=None, help="torch device (default: cuda when available, else cpu)")
    add_option(parser, "--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    add_option(
        parser, "--peak-memory",
        action="store_true",
        help="measure the peak memory of one dense SDPA call and one Focus call per length and top_k instead (the "
        "process's peak RSS on the CPU, torch's peak allocated GPU memory on CUDA)",
    )
    add_option(
        parser, "--decode",
        action="store_true",
        help="time one new query against a KV cache of each --seq-len length instead (dense SDPA vs Focus decode)",
    )
    add_option(parser, "--decode-repeats", type=int, default=30, help="timed repetitions per length with --decode")
    add_option(
        parser, "--compile",
        action="store_true",
        help="with --decode on the GPU path: also time both steps under torch.compile (rows with compiled: true)",
    )
    add_option(
        parser, "--decode-steps",
        type=int,
        default=None,
        help="with --decode: steps made back to back per timing, the time being their mean (default: 1 on the CPU, "
        "10 on a GPU)",
    )
    add_option(
        parser, "--calibrate",
        action="store_true",
        help="measure where 'auto' switches from dense to sparse attention on this machine (per --top-k), store it "
        "in the crossover cache and print it",
    )
    add_option(
        parser, "--query-projection",
        dest="query_router",
        old=("--query-router",),
        action="store_true",
        help="route queries with a separate query-side projection (as adapters with query_projection=True do) "
        "instead of by their own key group",
    )
    add_option(parser, "--json", metavar="PATH", help="write the rows as JSON to PATH")
    add_option(parser, "--seed", type=int, default=0, help="random seed")
    parser.set_defaults(func=run)
