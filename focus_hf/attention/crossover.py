"""Where "auto" switches from one dense masked call to the sparse path: measured once per machine and shape.

The crossover (key count below which the dense masked call is faster) depends on the processor, the build of the C
kernels and the level of torch's own (`Shape`), the thread count, the dtype, the head shape, top_k, K, the window
and which sparse path runs (`kind`): "shared" (queries probe their own key group first), "probe" (a separate query
router with top_k = 1), "separate" (a separate query router with top_k > 1) - all three run set A through
`partials.probe_part`, but their group balance differs - or "decode" (a few queries against a longer cache,
`fast.decode_attention`). On first use of a shape, `dense_below` times both paths at lengths
256, 512, ... through the very function that dispatches the call (`hard.hard_attention`, told which path to take), on
random inputs laid out as a model hands them over and with the per-step work of a decoding step (the update of the
layer's copy of the distant keys) - so that what is measured is what then runs - until the sparse path wins twice in a
row by at least WIN_MARGIN (a few seconds at most; never beyond MAX_LENGTH) and stores the first of those two lengths
in `<cache>/crossover.json` (`aliases.default_cache_dir`: `$FOCUS_HF_CACHE`, else `~/.cache/focus_hf`), where every
later process finds it. On the CPU the sparse path is timed both in the C kernels and in torch operations, and the
faster runs at each length; a prefill far longer than any length timed so (a calibration call there would take
seconds) runs once on both, timed as it runs (`race_sparse_paths`), and its row joins the entry. A CPU measurement
taken while other processes kept more than OTHER_CORES_MAX cores busy (from /proc/stat) is used by this process only
and not stored: under load the many small calls of the sparse path slow down more than the one dense call (a decode
crossover measured so came out at 16K keys instead of 2K), and a stored value would stay wrong.

Environment:
  FOCUS_HF_CROSSOVER=<tokens>   use this crossover for every shape (no measurement);
  FOCUS_HF_CROSSOVER=measure    (or unset) measure on first use, then read the cache;
  FOCUS_HF_NO_CALIBRATION=1     never measure and ignore the cache: the conservative DEFAULT_DENSE_BELOW table
                                (the test suite sets this, so that no result depends on timings).
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from focus_hf.aliases import default_cache_dir
from focus_hf.attention.cpu.build import cpuinfo_field, torch_kernels
from focus_hf.attention.cpu.native import kernels_identity
from focus_hf.files import file_lock, write_atomically

CROSSOVER_ENV = "FOCUS_HF_CROSSOVER"
NO_CALIBRATION_ENV = "FOCUS_HF_NO_CALIBRATION"
CACHE_FILE = "crossover.json"
# Bumped whenever the speed of the sparse or the dense masked path changes, or how it is measured, so that older
# crossovers are re-measured (9: a win needs WIN_MARGIN, timings are medians; 10: decoding steps read a group-sorted
# copy of the distant keys; 11: the dense masked call's bias is written in one gather; 12: prefill lengths are
# timed three times each; 13: a decoding step's window rides behind its first group's keys, one call; 14: a float32
# CPU decoding step runs in the C kernel of `native`; 15: its long calls run on torch's OpenMP threads; 16: at top_k
# = 1 every segment's chunks read the sinks, no separate sink pass; 17: float32 CPU calls run the C prefill kernel
# - the dense masked call with the pattern read from group bits, causal squares, staircases and the local part;
# 18: set A runs in one call of the C kernel, blocks of 128 keys; 19: its group sort is a counting sort in C, the
# sink pairs run in the kernel; 20: on CUDA both sides run the stock-kernel path, FlexAttention and varlen; 21: both
# sides are timed through `hard.hard_attention`, the function that dispatches them, CUDA decoding steps in runs of
# FILE_EVERY); 22: on CPU the sparse path is also timed on torch operations (`native.torch_path`), and the faster of
# the two runs at each length; 24: rows keep each sparse path's time apart from the faster one's, "sparse_s"; 25: the
# shape names the level of torch's own CPU kernels, which run the dense side).
CACHE_VERSION = 25
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
# Cores that other processes may keep busy, on average, while a CPU crossover is measured for it to be stored; the
# load is averaged over at least WATCH_MIN_S (a short measurement waits out the rest, so that the reading is not
# just the kernel's 10 ms accounting ticks).
OTHER_CORES_MAX = 0.3
WATCH_MIN_S = 0.5

# Without a measurement: key counts below which "auto" runs the dense masked call, per device type and top_k (other
# top_k: PER_PROBE * top_k). Conservative: on the 2-core CPUs measured so far the sparse path won at top_k = 1
# somewhere between 512 and 1,024 keys, at top_k = 2 near 2,048, at 3 near 3,000, at 4 near 4,000. CUDA: a guess.
DEFAULT_DENSE_BELOW = {"cpu": {1: 1024, 2: 2048}, "cuda": {}}
PER_PROBE = {"cpu": 1024, "cuda": 4096}

KINDS = ("shared", "probe", "separate", "decode")


@dataclass(frozen=True)
class Shape:
    """What a crossover is measured for."""

    device: str  # device type: "cpu", "cuda"
    processor: str
    kernels: str  # on the CPU, the C kernels' build (`native.kernels_identity`); "" elsewhere
    threads: int
    torch: str
    torch_kernels: str  # on the CPU, the level of torch's own kernels and its limits (`torch_kernels_level`)
    dtype: str
    heads: int
    kv_heads: int
    head_dim: int
    top_k: int
    num_groups: int
    window: int
    kind: str

    @property
    def key(self) -> str:
        return "|".join(str(value) for value in asdict(self).values())


def processor_name(device: Optional[torch.device] = None) -> str:
    """The GPU's name on CUDA, else the CPU's model name (from /proc/cpuinfo on Linux; platform's guess elsewhere)."""
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo), else what `platform` says of it."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def make_shape(query: torch.Tensor, key: torch.Tensor, top_k: int, num_groups: int, window: int, kind: str) -> Shape:
    """The shape of a call with query [batch, heads, q, dim] and key [batch, kv_heads, kv, dim]."""
    return Shape(
        device=query.device.type,
        processor=processor_name(query.device),
        kernels=kernels_identity() if query.device.type == "cpu" else "",
        threads=torch.get_num_threads() if query.device.type == "cpu" else 0,
        torch=torch.__version__,
        torch_kernels=torch_kernels_level() if query.device.type == "cpu" else "",
        dtype=str(query.dtype).removeprefix("torch."),
        heads=query.shape[1],
        kv_heads=key.shape[1],
        head_dim=query.shape[3],
        top_k=top_k,
        num_groups=num_groups,
        window=window,
        kind=kind,
    )


