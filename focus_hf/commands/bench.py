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
import datetime
import functools
import itertools
import json
import math
import multiprocessing
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ContextManager, Optional

if TYPE_CHECKING:
    import torch

    from focus_hf.attention.routing import TokenRouting

# Dense attention beyond this many bytes of q/k/v/output is reported as skipped rather than run.
DENSE_MEMORY_FRACTION = 0.5


@dataclass
class Case:
    """One attention layer's inputs: q [1, heads, n, dim], k/v [1, kv_heads, n, dim], and routing per top_k."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    routing: dict[int, TokenRouting]


def make_case(args: argparse.Namespace, seq_len: int, device: torch.device, dtype: torch.dtype) -> Case:
    """Random q/k/v laid out as a model projects them ([1, n, heads, dim] transposed) and real routing."""
    import torch
    import torch.nn.functional as F

    from focus_hf.attention.routing import RoutingState, TokenRouting, route_tokens, routing_scores
    from focus_hf.tuner.config import FocusConfig

    # On a GPU the inputs and the routing are drawn there: drawing 1M tokens' hidden states on the CPU takes longer
    # than the calls being timed. Same seeds, other random streams than on the CPU.
    setup = device if device.type == "cuda" else torch.device("cpu")
    generator = torch.Generator(device=setup).manual_seed(args.seed + seq_len)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=setup)

    defaults = FocusConfig()
    hidden_size = args.heads * args.head_dim
    hidden = draw(1, seq_len, hidden_size)
    projection = draw(hidden_size, defaults.group_dim) / math.sqrt(hidden_size)
    centroids = F.normalize(draw(args.groups, defaults.group_dim), dim=-1)
    scores = routing_scores(hidden, projection, centroids, defaults.temperature)
    query_scores = None
    if args.query_router:  # a separate query-side projection: queries probe groups other than their own
        query_projection = draw(hidden_size, defaults.group_dim) / math.sqrt(hidden_size)
        query_scores = routing_scores(hidden, query_projection, centroids, defaults.temperature)
    del hidden
    valid = torch.ones(1, seq_len, dtype=torch.bool, device=setup)
    routing = {}
    for top_k in args.top_k:
        state = RoutingState.empty(1, defaults.sinkhorn_iterations, args.groups, setup)
        tokens, _ = route_tokens(
            scores,
            valid,
            state,
            iterations=defaults.sinkhorn_iterations,
            top_k=top_k,
            sink_tokens=args.sinks,
            query_scores=query_scores,
        )
        routing[top_k] = TokenRouting(
            tokens.log_probs,
            tokens.top_groups.to(device),
            tokens.sink.to(device),
            own_groups=None if tokens.own_groups is None else tokens.own_groups.to(device),
        )

    def states(heads: int) -> torch.Tensor:
        return draw(1, seq_len, heads, args.head_dim).to(device, dtype).transpose(1, 2)

    return Case(states(args.heads), states(args.kv_heads), states(args.kv_heads), routing)


def allowed_pair_count(routing: TokenRouting, window: int, num_groups: int) -> int:
    """Allowed (query, key) pairs of one sample, counted in O(n K) memory instead of materialising n x n."""
    import torch

    from focus_hf.attention.pattern import probed_distant_keys

    groups, key_groups, sink = routing.top_groups[0].cpu(), routing.key_groups[0].cpu(), routing.sink[0].cpu()
    positions = torch.arange(groups.shape[0])
    local = torch.clamp(positions, max=window) + 1
    farthest = positions - window - 1  # last distant key of each query (negative: none)
    distant_sinks = torch.cumsum(sink.long(), 0)[farthest.clamp(min=0)] * (farthest >= 0)
    probed = probed_distant_keys(groups, key_groups, sink, window, num_groups)
    return int((local + distant_sinks + probed).sum())


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


def dense_call(case: Case) -> Callable[[], torch.Tensor]:
    """The baseline: dense causal SDPA (GQA) on the case's q/k/v."""
    import torch.nn.functional as F

    return lambda: F.scaled_dot_product_attention(case.query, case.key, case.value, is_causal=True, enable_gqa=True)


