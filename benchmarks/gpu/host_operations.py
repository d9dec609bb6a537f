"""What the GPU path asks of the host per call - operators, device reads, allocations - and its peak memory, counted
on the CPU.

Each prefill (a few lengths, top-1 and top-2) and each decoding step (through the paged copy, `PagedKeys`) of the
GPU path runs `hard.hard_attention(backend="gpu-path")` on `benchmarks/gpu/layer_prefill.py`'s layer (32 / 8 heads,
head dim 64, K=8, w=128, 4 sinks, bfloat16: the kernels' dtype) under torch's profiler. The kernels are the CUDA
kernels' *accounting* stand-ins (`accounting_kernels`): they allocate what CUDA's kernels return (output and
log-sum-exp) and compute nothing, so that what is counted is the path's own work on the host, each kernel call
counting as one launch, and the memory is the memory the path allocates around its kernels on a GPU. (The exact CPU
stand-ins of `focus_hf.attention.gpu.cpu_standins` compute in float64 over n x n scores and read their sequence
offsets with `.tolist()`: their own operations are not the GPU's.) Counted per call:

- `operators`: the operators the path dispatches (top-level `aten::` calls, views included: each costs host time);
- `launches`: those that run a kernel on a GPU (not views or bare allocations), each kernel call counted once (an
  operator counts once even where CUDA runs several kernels for it, as sorting does);
- `device_reads`: the operators whose result the host waits for - `aten::_local_scalar_dense` (`.item()`, `int()`,
  `bool()`), `nonzero`, `equal`, `unique`, `masked_select`, `repeat_interleave` without an output size, `bincount` -
  plus `Tensor.tolist()` / `.numpy()`: on CUDA each is a `cudaStreamSynchronize`, which a CUDA graph cannot capture;
- `allocations` / `allocated_bytes`: calls of the allocator (implicit conversions of Python scalars inside an
  operator left out: a CUDA kernel takes those as arguments) and their bytes;
- `peak_added_bytes`: the most memory live at once during the call beyond what was live before it.

`--memory-lengths` adds rows that compare the peak with a dense call the way `focus-hf bench --peak-memory` does on
CUDA: torch's peak allocated memory during one call, the inputs (queries, keys, values, routing) included, against
one call of flash SDPA on the same inputs, which allocates its output and log-sum-exp (4224 MiB at 1M tokens on an
H200: 4096 MiB of output and 128 MiB of log-sum-exp, benchmarks/results/gpu/peak_memory.json).

    python benchmarks/gpu/host_operations.py --lengths 1024 2048 4096 8192 --memory-lengths 4096 65536 \\
        --out benchmarks/results/gpu/host-operations/after.json

Counts are of operators, not times: they do not depend on the machine's load. `--heads` / `--kv-heads` / `--dtype`
change the layer (tests run it smaller).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shlex
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

# Operators whose result the host reads (on CUDA: a device sync).
READ_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::equal",
    "aten::unique",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::masked_select",
    "aten::repeat_interleave",
    "aten::bincount",
}
# Operators that launch no kernel: views, metadata and bare allocations.
NO_KERNEL_OPS = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::resize_",
    "aten::view",
    "aten::_unsafe_view",
    "aten::view_as",
    "aten::reshape",
    "aten::_reshape_alias",
    "aten::as_strided",
    "aten::as_strided_",
    "aten::slice",
    "aten::select",
    "aten::transpose",
    "aten::t",
    "aten::permute",
    "aten::expand",
    "aten::expand_as",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::unfold",
    "aten::alias",
    "aten::narrow",
    "aten::detach",
    "aten::unbind",
    "aten::split",
    "aten::split_with_sizes",
    "aten::chunk",
    "aten::flatten",
    "aten::movedim",
    "aten::contiguous",
    "aten::to",
    "aten::lift_fresh",
    "aten::result_type",
    "aten::is_same_size",
}
# record_function ranges around the accounting kernels: one launch each, whatever runs inside.
KERNEL_RANGE = "focus_hf kernel: "
# Memory events of implicit conversions inside an operator (a Python scalar wrapped as a tensor on the CPU).
IMPLICIT = ("aten::to", "aten::_to_copy")


@dataclasses.dataclass
class HostCount:
    """What one call asked of the host (see the module docstring)."""

    operators: int = 0
    launches: int = 0
    kernel_calls: int = 0
    device_reads: int = 0
    allocations: int = 0
    allocated_bytes: int = 0
    peak_added_bytes: int = 0
    reads_by_operator: dict[str, int] = dataclasses.field(default_factory=dict)
    operators_by_name: dict[str, int] = dataclasses.field(default_factory=dict)

    def row(self, top: int = 12) -> dict:
        row = dataclasses.asdict(self)
        row["operators_by_name"] = dict(Counter(self.operators_by_name).most_common(top))
        return row


def _subtree(event) -> Iterator:
    yield event
    for child in event.cpu_children:
        yield from _subtree(child)


def _ancestors(event) -> Iterator:
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _is_op(name: str) -> bool:
    return "::" in name and not name.startswith(KERNEL_RANGE)


@contextlib.contextmanager
def _host_reads(reads: Counter) -> Iterator[None]:
    """Count `Tensor.tolist()` and `Tensor.numpy()`, which read a tensor's data without dispatching an operator on the
    CPU (on CUDA they copy to the host first and wait)."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def counted(name: str, original: Callable) -> Callable:
        def read(self, *args, **kwargs):
            reads[f"Tensor.{name}"] += 1
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def count_host_operations(call: Callable[[], Any]) -> tuple[Any, HostCount]:
    """Run `call` once under torch's profiler: (its result, what it asked of the host)."""
    from torch.profiler import ProfilerActivity, profile

    python_reads: Counter = Counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler, _host_reads(python_reads):
        result = call()
    events = [event for event in profiler.events() if event.name != "[memory]"]
    count = HostCount()
    names: Counter = Counter()
    reads: Counter = Counter(python_reads)
    ranges = []
    for event in events:
        if event.name.startswith(KERNEL_RANGE):
            if not any(parent.name.startswith(KERNEL_RANGE) for parent in _ancestors(event)):
                count.kernel_calls += 1
                ranges.append(event)
            continue
        if not _is_op(event.name):
            continue
        if any(_is_op(parent.name) or parent.name.startswith(KERNEL_RANGE) for parent in _ancestors(event)):
            continue  # not a top-level operator, or the kernel's own
        names[event.name] += 1
        subtree = [node.name for node in _subtree(event)]
        if any(name not in NO_KERNEL_OPS for name in subtree):
            count.launches += 1
        read = next((name for name in subtree if name in READ_OPS), None)
        if read is not None:
            reads[event.name if event.name == read else f"{event.name} ({read})"] += 1
    count.operators = sum(names.values())
    count.launches += count.kernel_calls
    count.operators_by_name = dict(names)
    count.reads_by_operator = dict(reads)
    count.device_reads = sum(reads.values())
    _memory(profiler, events, count)
    return result, count