def torch_kernels_level() -> str:
    """The level of torch's CPU kernels as one word, with any limits set on them: "AVX512", or "AVX2
    MKL_ENABLE_INSTRUCTIONS=AVX2". Dense SDPA, the other side of every CPU crossover, runs them: a processor's
    crossover measured with torch capped at AVX2 does not hold for its uncapped runs (`build.torch_kernels`)."""
    record = torch_kernels()
    return " ".join([record["capability"], *(f"{name}={value}" for name, value in sorted(record["limits"].items()))])


def default_dense_below(device_type: str, top_k: int) -> int:
    return DEFAULT_DENSE_BELOW.get(device_type, {}).get(top_k, PER_PROBE.get(device_type, 0) * top_k)


def cache_path() -> Path:
    return default_cache_dir() / CACHE_FILE


def read_cache(path: Optional[Path] = None) -> dict[str, dict]:
    """The cached entries by shape key; {} when the file is missing, unreadable or of an older version. A file that is
    not a crossover cache at all (corrupt, or another program's) is warned of, once, and replaced at the next write;
    an entry that is not one (no whole-number `dense_below`, timings that are not rows) is dropped, and measured
    again."""
    path = cache_path() if path is None else path
    try:
        text = path.read_bytes()
    except OSError:  # missing or unreadable: measured again, and `write_entry` says if it cannot store it
        return {}
    try:
        data = json.loads(text)
    except ValueError as error:
        _warn_unusable(path, f"it is not JSON ({error})")
        return {}
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict) or "version" not in data:
        _warn_unusable(path, "it is not a crossover cache")
        return {}
    if data["version"] != CACHE_VERSION:
        return {}  # an older measurement: taken again
    entries = {key: entry for key, entry in data["entries"].items() if _is_entry(entry)}
    if len(entries) < len(data["entries"]):
        _warn_unusable(path, f"{len(data['entries']) - len(entries)} of its entries are not crossover measurements")
    return entries


