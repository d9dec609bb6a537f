"""Where "auto" switches from the short-call side to the sparse path: measured once per machine and shape.

The two sides are entries of the table of paths (`paths.measured_paths`). On the CPU the short-call side ("dense") is
the pattern as one dense masked call, the long-call side the CPU path ("sparse"; "sparse-torch" in torch operations).
On CUDA the short-call side is the base model's own attention (torch's flash SDPA, `paths.run_base`) - the GPU's one
dense masked call, FlexAttention over every causal block, ran far slower than flash SDPA - and the long-call side the
GPU path: there the crossover is a `dense_below` measured for the device, below which a query attends as the base
model (`hard`). The GPU's measurement runs 1K to 256K keys (GPU_LENGTHS) within GPU_BUDGET_S of timed calls (the first
call of each length, which compiles FlexAttention, is not counted); where the GPU path never wins twice in a row there,
or the measurement cannot run, "auto" keeps the base attention at every length (NEVER): never a slower path.

The crossover (key count below which the dense masked call is faster) depends on the processor, the build of the C
kernels and the level of torch's own (`Shape`), the thread count, the dtype, the head shape, top_k, K, the window and
which sparse path runs (`kind`): "shared" (queries probe their own key group first), "probe" (a separate query router
with top_k = 1), "separate" (a separate query router with top_k > 1) - all three run the own-group pass through
`partials.probe_part`, but their group balance differs - or "decode" (a few queries against a longer cache,
`cpu_path.decode_attention`). On first use of a shape, `dense_below` times both sides at lengths 256, 512, ...
(`crossover_measurement`) through the very function that dispatches the call (`hard.hard_attention`, told which entry of
the table of paths to run), on random inputs laid out as a model hands them over and with the per-step work of a
decoding step (the update of the layer's copy of the distant keys) - so that what is measured is what then runs - until
the sparse path wins twice in a row by at least WIN_MARGIN (a few seconds at most; never beyond MAX_LENGTH) and stores
the first of those two lengths in `<cache>/crossover.json` (`aliases.default_cache_dir`: `$FOCUS_HF_CACHE`, else
`~/.cache/focus_hf`), where every later process finds it. On the CPU the sparse path is timed both in the C kernels and
in torch operations, and the faster runs at each length; a prefill far longer than any length timed so (a calibration
call there would take seconds) runs once on both, timed as it runs (`race_sparse_paths`), and its row joins the entry. A
CPU measurement taken while other processes kept more than OTHER_CORES_MAX cores busy (from /proc/stat) is used by this
process only and not stored: under load the many small calls of the sparse path slow down more than the one dense call
(a decode crossover measured so came out at 16K keys instead of 2K), and a stored value would stay wrong.

Environment:
  FOCUS_HF_CROSSOVER=<tokens>   use this crossover for every shape (no measurement);
  FOCUS_HF_CROSSOVER=measure    (or unset) measure on first use, then read the cache;
  FOCUS_HF_NO_CALIBRATION=1     never measure and ignore the cache: the conservative DEFAULT_DENSE_BELOW table
                                (the test suite sets this, so that no result depends on timings); on CUDA, the
                                base attention at every length.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import platform
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
from focus_hf.attention.crossover_measurement import (
    NEVER,
    SIDE_TIMES,
    SPARSE_SIDES,
    measure,
)
from focus_hf.attention.gpu.kernels import gpu_kernels
from focus_hf.attention.paths import path_platform
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
# 18: the own-group pass runs in one call of the C kernel, blocks of 128 keys; 19: its group sort is a counting sort in
# C, the sink pairs run in the kernel; 20: on CUDA both sides run the stock-kernel path, FlexAttention and varlen; 21:
# both sides are timed through `hard.hard_attention`, the function that dispatches them, CUDA decoding steps in runs of
# FILE_EVERY); 22: on CPU the sparse path is also timed on torch operations (`native.torch_path`), and the faster of
# the two runs at each length; 24: rows keep each sparse path's time apart from the faster one's, "sparse_s"; 25: the
# shape names the level of torch's own CPU kernels, which run the dense side).
CACHE_VERSION = 25
# Cores that other processes may keep busy, on average, while a CPU crossover is measured for it to be stored; the
# load is averaged over at least WATCH_MIN_S (a short measurement waits out the rest, so that the reading is not
# just the kernel's 10 ms accounting ticks).
OTHER_CORES_MAX = 0.3
WATCH_MIN_S = 0.5

# Without a measurement: key counts below which "auto" runs the dense masked call on the CPU, per top_k (other top_k:
# PER_PROBE * top_k). Conservative: on the 2-core CPUs measured so far the sparse path won at top_k = 1 somewhere
# between 512 and 1,024 keys, at top_k = 2 near 2,048, at 3 near 3,000, at 4 near 4,000. On the GPU path: NEVER.
DEFAULT_DENSE_BELOW = {1: 1024, 2: 2048}
PER_PROBE = 1024
KINDS = ("shared", "probe", "separate", "decode")
# What `auto_path` answers for a call to run on every sparse side, timed (`race_sparse_paths`).
RACE = "race"


@dataclass(frozen=True)
class Shape:
    """What a crossover is measured for."""

    device: str  # device type: "cpu", "cuda"
    processor: str  # the CPU's model name, or the GPU's name on the GPU path
    kernels: str  # the C kernels' build (`native.kernels_identity`), or the GPU path's kernels (`kernels.GpuKernels`)
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


def on_gpu_path(device: torch.device) -> bool:
    """Whether "auto" runs calls on `device` on the GPU path (`paths.path_platform`)."""
    return path_platform(device, "auto") == "gpu"


def make_shape(query: torch.Tensor, key: torch.Tensor, top_k: int, num_groups: int, window: int, kind: str) -> Shape:
    """The shape of a call with query [batch, heads, q, dim] and key [batch, kv_heads, kv, dim]."""
    cpu = not on_gpu_path(query.device)
    return Shape(
        device=query.device.type,
        processor=processor_name(query.device),
        kernels=kernels_identity() if cpu else gpu_kernels(query.device).name,
        threads=torch.get_num_threads() if cpu else 0,
        torch=torch.__version__,
        torch_kernels=torch_kernels_level() if cpu else "",
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


def default_dense_below(device: torch.device, top_k: int) -> int:
    """The crossover "auto" uses without a measurement: a conservative table on the CPU, NEVER on the GPU path."""
    return NEVER if on_gpu_path(device) else DEFAULT_DENSE_BELOW.get(top_k, PER_PROBE * top_k)


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
        and row.get("sparse_path", "sparse") in SPARSE_SIDES
        and all(isinstance(row.get(name, 0.0), (int, float)) for name in SIDE_TIMES.values())
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
    raced = [row for row in entry.get("timings", []) if all(name in row for name in SIDE_TIMES.values())]
    if not raced:
        return False
    nearest = min(raced, key=lambda row: abs(math.log(row["length"] / length)))
    if nearest["length"] * RACE_FACTOR >= length and length * RACE_FACTOR >= nearest["length"]:
        return False
    times = [nearest[name] for name in SIDE_TIMES.values()]
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
    cpu = not on_gpu_path(query.device)
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
    if not on_gpu_path(device):
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
    return (*_environment(), *_call_key(query, key, top_k, num_groups, window, kind))


def _environment() -> tuple[Optional[str], Optional[str]]:
    return os.environ.get(CROSSOVER_ENV), os.environ.get(NO_CALIBRATION_ENV)


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
        if on_gpu_path(query.device):  # the base attention or the GPU path: as the eager calls before decided
            heads = (query.shape[1], key.shape[1], query.shape[3])
            known = _gpu_dense_below_known(str(query.device), str(query.dtype), heads, top_k, num_groups, window, kind)
            return {"dense_below": known}
        return {"dense_below": default_dense_below(query.device, top_k)}
    signature = _signature(query, key, top_k, num_groups, window, kind)
    known = _known.get(signature)
    if known is not None:
        return known
    forced = forced_crossover()
    if forced is not None:
        entry = _known[signature] = {"dense_below": forced}
        return entry
    if calibration_disabled() or query.device.type not in ("cpu", "cuda"):
        entry = _known[signature] = {"dense_below": default_dense_below(query.device, top_k)}
        return entry
    with _measuring:  # threads that call at once: one measures, the others then find its entry
        known = _known.get(signature)
        if known is not None:
            return known
        shape = make_shape(query, key, top_k, num_groups, window, kind)
        entry = read_cache().get(shape.key)
        if entry is None or not isinstance(entry.get("dense_below"), int):
            try:
                entry = calibrate(shape, query.device, call)
            except Exception as error:  # a failed measurement (out of memory, ...) must not fail the model call
                print(f"focus_hf: crossover calibration failed ({error!r}); using the default", file=sys.stderr)
                entry = {"dense_below": default_dense_below(query.device, top_k)}
        entry = {**entry, _SPARSE_PATHS: _sparse_paths(entry)}  # a copy: the cache file keeps its own form
        _known[signature] = entry
    return entry


@torch.compiler.assume_constant_result
def _gpu_dense_below_known(
    device: str, dtype: str, heads: tuple[int, int, int], top_k: int, num_groups: int, window: int, kind: str
) -> int:
    """The crossover this process holds for a GPU-path call of this shape, read as a constant while torch.compile
    traces a graph (`crossover_entry`): the forced one, else the one the eager calls measured or read, else NEVER (the
    base attention; a compiled model whose first call was compiled stays there). Every argument a plain value."""
    forced = forced_crossover()
    if forced is not None:
        return forced
    for signature, entry in list(_known.items()):
        found = (str(signature[2]), str(signature[3]), signature[6:9], *signature[9:])
        if found == (device, dtype, heads, top_k, num_groups, window, kind) and signature[:2] == _environment():
            return entry["dense_below"]
    return NEVER


def dense_below(
    query: torch.Tensor,
    key: torch.Tensor,
    top_k: int,
    num_groups: int,
    window: int,
    kind: str,
    call: Callable[..., torch.Tensor],
) -> int:
    """Key count below which "auto" runs the short-call side rather than the sparse path `kind` - on the CPU the
    pattern as one dense masked call, on the GPU path the base model's attention (per query: `hard`); where it is not
    known yet, measured on `call` (`crossover_entry`)."""
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
    for path in SPARSE_SIDES[::-1]:  # the C kernels' last: theirs is the output returned
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
        **{SIDE_TIMES[path]: seconds for path, seconds in times.items()},
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