def _memory(profiler, events: list, count: HostCount) -> None:
    """Allocations and the peak of live bytes, from the profiler's memory events in time order."""
    memory = sorted(
        (event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"),
        key=lambda event: event.start_ns(),
    )
    # Implicit conversions: an `aten::to` under another operator (its interval holds the allocation).
    implicit = [
        (event.time_range.start, event.time_range.end)
        for event in events
        if event.name in IMPLICIT and event.cpu_parent is not None and _is_op(event.cpu_parent.name)
    ]
    start_us = profiler.profiler.kineto_results.trace_start_ns() / 1e3  # where the events' time ranges start
    live = peak = 0
    for event in memory:
        size = event.nbytes()
        live += size
        peak = max(peak, live)
        if size <= 0:
            continue
        at = event.start_ns() / 1e3 - start_us
        if any(begin <= at <= end for begin, end in implicit):
            continue
        count.allocations += 1
        count.allocated_bytes += size
    count.peak_added_bytes = peak


# --- the kernels' accounting stand-ins ------------------------------------------------------------------------------


def accounting_kernels(varlen_gqa: bool = False):
    """The GPU path's kernels as CUDA's allocate: FlexAttention returns output [B, H, L, D] and float32 log-sum-exp
    [B, H, L], variable-length attention output [T, H, D] and float32 log-sum-exp [H, T]; their values are left
    uninitialised (nothing is computed). Each call is one `KERNEL_RANGE` range. `varlen_gqa`: whether the
    variable-length kernel takes GQA (torch 2.11's on the H200 does not: one call per query head of a kv head)."""
    from focus_hf.attention.gpu import block_masks
    from focus_hf.attention.gpu.flex import block_mask
    from focus_hf.attention.gpu.kernels import cuda_kernels

    def flex(query, key, value, blocks, scale):
        # What `flex.cuda_flex` does on the host before its compiled call (a release without the enforcement checked
        # the lists' values in `GpuKernels.flex` instead).
        getattr(block_masks, "enforce_block_lists", lambda blocks: None)(blocks)
        block_mask(blocks)
        with torch.profiler.record_function(KERNEL_RANGE + "FlexAttention"):
            batch, heads, length, _ = query.shape
            output = query.new_empty(batch, heads, length, value.shape[-1])
            return output, query.new_empty(batch, heads, length, dtype=torch.float32)

    def varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window=-1):
        with torch.profiler.record_function(KERNEL_RANGE + "varlen"):
            tokens, heads, _ = query.shape
            return query.new_empty(tokens, heads, value.shape[-1]), query.new_empty(heads, tokens, dtype=torch.float32)

    # CUDA's kernel set in every other respect (dtypes, head dims), as torch's varlen kernel makes it.
    cuda = cuda_kernels(prefer_flash_attn=False)
    name = "accounting stand-ins of CUDA's kernels (their outputs, nothing computed)"
    return dataclasses.replace(cuda, name=name, raw_flex=flex, raw_varlen=varlen, varlen_gqa=varlen_gqa)