def dense_kernel(query: torch.Tensor, key: torch.Tensor, causal: bool) -> tuple[Callable[[], ContextManager], str]:
    """(context to run the dense baseline in, the kernel's name): on CUDA torch's flash kernel when it takes inputs
    like these (tried once on a short slice), else torch's own choice, and the row says which, so that a ratio is
    never taken against a slower fallback unknowingly; on the CPU torch's choice."""
    import torch
    import torch.nn.functional as F

    if query.device.type != "cuda":
        return contextlib.nullcontext, "sdpa (torch's choice)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    keys = min(key.shape[2], 256)
    sample = query[:, :, : min(query.shape[2], keys)], key[:, :, :keys], key[:, :, :keys]
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(*sample, is_causal=causal, enable_gqa=True)
        torch.cuda.synchronize()
    except RuntimeError as error:
        reason = " ".join(str(error).split())[:160]
        return contextlib.nullcontext, f"sdpa (torch's choice; the flash kernel refused these inputs: {reason})"
    return functools.partial(sdpa_kernel, SDPBackend.FLASH_ATTENTION), "flash (torch SDPA)"


def focus_call(args: argparse.Namespace, case: Case, top_k: int) -> Callable[[], torch.Tensor]:
    import torch

    from focus_hf.attention.hard import hard_attention
    from focus_hf.attention.pattern import allowed_pairs
    from focus_hf.attention.reference import dense_attention

    routing = case.routing[top_k]
    scaling = args.head_dim**-0.5
    key_groups = routing.key_groups
    if args.backend == "reference":
        positions = torch.arange(case.query.shape[2], device=case.query.device)
        return lambda: dense_attention(
            case.query,
            case.key,
            case.value,
            allowed_pairs(routing.top_groups, key_groups, routing.sink, positions, positions, args.window)[:, None],
            scaling=scaling,
        )
    return lambda: hard_attention(
        case.query,
        case.key,
        case.value,
        None,
        query_groups=routing.top_groups,
        key_groups=key_groups,
        key_sink=routing.sink,
        num_groups=args.groups,
        window=args.window,
        scaling=scaling,
        backend=args.backend,
        own_group=routing.own_groups is None,  # as a model's routing says it
    )


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


def medians(times: list[tuple[float, float]]) -> tuple[Optional[float], Optional[float]]:
    """Median wall and CPU seconds, or (None, None) when nothing was timed."""
    if not times:
        return None, None
    return statistics.median(wall for wall, _ in times), statistics.median(cpu for _, cpu in times)


def repeats_at(args: argparse.Namespace, seq_len: int) -> int:
    """Fewer repetitions on long sequences: halved per doubling above 16,384 tokens, never below 2."""
    return max(2, min(args.repeats, args.repeats * 16384 // seq_len))


def bench_length(args: argparse.Namespace, seq_len: int, device: torch.device, dtype: torch.dtype) -> list[dict]:
    from focus_hf.attention.crossover import auto_path, crossover_entry, race_pending
    from focus_hf.attention.hard import forget_fallbacks, hard_attention, path_kind

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
    for _ in range(repeats_at(args, seq_len)):
        if skip is None:
            dense_times.append(time_call(dense, context=dense_context))
        for top_k, call in calls.items():
            focus_times[top_k].append(time_call(call))
    others = meter()
    dense_s, dense_cpu_s = medians(dense_times)
    paths, races = {}, {}
    for top_k in args.top_k if args.backend == "auto" else ():
        layer = (case.query, case.key, top_k, args.groups, args.window, kinds[top_k], hard_attention)
        # what "auto" ran: "dense" (the masked call), "sparse" (the C kernels on the CPU) or "sparse-torch"
        paths[top_k] = auto_path(*layer)
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
                "race": races.get(top_k),
                "other_cores_busy": others,
                **gpu_path_fields(args, device),
                **machine_fields(device),
            }
        )
    return rows


def layer_fields(args: argparse.Namespace) -> dict:
    """The attention layer a row measures: K, window, sinks and head shape."""
    names = ("groups", "window", "sinks", "heads", "kv_heads", "head_dim")
    return {name: getattr(args, name) for name in names}


def other_cores(device: torch.device) -> Callable[[], Optional[float]]:
    """Start watching the machine while a length is timed; the returned function gives the cores other processes
    kept busy meanwhile, on average (`crossover.other_cores_meter`; None on a GPU or where /proc/stat is missing). The
    rows' 1-minute load average counts the benchmark's own threads; this does not."""
    from focus_hf.attention.crossover import other_cores_meter

    if device.type != "cpu":
        return lambda: None
    stop = other_cores_meter()

    def busy() -> Optional[float]:
        cores = stop()
        return None if cores is None else round(cores, 2)

    return busy