def _is_entry(entry: object) -> bool:
    """Whether a cached value has what this module reads of an entry (`crossover_entry`, `sparse_path_at`,
    `race_due`)."""
    if not isinstance(entry, dict) or type(entry.get("dense_below")) is not int:
        return False
    timings = entry.get("timings", [])
    return isinstance(timings, list) and all(
        isinstance(row, dict)
        and type(row.get("length")) is int
        and row.get("sparse_path", "sparse") in SPARSE_PATHS
        and all(isinstance(row.get(name, 0.0), (int, float)) for name in PATH_TIMES.values())
        for row in timings
    )


# The cache files this process has warned of (`read_cache`): once each.
_warned_unusable: set[Path] = set()


def _warn_unusable(path: Path, why: str) -> None:
    if path not in _warned_unusable:
        _warned_unusable.add(path)
        warnings.warn(
            f"focus_hf: the crossover cache {path} is not usable: {why}. Its crossovers are measured again and the "
            "file is replaced.",
            RuntimeWarning,
            stacklevel=3,
        )


def write_entry(shape: Shape, entry: dict, path: Optional[Path] = None) -> None:
    """Add one entry to the cache file: re-read and replaced (`files.replacing`: readers never see part of it) under
    a lock beside it, so that processes measuring at once keep every one's entries. An unwritable cache is not an
    error: the value is then kept for this process only."""
    path = cache_path() if path is None else path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path.with_name(path.name + ".lock")):
            entries = read_cache(path)
            entries[shape.key] = dict(entry, shape=asdict(shape))
            write_atomically(path, json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1))
    except OSError as error:
        print(f"focus_hf: could not write the crossover cache {path}: {error}", file=sys.stderr)