@contextlib.contextmanager
def gpu_path_on(kernels) -> Iterator[None]:
    """`hard.hard_attention`'s GPU path on `kernels`, taken as verified (the accounting stand-ins compute nothing that
    `verify` could check)."""
    import focus_hf.attention.hard as hard

    original = hard.verified_kernels
    hard.verified_kernels = lambda query, key, kernels_=None, backend="auto": kernels
    try:
        yield
    finally:
        hard.verified_kernels = original


# --- the calls ------------------------------------------------------------------------------------------------------


def layer_args(**changes: Any) -> argparse.Namespace:
    """The options of `main` for the benchmark's layer (32 / 8 heads of 64, K 8, w 128, 4 sinks, bfloat16, top-1 and
    top-2), with `changes`: what `prefill_rows`, `decode_rows` and `memory_rows` take."""
    options = dict(heads=32, kv_heads=8, head_dim=64, groups=8, window=128, sinks=4, top_k=[1, 2])
    options.update(dtype="bfloat16", varlen_gqa=False)
    return argparse.Namespace(**{**options, **changes})


def layer_case(args: argparse.Namespace, tokens: int):
    """`benchmarking.layer.make_case`'s inputs for the layer of `args`: random states, routing by causal Sinkhorn."""
    from focus_hf.benchmarking.layer import make_case

    options = argparse.Namespace(
        seed=0,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        groups=args.groups,
        top_k=args.top_k,
        sinks=args.sinks,
        query_router=False,
    )
    return make_case(options, tokens, torch.device("cpu"), getattr(torch, args.dtype))