def device_name(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def machine_fields(device: torch.device) -> dict:
    """Where and when a row was measured: device, processor name (on the CPU with its instruction sets and how the C
    kernels were built: compiler, target, what the build uses), threads, load, package versions, the source's git
    commit and the date."""
    import torch

    from focus_hf.attention.cpu.build import instruction_sets, torch_kernels
    from focus_hf.attention.cpu.native import build_record
    from focus_hf.attention.crossover import processor_name

    cpu = {}
    if device.type == "cpu":
        cpu = {"instruction_sets": instruction_sets(), "cpu_kernels": build_record(), "torch_kernels": torch_kernels()}
    return {
        "device": device_name(device),
        "processor": processor_name(device),
        **cpu,
        "threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0],  # other processes on the machine skew CPU timings
        **{name: version for name, version in package_versions().items() if name != "python"},
        "git_commit": git_commit(),
        "date": now(),
    }


def gpu_path_fields(args: argparse.Namespace, device: torch.device) -> dict:
    """On the GPU path (CUDA, or `--backend stock`), what ran the row's Focus calls (`hard.path_record`): verify's
    verdicts, the calls since the row's length began that fell back to the reference path - a row with any is not a
    Focus figure - and FlexAttention's compilations. Nothing elsewhere."""
    if device.type != "cuda" and args.backend != "stock":
        return {}
    from focus_hf.attention.hard import path_record

    return {"gpu_path": path_record()}


def provenance(device: torch.device, command: Optional[str]) -> dict:
    """What a benchmark's JSON records about its run: device, package versions, git commit, command and date."""
    return {
        "device": device_name(device),
        "versions": package_versions(),
        "git_commit": git_commit(),
        "command": command,
        "date": now(),
    }


def package_versions() -> dict[str, Optional[str]]:
    """Versions of Python and of the packages a result depends on (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    import focus_hf

    versions: dict[str, Optional[str]] = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("transformers", "peft"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    versions["focus_hf"] = focus_hf.__version__
    return versions


@functools.lru_cache(maxsize=1)
def git_commit() -> Optional[str]:
    """$FOCUS_HF_GIT_COMMIT where set (a copy of a working tree, as on a lent GPU machine, whose .git - if it has one -
    may be older than the tree: one recorded 3056b1b-dirty for a run of 432b95d), else the commit of the focus_hf
    checkout that runs ("-dirty" with uncommitted changes to tracked files), else None."""
    if os.environ.get("FOCUS_HF_GIT_COMMIT"):
        return os.environ["FOCUS_HF_GIT_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists():
        git = ["git", "-C", str(root)]
        try:
            head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
            status = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True)
        except OSError:  # no git executable
            head = None
        if head is not None and head.returncode == 0:
            return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")
    return None


def now() -> str:
    """The current date and time, ISO 8601 with the UTC offset."""
    return datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds")


def command_line() -> Optional[str]:
    """The command that runs `focus-hf`, as typed (`focus-hf ...` or `python -m focus_hf.cli ...`); None when the
    command line is not focus-hf's own (called in-process, e.g. by a test)."""
    if not sys.argv:
        return None
    if Path(sys.argv[0]).name == "focus-hf":
        return shlex.join(["focus-hf", *sys.argv[1:]])
    if Path(sys.argv[0]).parts[-2:] == ("focus_hf", "cli.py"):
        return shlex.join(["python", "-m", "focus_hf.cli", *sys.argv[1:]])
    return None


class RowLog:
    """The rows of one run, each stamped with the command, written to `path` (when given) as a JSON list after every
    row, so that a run stopped part-way (a time limit) keeps what it measured."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = Path(path) if path else None
        self.rows: list[dict] = []
        self.failed = False  # a length failed (`rows_or_error`): the command exits with 1
        self.command = command_line()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, row: dict) -> dict:
        row["command"] = self.command  # so committed results say how they were produced
        self.rows.append(row)
        if self.path is not None:
            self.path.write_text(json.dumps(self.rows, indent=2) + "\n")
        return row


def rows_or_error(
    measure: Callable[[], list[dict]], log: RowLog, length_key: str, length: int, device: torch.device
) -> list[dict]:
    """The rows `measure()` returns; when it fails (out of memory, a path that breaks), one error row in their place
    and the traceback on stderr, so that the lengths after it are still measured (the command then exits with 1)."""
    import torch

    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - reported in the row, on stderr and in the exit code
        traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log.failed = True
        summary = f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]
        log.add({length_key: length, "error": summary, **machine_fields(device)})
        return []


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
    """The GPU path's decoding steps (`stock.paged_decode`): per repetition, FILE_EVERY consecutive steps from a cache
    of `cache_len` keys on, as generate() makes them - each step's ring write, and the one filing of positions that
    left the window among them - through a paged copy built (untimed) before the first; dense SDPA over the same
    growing caches. `compiled`: both steps under torch.compile (dynamic shapes; compiled in the untimed warm-up).
    Returns (dense times, Focus times by top_k, the dense kernel's name), seconds per step."""
    import torch
    import torch.nn.functional as F

    from focus_hf.attention.gpu.paged_keys import FILE_EVERY, PagedKeys
    from focus_hf.attention.hard import hard_attention

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
            return hard_attention(
                case.query[:, :, n - 1 : n],
                key[:, :, :n],
                value[:, :, :n],
                None,
                query_groups=routing.top_groups[:, n - 1 : n],
                key_groups=routing.key_groups[:, :n],
                key_sink=routing.sink[:, :n],
                num_groups=args.groups,
                window=args.window,
                scaling=scaling,
                backend=args.backend,
                paged=store,
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
    `stock.paged_decode`, `paged_decode_times` - unless "auto" finds the dense masked call faster at this length),
    timed alternately."""
    import torch
    import torch.nn.functional as F

    from focus_hf.attention.cpu.grouped_keys import one_step_behind
    from focus_hf.attention.cpu.native import serves
    from focus_hf.attention.hard import forget_fallbacks, hard_attention
    from focus_hf.attention.pattern import probes

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

        def step() -> torch.Tensor:
            rewind()
            return hard_attention(
                case.query,
                case.key,
                case.value,
                None,
                query_groups=routing.top_groups[:, -1:],
                key_groups=routing.key_groups,
                key_sink=routing.sink,
                num_groups=args.groups,
                window=args.window,
                scaling=scaling,
                backend=args.backend,
                grouped=[grouped],
                own_group=routing.own_groups is None,
            )

        return step

    crossovers = {top_k: crossover_used(args, case, top_k, "decode", decode=True) for top_k in args.top_k}
    repeats = args.decode_repeats
    gpu_path = device.type == "cuda" or args.backend == "stock"
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
    # What the group-sorted copy's attention runs on: the C kernel of `attention/cpu/native.py`, or torch operations.
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
        path = "dense-masked" if crossover is not None and cache_len < crossover else copy
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
    parser = subparsers.add_parser("bench", help="time hard-mode Focus attention against dense causal attention")
    parser.add_argument(
        "--seq-lens",
        type=int,
        nargs="+",
        default=[1024, 4096, 16384],
        help="sequence lengths (with --decode: KV cache lengths)",
    )
    parser.add_argument("--groups", type=int, default=8, help="number of groups K")
    parser.add_argument(
        "--top-k", type=int, nargs="+", default=[1], help="groups per query; several are timed in one loop"
    )
    parser.add_argument("--window", type=int, default=128, help="local window w")
    parser.add_argument("--sinks", type=int, default=4, help="sink tokens")
    parser.add_argument("--heads", type=int, default=9, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=3, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension")
    parser.add_argument(
        "--backend", default="auto", choices=["auto", "sdpa", "flash", "stock", "reference"], help="Focus backend"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions (fewer above 16,384 tokens)")
    parser.add_argument(
        "--dense-max-seq-len", type=int, default=None, help="do not time dense attention above this length"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="q/k/v dtype")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    parser.add_argument(
        "--peak-memory",
        action="store_true",
        help="measure the peak memory of one dense SDPA call and one Focus call per length and top_k instead (the "
        "process's peak RSS on the CPU, torch's peak allocated GPU memory on CUDA)",
    )
    parser.add_argument(
        "--decode",
        action="store_true",
        help="time one new query against a KV cache of each --seq-lens length instead (dense SDPA vs Focus decode)",
    )
    parser.add_argument("--decode-repeats", type=int, default=30, help="timed repetitions per length with --decode")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="with --decode on the GPU path: also time both steps under torch.compile (rows with compiled: true)",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help="with --decode: steps made back to back per timing, the time being their mean (default: 1 on the CPU, "
        "10 on a GPU)",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure where 'auto' switches from dense to sparse attention on this machine (per --top-k), store it "
        "in the crossover cache and print it",
    )
    parser.add_argument(
        "--query-router",
        action="store_true",
        help="route queries with a separate query-side projection (as adapters with query_projection=True do) "
        "instead of by their own key group",
    )
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.set_defaults(func=run)