def find_crossover(
    time_at: Callable[[int], tuple[float, float]],
    lengths: tuple[int, ...] = LENGTHS,
    budget_s: float = BUDGET_S,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[int, list[dict]]:
    """The first of two consecutive lengths at which the sparse path beats the dense call by WIN_MARGIN, and the
    timings.

    `time_at(n)` returns (dense seconds, sparse seconds) at n keys. If the sparse path never wins twice in a row
    within the lengths (or the budget runs out), the crossover is the length after the last one measured, capped at
    MAX_LENGTH: the dense call stays where it was seen to win.
    """
    rows: list[dict] = []
    start = clock()
    for index, length in enumerate(lengths):
        dense_s, sparse_s = time_at(length)
        rows.append({"length": length, "dense_s": dense_s, "sparse_s": sparse_s})
        if len(rows) >= 2 and all(row["sparse_s"] * WIN_MARGIN <= row["dense_s"] for row in rows[-2:]):
            return rows[-2]["length"], rows
        if clock() - start > budget_s:
            following = lengths[index + 1] if index + 1 < len(lengths) else length
            return min(following, MAX_LENGTH), rows
    return min(lengths[-1], MAX_LENGTH), rows


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


# The paths `call` takes when told (`hard.hard_attention`'s `path`): the pattern as one dense masked call, the sparse
# path of the call's kind, and on the CPU that sparse path in torch operations alone (`native.torch_path`: a
# processor the C kernels are slow on - an unknown one, a build for an older target - then costs nothing).
PATHS = ("dense", "sparse", "sparse-torch")
SPARSE_PATHS = ("sparse", "sparse-torch")
# A row's own time of each sparse path, where both are timed (its "sparse_s" is the faster of them).
PATH_TIMES = {"sparse": "kernels_s", "sparse-torch": "torch_s"}
# What `auto_path` answers for a call to run on every sparse path, timed (`race_sparse_paths`).
RACE = "race"
# A timing: (untimed preparation, the timed calls, how many steps they make).
Timing = tuple[Callable[[], object], Callable[[], object], int]


def dispatched_calls(
    shape: Shape, length: int, device: torch.device, generator: torch.Generator, call: Callable[..., torch.Tensor]
) -> dict[str, Timing]:
    """What `auto` runs at `length` keys for `shape`, on each path: `call` (the function that dispatches a model's
    calls, `hard.hard_attention`) with the arguments a model gives it - own_group as the routing knows it; a
    decoding step with the layer's copy of the distant keys, which each step brings up to date (on the CPU the
    group-sorted copy, one key appended per step as in generate(); on CUDA the paged copy, timed over FILE_EVERY
    consecutive steps, so that its ring writes and its one filing count)."""
    from focus_hf.attention.cpu.grouped_keys import one_step_behind
    from focus_hf.attention.cpu.native import native_kernels
    from focus_hf.attention.gpu.paged_keys import FILE_EVERY, PagedKeys

    decode = shape.kind == "decode"
    steps = FILE_EVERY if decode and device.type == "cuda" else 1
    inputs = random_inputs(shape, length + steps - 1, 1 if decode else length, device, generator)
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    query_groups, key_groups, key_sink = inputs["query_groups"], inputs["key_groups"], inputs["key_sink"]
    routing = {
        "num_groups": shape.num_groups,
        "window": shape.window,
        "scaling": shape.head_dim**-0.5,
        "backend": "auto",
        "own_group": shape.kind in ("shared", "decode"),  # `random_inputs`: queries probe their own group first
    }

    def nothing() -> None:
        return None

    paths = PATHS if device.type == "cpu" and native_kernels() is not None else PATHS[:2]
    if not decode:
        routing.update(query_groups=query_groups, key_groups=key_groups, key_sink=key_sink)
        return {
            path: (nothing, functools.partial(call, query, key, value, None, **routing, path=path), 1) for path in paths
        }
    if device.type != "cuda":
        grouped, rewind = one_step_behind(key, value, key_groups, key_sink, shape.num_groups, shape.window)
        routing.update(query_groups=query_groups, key_groups=key_groups, key_sink=key_sink, grouped=[grouped])
        return {
            path: (rewind, functools.partial(call, query, key, value, None, **routing, path=path), 1) for path in paths
        }
    paged = PagedKeys(shape.num_groups, shape.window)

    def step(n: int, path: str) -> torch.Tensor:
        """The step whose newest key is n - 1 (the same query each step: the keys are what changes)."""
        return call(
            query,
            key[:, :, :n],
            value[:, :, :n],
            None,
            query_groups=query_groups,
            key_groups=key_groups[:, :n],
            key_sink=key_sink[:, :n],
            paged=paged,
            path=path,
            **routing,
        )

    def rebuilt() -> None:  # the copy as generate() leaves it before the first timed step
        paged.invalidate()
        step(length - 1, "sparse")

    def run(path: str) -> None:
        for n in range(length, length + steps):
            step(n, path)

    return {
        "dense": (nothing, functools.partial(run, "dense"), steps),
        "sparse": (rebuilt, functools.partial(run, "sparse"), steps),
    }


def measure(
    shape: Shape,
    device: torch.device,
    call: Callable[..., torch.Tensor],
    lengths: Optional[tuple[int, ...]] = None,
) -> tuple[int, list[dict]]:
    """Time `call` - the function that dispatches "auto"'s calls, `hard.hard_attention` - on its dense masked path
    against its sparse path (`dispatched_calls`) at each of `lengths` (default LENGTHS); see `find_crossover`. Where
    the sparse path runs both in the C kernels and in torch operations (CPU), the faster of the two is the sparse time
    at each length, and each row names it ("sparse_path", with both times)."""

    def timed(function: Callable[[], object]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        function()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    generator = torch.Generator().manual_seed(0)

    def time_at(length: int, sparse_only: bool = False) -> tuple[Optional[float], float]:
        calls = dispatched_calls(shape, length, device, generator, call)
        if sparse_only:
            calls = {path: timing for path, timing in calls.items() if path != "dense"}
        # CPU decoding steps take a fraction of a millisecond: many repetitions; prefills (and runs of CUDA decoding
        # steps): the median of three (one timing at 4K and beyond once put a crossover where the sparse path then
        # ran 0.68x of dense), within BUDGET_S.
        repeats = 31 if shape.kind == "decode" and device.type != "cuda" else 3
        for prepare, run, _ in calls.values():  # warm-up
            prepare()
            run()
        times: dict[str, list[float]] = {path: [] for path in calls}
        for _ in range(repeats):  # alternating, so that all see the same machine
            for path, (prepare, run, steps) in calls.items():
                prepare()
                times[path].append(timed(run) / steps)
        # Medians: a best-of favours the path of many small calls, whose typical time varies the most.
        medians = {path: statistics.median(values) for path, values in times.items()}
        sparse = {path: medians[path] for path in SPARSE_PATHS if path in medians}
        fastest = min(sparse, key=sparse.__getitem__)
        sparse_rows[length] = {"sparse_path": fastest, **{PATH_TIMES[path]: value for path, value in sparse.items()}}
        return medians.get("dense"), sparse[fastest]

    sparse_rows: dict[int, dict] = {}
    lengths = LENGTHS if lengths is None else lengths
    started = time.perf_counter()
    with torch.inference_mode():
        crossover, rows = find_crossover(time_at, lengths)
        # Which sparse path is the faster can change with the length (the C kernels' key blocks stream from beyond
        # the core's cache on long calls): the two are timed on at the longer lengths, within the budget.
        if any(PATH_TIMES["sparse-torch"] in row for row in sparse_rows.values()):
            for length in lengths[len(rows) :]:
                if time.perf_counter() - started > 2 * BUDGET_S:
                    break
                _, sparse_s = time_at(length, sparse_only=True)
                rows.append({"length": length, "dense_s": None, "sparse_s": sparse_s})
    return crossover, [dict(row, **sparse_rows.get(row["length"], {})) for row in rows]


def sparse_path_at(entry: dict, length: int) -> str:
    """Which sparse path a measured entry runs at `length` keys: the faster one ("sparse": the C kernels, or
    "sparse-torch") at the measured length nearest to it (by ratio; the shorter of two as near), "sparse" where the
    entry has no such timings."""
    measured = entry.get(_SPARSE_PATHS)
    if measured is None:
        measured = _sparse_paths(entry)
    if not measured:
        return "sparse"
    # The measured lengths around `length` (sorted, so a bisection: this runs at every decoding step).
    at = bisect.bisect_right(measured, (length, "~"))
    if at == 0:
        return measured[0][1]
    below = measured[at - 1]
    if at < len(measured) and measured[at][0] * below[0] < length * length:  # nearer above, by ratio
        return measured[at][1]
    return below[1]


def _sparse_paths(entry: dict) -> list[tuple[int, str]]:
    """(length, faster sparse path) of an entry's timings, sorted by length."""
    return sorted((row["length"], row["sparse_path"]) for row in entry.get("timings", []) if "sparse_path" in row)


# A prefill whose length is not within RACE_FACTOR of a length at which both sparse paths were timed runs on both,
# timed (`race_sparse_paths`), unless at the nearest such length the slower took RACE_WITHIN times the faster's time
# or more: the order did not change by that much from 16K to 64K on an AVX2 machine (C kernels / torch path 0.99 ->
# 1.17 at top-1, 0.86 -> 1.07 at top-2), while racing a path twice as slow would cost a 64K prefill's layer 3x.
RACE_FACTOR = 2
RACE_WITHIN = 1.5


def race_due(entry: dict, length: int) -> bool:
    """Whether a prefill of `length` keys should time both sparse paths as it runs: the entry timed both somewhere
    (in practice up to MAX_LENGTH) but nowhere within RACE_FACTOR of `length`, and at the nearest of those lengths
    the two were within RACE_WITHIN of each other."""
    raced = [row for row in entry.get("timings", []) if all(name in row for name in PATH_TIMES.values())]
    if not raced:
        return False
    nearest = min(raced, key=lambda row: abs(math.log(row["length"] / length)))
    if nearest["length"] * RACE_FACTOR >= length and length * RACE_FACTOR >= nearest["length"]:
        return False
    times = [nearest[name] for name in PATH_TIMES.values()]
    return max(times) < RACE_WITHIN * min(times)


# The key under which an entry known in this process (`_known`) keeps `_sparse_paths`, worked out once.
_SPARSE_PATHS = "sparse_paths"
# Whether this process has said that a measurement under load is not stored.
_said_under_load: list[bool] = []
# Crossovers already known in this process, by call signature (`_call_key`): looked up on every attention call,
# so the key is built from the tensors without the `Shape` (processor name, version strings).
_known: dict[tuple, dict] = {}
# Held while a crossover is looked up in the cache file or measured (`crossover_entry`).
_measuring = threading.RLock()


def _call_key(query: torch.Tensor, key: torch.Tensor, top_k: int, num_groups: int, window: int, kind: str) -> tuple:
    """What decides a call's `Shape` within this process (the processor and versions are fixed in it)."""
    cpu = query.device.type == "cpu"
    threads, kernels = (torch.get_num_threads(), kernels_identity()) if cpu else (0, "")
    heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[3]
    return (query.device, query.dtype, kernels, threads, heads, kv_heads, head_dim, top_k, num_groups, window, kind)


def forced_crossover() -> Optional[int]:
    """FOCUS_HF_CROSSOVER as a number of tokens, or None when unset or "measure"."""
    value = os.environ.get(CROSSOVER_ENV, "").strip()
    if value in ("", "measure"):
        return None
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"{CROSSOVER_ENV} must be a number of tokens or 'measure', not {value!r}") from None


def calibration_disabled() -> bool:
    return os.environ.get(NO_CALIBRATION_ENV, "").strip().lower() not in ("", "0", "false", "no")


def cpu_counters() -> Optional[tuple[float, float, float]]:
    """(CPU seconds the whole machine has been busy, this process's CPU seconds, wall clock); None without
    /proc/stat. Busy: every state but idle and iowait; a VM's steal time counts, as the host's other guests."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        ticks = [int(value) for value in fields[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    if fields[0] != "cpu" or len(ticks) < 8:
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK"), time.process_time(), time.perf_counter()


def other_cores_meter() -> Callable[[], Optional[float]]:
    """Start watching the machine; the returned function gives the average number of cores other processes kept
    busy since (over at least WATCH_MIN_S), or None where that cannot be read."""
    start = cpu_counters()

    def stop() -> Optional[float]:
        if start is None:
            return None
        time.sleep(max(0.0, WATCH_MIN_S - (time.perf_counter() - start[2])))
        end = cpu_counters()
        if end is None:
            return None
        busy, own, wall = (after - before for before, after in zip(start, end))
        return max(0.0, (busy - own) / wall)

    return stop


def calibrate(shape: Shape, device: torch.device, call: Callable[..., torch.Tensor]) -> dict:
    """Measure `shape` now with `call` (`measure`), store the result in the cache file (unless other processes loaded
    the CPU meanwhile) and in this process; returns the cache entry."""
    meter = None
    if device.type == "cpu":
        from focus_hf.attention.cpu.native import native_kernels

        native_kernels()  # built first: a first build's compiler processes would read as other processes' load
        meter = other_cores_meter()
    crossover, rows = measure(shape, device, call)
    entry = {"dense_below": crossover, "timings": rows, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    other_cores = None if meter is None else meter()
    if other_cores is not None:
        entry["other_cores_busy"] = round(other_cores, 2)
        if other_cores > OTHER_CORES_MAX:
            if not _said_under_load:  # once per process: a model measures several shapes in a row
                _said_under_load.append(True)
                print(
                    f"focus_hf: other processes kept {other_cores:.1f} CPU cores busy while 'auto' measured where its "
                    "dense and sparse paths cross; such measurements are used in this process only and taken again "
                    f"in the next (set {CROSSOVER_ENV} to a number of tokens to skip them)",
                    file=sys.stderr,
                )
            return entry
    write_entry(shape, entry)
    _known.clear()  # later calls read the new value from the cache file
    return entry


def _signature(query: torch.Tensor, key: torch.Tensor, top_k: int, num_groups: int, window: int, kind: str) -> tuple:
    """The key of a call's entry in `_known`: its shape in this process (`_call_key`) and the settings in the
    environment, which a process may change between calls (tests do)."""
    return (
        os.environ.get(CROSSOVER_ENV),
        os.environ.get(NO_CALIBRATION_ENV),
        *_call_key(query, key, top_k, num_groups, window, kind),
    )


def crossover_entry(
    query: torch.Tensor,
    key: torch.Tensor,
    top_k: int,
    num_groups: int,
    window: int,
    kind: str,
    call: Callable[..., torch.Tensor],
) -> dict:
    """What "auto" knows of this call's shape: {"dense_below": keys, ...} with the measured "timings" where there are
    some; measured now on `call` (the function that dispatches the call, `hard.hard_attention`, which passes itself:
    so the measurement times what runs) where it is not known yet."""
    if torch.compiler.is_compiling():
        return {"dense_below": default_dense_below(query.device.type, top_k)}
    signature = _signature(query, key, top_k, num_groups, window, kind)
    known = _known.get(signature)
    if known is not None:
        return known
    forced = forced_crossover()
    if forced is not None:
        entry = _known[signature] = {"dense_below": forced}
        return entry
    if calibration_disabled() or query.device.type not in ("cpu", "cuda"):
        entry = _known[signature] = {"dense_below": default_dense_below(query.device.type, top_k)}
        return entry
    with _measuring:  # threads that call at once: one measures, the others then find its entry
        known = _known.get(signature)
        if known is not None:
            return known
        shape = make_shape(query, key, top_k, num_groups, window, kind)
        entry = read_cache().get(shape.key)
        if entry is None:
            try:
                entry = calibrate(shape, query.device, call)
            except Exception as error:  # a failed measurement (out of memory, ...) must not fail the model call
                print(f"focus_hf: crossover calibration failed ({error!r}); using the default", file=sys.stderr)
                entry = {"dense_below": default_dense_below(query.device.type, top_k)}
        entry = {**entry, _SPARSE_PATHS: _sparse_paths(entry)}  # a copy: the cache file keeps its own form
        _known[signature] = entry
    return entry


def dense_below(
    query: torch.Tensor,
    key: torch.Tensor,
    top_k: int,
    num_groups: int,
    window: int,
    kind: str,
    call: Callable[..., torch.Tensor],
) -> int:
    """Key count below which "auto" runs the pattern as one dense masked call rather than the sparse path `kind`;
    where it is not known yet, measured on `call` (`crossover_entry`)."""
    return crossover_entry(query, key, top_k, num_groups, window, kind, call)["dense_below"]


def auto_path(
    query: torch.Tensor,
    key: torch.Tensor,
    top_k: int,
    num_groups: int,
    window: int,
    kind: str,
    call: Callable[..., torch.Tensor],
) -> str:
    """The path "auto" runs a call of `key.shape[2]` keys on (`hard.hard_attention`'s `path`): "dense" below the
    crossover, else the faster measured sparse path at that length (`sparse_path_at`), or RACE: a prefill to run on
    both sparse paths, timed (`race_due`, `race_sparse_paths`; not where autograd records the call, whose graph would
    be built twice)."""
    entry = crossover_entry(query, key, top_k, num_groups, window, kind, call)
    length = key.shape[2]
    if length < entry["dense_below"]:
        return "dense"
    if kind != "decode" and race_due(entry, length):
        if not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)):
            return RACE
    return sparse_path_at(entry, length)


def race_pending(
    query: torch.Tensor,
    key: torch.Tensor,
    top_k: int,
    num_groups: int,
    window: int,
    kind: str,
    call: Callable[..., torch.Tensor],
) -> bool:
    """Whether "auto" would run a call of this shape and `key.shape[2]` keys on both sparse paths, timed (`auto_path`;
    `call` as there), e.g. so that a benchmark makes that call before it times any (measuring the crossover first,
    if not known yet)."""
    return auto_path(query, key, top_k, num_groups, window, kind, call) == RACE


def race_sparse_paths(
    query: torch.Tensor,
    key: torch.Tensor,
    top_k: int,
    num_groups: int,
    window: int,
    kind: str,
    run: Callable[[str], torch.Tensor],
) -> torch.Tensor:
    """Run a call on each sparse path (`run(path)`), timed, and return the last one's output (every path is exact;
    the others' are dropped before the next runs, so that no two outputs are held at once). The timings join the
    shape's entry as a row at the call's length: in this process, and in the cache file where the entry is stored
    there and other processes left the CPU alone meanwhile (as `calibrate`)."""
    meter = other_cores_meter() if query.device.type == "cpu" else None
    times: dict[str, float] = {}
    for path in SPARSE_PATHS[::-1]:  # the C kernels' last: theirs is the output returned
        output = None  # the previous path's, dropped before this one runs
        started = time.perf_counter()
        output = run(path)
        times[path] = time.perf_counter() - started
    fastest = min(times, key=times.__getitem__)
    row = {
        "length": key.shape[2],
        "dense_s": None,
        "sparse_s": times[fastest],
        "sparse_path": fastest,
        **{PATH_TIMES[path]: seconds for path, seconds in times.items()},
        "timed_on": "a call",
    }
    signature = _signature(query, key, top_k, num_groups, window, kind)
    known = _known.get(signature)
    if known is not None:
        timings = [*known.get("timings", []), row]
        _known[signature] = {**known, "timings": timings, _SPARSE_PATHS: _sparse_paths({"timings": timings})}
    other_cores = None if meter is None else meter()
    if other_cores is None or other_cores <= OTHER_CORES_MAX:
        shape = make_shape(query, key, top_k, num_groups, window, kind)
        stored = read_cache().get(shape.key)
        if stored is not None:
            write_entry(shape, {**stored, "timings": [*stored.get("timings", []), row]})
    return output