def layer_pattern(args: argparse.Namespace, routing, queries: slice, keys: int):
    """The pattern a model's layer hands the attention (`function.LayerRouting.pattern`): the routing's groups of the
    call's queries and of its `keys` first keys, the sinks' count and whether queries probe their own group."""
    from focus_hf.attention.pattern import FocusPattern

    return FocusPattern(
        routing.top_groups[:, queries],
        routing.key_groups[:, :keys],
        routing.sink[:, :keys],
        args.groups,
        args.window,
        sink_tokens=args.sinks,
        own_group=routing.own_groups is None,
    )


def prefill_rows(args: argparse.Namespace, tokens: int) -> list[dict]:
    """One prefill of `tokens` tokens per top_k, counted after an uncounted warm-up call."""
    from focus_hf.attention.hard import hard_attention

    case = layer_case(args, tokens)
    rows = []
    for top_k in args.top_k:
        pattern = layer_pattern(args, case.routing[top_k], slice(None), tokens)

        def call():
            return hard_attention(
                case.query, case.key, case.value, pattern, scaling=args.head_dim**-0.5, backend="gpu-path"
            )

        call()
        _, count = count_host_operations(call)
        rows.append({"call": "prefill", "tokens": tokens, "top_k": top_k, **count.row()})
    return rows


def decode_rows(args: argparse.Namespace, cache: int) -> list[dict]:
    """FILE_EVERY consecutive one-query steps from a cache of `cache` keys on, through the paged copy (built before
    the first, uncounted), per top_k: the first step that files nothing, the one that files the positions that left
    the window, and the mean over all of them."""
    from focus_hf.attention.gpu.paged_keys import FILE_EVERY, PagedKeys, filed_before
    from focus_hf.attention.hard import hard_attention

    case = layer_case(args, cache + FILE_EVERY)
    key, value = case.key.contiguous(), case.value.contiguous()  # a KV cache is head-major
    rows = []
    for top_k in args.top_k:
        routing = case.routing[top_k]
        store = PagedKeys(args.groups, args.window)

        def step(n: int):
            pattern = layer_pattern(args, routing, slice(n - 1, n), n)
            query = case.query[:, :, n - 1 : n]
            return hard_attention(
                query,
                key[:, :, :n],
                value[:, :, :n],
                pattern,
                scaling=args.head_dim**-0.5,
                backend="gpu-path",
                key_copy=store,
            )

        step(cache - 1)  # the copy as generate() leaves it before the step at `cache`
        counts = {}
        for n in range(cache, cache + FILE_EVERY):
            counts[n] = count_host_operations(lambda: step(n))[1]
        filing = [n for n in counts if filed_before(n, args.window) > filed_before(n - 1, args.window)]
        plain = next(n for n in counts if n not in filing)
        steps = {"plain step": counts[plain], **({"filing step": counts[filing[0]]} if filing else {})}
        mean = {
            field: sum(getattr(count, field) for count in counts.values()) / len(counts)
            for field in ("operators", "launches", "kernel_calls", "device_reads", "allocations", "allocated_bytes")
        }
        for name, count in steps.items():
            rows.append({"call": "decode", "cache": cache, "top_k": top_k, "step": name, **count.row()})
        rows.append({"call": "decode", "cache": cache, "top_k": top_k, "step": f"mean of {len(counts)}", **mean})
    return rows


def memory_rows(args: argparse.Namespace, tokens: int) -> list[dict]:
    """Per top_k: the peak memory of one prefill against one dense flash SDPA call, as `focus-hf bench --peak-memory`
    measures on CUDA (the inputs held before the call included)."""
    from focus_hf.attention.hard import hard_attention

    case = layer_case(args, tokens)
    query = case.query
    batch, heads, length, _ = query.shape

    def dense():  # flash SDPA's allocations on CUDA: its output and float32 log-sum-exp
        return query.new_empty(query.shape), query.new_empty(batch, heads, length, dtype=torch.float32)

    _, dense_count = count_host_operations(dense)
    rows = []
    for top_k in args.top_k:
        routing = case.routing[top_k]
        pattern = layer_pattern(args, routing, slice(None), tokens)

        def call():
            return hard_attention(
                case.query, case.key, case.value, pattern, scaling=args.head_dim**-0.5, backend="gpu-path"
            )

        call()
        output, count = count_host_operations(call)
        del output
        inputs = sum(tensor.nbytes for tensor in (case.query, case.key, case.value))
        inputs += sum(tensor.nbytes for tensor in (routing.top_groups, routing.key_groups, routing.sink))
        focus, dense_peak = inputs + count.peak_added_bytes, inputs + dense_count.peak_added_bytes
        rows.append(
            {
                "call": "peak memory",
                "tokens": tokens,
                "top_k": top_k,
                "inputs_bytes": inputs,
                "focus_peak_bytes": focus,
                "dense_peak_bytes": dense_peak,
                "peak_ratio": focus / dense_peak,
                "focus_added_bytes": count.peak_added_bytes,
                "dense_added_bytes": dense_count.peak_added_bytes,
            }
        )
    return rows


# --- the command ----------------------------------------------------------------------------------------------------


def print_row(row: dict) -> None:
    if row["call"] == "peak memory":
        print(
            f"peak memory {row['tokens']:>7} top-{row['top_k']}: Focus {row['focus_peak_bytes'] / 2**20:9.1f} MiB, "
            f"dense {row['dense_peak_bytes'] / 2**20:9.1f} MiB, ratio {row['peak_ratio']:.3f}",
            flush=True,
        )
        return
    what = f"prefill {row['tokens']:>7}" if row["call"] == "prefill" else f"decode {row['cache']:>7} {row['step']}"
    print(
        f"{what} top-{row['top_k']}: operators {row['operators']:g}, launches {row['launches']:g}, "
        f"device reads {row['device_reads']:g}, allocations {row['allocations']:g} "
        f"({row['allocated_bytes'] / 2**20:.1f} MiB) {row.get('reads_by_operator') or ''}",
        flush=True,
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="*", default=[1024, 2048, 4096, 8192], help="prefill lengths")
    parser.add_argument("--caches", type=int, nargs="*", default=[4096], help="caches of the decoding steps")
    parser.add_argument("--memory-lengths", type=int, nargs="*", default=[4096], help="lengths of the memory rows")
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--varlen-gqa", action="store_true", help="a variable-length kernel that takes GQA")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    args = parser.parse_args(argv)

    from focus_hf.benchmarking.records import provenance, write_json

    kernels = accounting_kernels(args.varlen_gqa)
    command = shlex.join(["python", "benchmarks/gpu/host_operations.py", *(sys.argv[1:] if argv is None else argv)])
    result = {
        **provenance(torch.device("cpu"), command),
        "what": "host operations and peak memory of the GPU path per call, counted with torch's profiler on the CPU "
        "(benchmarks/gpu/host_operations.py's docstring)",
        "kernels": kernels.name,
        "layer": {name: getattr(args, name) for name in ("heads", "kv_heads", "head_dim", "groups", "window", "sinks")},
        "dtype": args.dtype,
        "varlen_gqa": args.varlen_gqa,
        "rows": [],
    }
    with torch.inference_mode(), gpu_path_on(kernels):
        for tokens in args.lengths:
            for row in prefill_rows(args, tokens):
                print_row(row)
                result["rows"].append(row)
                write_json(args.out, result)
        for cache in args.caches:
            for row in decode_rows(args, cache):
                print_row(row)
                result["rows"].append(row)
                write_json(args.out, result)
        for tokens in args.memory_lengths:
            for row in memory_rows(args, tokens):
                print_row(row)
                result["rows"].append(row)
                write_json(args.out, result)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
