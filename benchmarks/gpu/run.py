"""Every GPU check in one run: the driver behind benchmarks/gpu/run.sh (its header says how to call it).

Each stage is one process under its own time limit, writing its JSON into one folder as it measures, so that a stage
that hangs or fails costs its own figures only; after each stage `summary.json` is rewritten, and at the end a table
of every figure is printed, with its ratio to the dense baseline measured in the same run (and, on CUDA, the GPU
target it is held against: `TARGETS`).

| stage         | file               | what                                                                         |
|---------------|--------------------|------------------------------------------------------------------------------|
| tests         | tests.json         | pytest -m cuda on the test files that mention CUDA: the tests marked `cuda`  |
|               |                    | (they skip without CUDA; each fails if a call fell back to the reference),   |
|               |                    | tests/attention/gpu/test_cuda.py first, exactness and fallbacks first in it  |
| attention     | attention.json     | benchmarks/gpu/layer_prefill.py: one Llama-shaped layer, 32/8 heads, d 64,   |
|               |                    | K=8, w=128, top-1 and top-2, 64K-1M tokens, dense timed in the same run      |
| pieces        | pieces.json        | the same layer at 64K, top-1 and top-2, the GPU path in pieces (the default  |
|               |                    | past 32768 query rows) and in one piece (FOCUS_HF_GPU_ONE_PIECE_ROWS set     |
|               |                    | high), in one process against the same dense calls: time and peak memory     |
| decode        | decode.json        | focus-hf bench --decode: one step against a 256K and a 1M cache, vs dense    |
|               |                    | SDPA; eager in the quick set, eager and compiled in the full set             |
| model_prefill | model_prefill.json | benchmarks/gpu/model_prefill.py --weights random: SmolLM2-135M's             |
|               |                    | architecture, random weights, the committed adapter's settings, 128K         |
| auto          | auto.json          | focus-hf bench --backend auto, same shape, 1K-64K: auto against dense, and   |
|               |                    | what it chose (`focus_path`: the base attention, the GPU path, or both split |
|               |                    | by query at the crossover it measured, `dense_below`)                        |
| peak_memory   | peak_memory.json   | focus-hf bench --peak-memory at 64K and 1M: torch's peak allocated memory of |
|               |                    | one call, inputs included, dense SDPA against Focus                          |
| profile       | profile.json       | benchmarks/gpu/profile_layer.py: torch.profiler over the attention stage's   |
|               |                    | layer at 4K and 64K, top-1 and top-2: wall and device time, time by focus_hf |
|               |                    | function, syncs                                                              |
| train         | train.json         | benchmarks/gpu/train_check.py: focus-hf train --objective distill, bf16      |

Within 15 minutes of GPU time in all (start-up included), two runs measure every figure of the GPU targets:
`--quick` first (tests, attention, decode eager, model_prefill: within 420 s), then the full set (decode eager
and compiled, auto, peak_memory, profile, train, pieces: within 330 s); `--deadline` changes either, `--only` runs
any stages. Each set writes at most 7 files with summary.json.

The pieces stage answers what the pieces cost in time beside what they save in memory; it runs last in the full set,
with whatever time the stages of the targets left it, up to 50 s (`--only pieces` runs it alone). Its rows should take
about 45 s: the attention stage's run at 64K-1M took 127 s on an H200 (commit e9ee7e1), of which its calls at 256K
and 1M take about 80 s by their own times, leaving about 45 s for the process's start, `verify`, FlexAttention's
compilation and 64K; each timed call at 64K takes under 0.1 s (dense 0.068 s, Focus 0.044 s / 0.072 s). One-piece
calls that need FlexAttention compilations of their own (20-30 s cold) may not fit, and then its rows are lost (they
are written once every repeat has run). Its time comes from auto (now 1K-64K: 90 -> 80 s; it took 40-59 s at
1K-256K), profile (60 -> 50 s) and train (30 -> 20 s; it took 14-17 s), so that the full set's limits add up to its
deadline.

Every Focus row of the stage files records what ran it (`gpu_path`:
verify's verdicts, the calls that fell back to the reference path, FlexAttention's compilations); summary.json gathers
them under `gpu_path`, and a figure whose calls fell back meets no target: it is not a Focus figure. `--device cpu`
runs every stage at small sizes in float32 with a quarter of the heads (a check of the script, which
tests/benchmarking/test_gpu_script.py runs; its figures say nothing about GPUs).

    python benchmarks/gpu/run.py [--device cuda|cpu] [--quick] [--out DIR] [--only STAGE ...] [--skip STAGE ...]
                                 [--deadline SECONDS] [--timeout STAGE=SECONDS ...]

`FOCUS_HF_GPU_TESTS_K=EXPR` passes `-k EXPR` to the tests stage's pytest (a second run takes the tests the first did
not reach).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# The layer of layer_prefill.py: 32 query / 8 kv heads, head dim 64, K=8, window 128; a quarter of the heads
# for the CPU check.
HEADS = {"cuda": ["--heads", "32", "--kv-heads", "8"], "cpu": ["--heads", "8", "--kv-heads", "2"]}
LAYER = ["--head-dim", "64", "--groups", "8", "--window", "128"]
# Seconds kept back for each stage still to run when a stage's limit is cut to the overall deadline.
RESERVE_PER_STAGE = 20


@dataclasses.dataclass(frozen=True)
class Stage:
    """One check: its result file, its command for a device kind, and its time limits (seconds) per device kind."""

    name: str
    file: str
    command: Callable[[str, Path, bool], list[str]]  # (device, result file, quick) -> argv
    timeout: dict[str, int]
    quick: bool = False  # part of the --quick set: the first of the two runs on CUDA
    full: bool = False  # part of the full set: the second of them (on the CPU the default is every stage)


FIRST_TEST_FILE = "tests/attention/gpu/test_cuda.py"


def cuda_test_files() -> list[str]:
    """The test files that mention CUDA (every test marked `cuda` is in one of them): collecting only those keeps the
    stage short and clear of modules that need packages a GPU machine without internet access lacks."""
    # The GPU path's exactness first (FIRST_TEST_FILE), then the smallest: a stage cut by its limit has then run what
    # matters most, and the most files.
    files = sorted(
        ROOT.glob("tests/**/test_*.py"),
        key=lambda path: (path.relative_to(ROOT).as_posix() != FIRST_TEST_FILE, path.stat().st_size, path),
    )
    return [str(path.relative_to(ROOT)) for path in files if "cuda" in path.read_text(encoding="utf-8").lower()]


def tests_command(device: str, path: Path, quick: bool = False) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        *cuda_test_files(),
        "-q",
        "-m",
        "cuda",  # the tests marked `cuda` (pyproject's marker), not CPU tests that only mention CUDA in their names
        "-p",
        "pytest_report",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",  # a module that cannot be imported there must not stop the others
        *(["-k", os.environ["FOCUS_HF_GPU_TESTS_K"]] if os.environ.get("FOCUS_HF_GPU_TESTS_K") else []),
    ]


def attention_command(device: str, path: Path, quick: bool = False) -> list[str]:
    # One repeat: dense alone takes 16 s a call at 1M tokens on an H200.
    sizes = ["65536", "262144", "1048576"] if device == "cuda" else ["512", "1024"]
    extra = ["--repeats", "1"]
    command = [
        sys.executable,
        "benchmarks/gpu/layer_prefill.py",
        "--device",
        device,
        *HEADS[device],
        "--lengths",
        *sizes,
    ]
    return [*command, "--top-k", "1", "2", *extra, "--out", str(path)]


# FOCUS_HF_GPU_ONE_PIECE_ROWS for the pieces stage's one-piece calls: above any of its lengths.
ONE_PIECE = str(1 << 20)


def pieces_command(device: str, path: Path, quick: bool = False) -> list[str]:
    """64K tokens in pieces (the default) and in one piece on CUDA; on the CPU 1K tokens, whose default is one piece,
    in pieces with the setting 0, on the CPU stand-ins of the GPU path's kernels."""
    command = [sys.executable, "benchmarks/gpu/layer_prefill.py", "--device", device, *HEADS[device]]
    if device == "cuda":
        command += ["--lengths", "65536", "--repeats", "5", "--one-piece-rows", "default", ONE_PIECE]
    else:
        command += ["--lengths", "1024", "--repeats", "1", "--one-piece-rows", "default", "0", "--backend", "gpu-path"]
    return [*command, "--top-k", "1", "2", "--out", str(path)]


def bench(device: str, path: Path, *options: str) -> list[str]:
    dtype = "bfloat16" if device == "cuda" else "float32"
    command = [sys.executable, "-m", "focus_hf.cli", "bench", "--device", device, "--dtype", dtype]
    command += [*HEADS[device], *LAYER]
    return [*command, *options, "--json", str(path)]


def auto_command(device: str, path: Path, quick: bool = False) -> list[str]:
    lengths = [str(1024 << i) for i in range(7)] if device == "cuda" else ["1024", "2048"]  # 1K-64K
    extra = [] if device == "cuda" else ["--repeats", "2"]
    return bench(device, path, "--backend", "auto", "--top-k", "1", "2", "--seq-lens", *lengths, *extra)


def decode_command(device: str, path: Path, quick: bool = False) -> list[str]:
    caches = ["262144", "1048576"] if device == "cuda" else ["1024", "2048"]
    # On CUDA a timing is 128 consecutive steps (one filing of the paged copy among them); eager in the quick set,
    # eager and compiled in the full set.
    extra = ["--decode-repeats", "5"] if device == "cuda" else ["--decode-repeats", "2"]
    if quick:
        caches = caches[-1:] if device == "cpu" else caches
    elif device == "cuda":
        extra += ["--compile"]
    return bench(device, path, "--decode", "--backend", "auto", "--top-k", "1", "2", "--seq-lens", *caches, *extra)


def peak_memory_command(device: str, path: Path, quick: bool = False) -> list[str]:
    if device == "cuda":
        lengths = ["65536", "1048576"]
        return bench(device, path, "--peak-memory", "--backend", "sdpa", "--top-k", "1", "2", "--seq-lens", *lengths)
    return bench(device, path, "--peak-memory", "--backend", "sdpa", "--top-k", "1", "--seq-lens", "2048")


def model_prefill_command(device: str, path: Path, quick: bool = False) -> list[str]:
    command = [sys.executable, "benchmarks/gpu/model_prefill.py", "--device", device, "--weights", "random"]
    if device == "cuda":
        return [*command, "--lengths", "131072", "--out", str(path)]
    small = ["--layers", "2", "--dense-below", "0", "--lengths", "1024", "--repeats", "1"]
    return [*command, *small, "--out", str(path)]


def profile_command(device: str, path: Path, quick: bool = False) -> list[str]:
    command = [sys.executable, "benchmarks/gpu/profile_layer.py", "--device", device, "--out", str(path)]
    if device == "cuda":
        return [*command, "--lengths", "4096", "65536", "--top-k", "1", "2"]
    return [*command, "--heads", "8", "--kv-heads", "2", "--lengths", "1024", "--top-k", "1", "--backend", "gpu-path"]


def train_command(device: str, path: Path, quick: bool = False) -> list[str]:
    steps = ["--steps", "5" if device == "cuda" else "2"]
    return [sys.executable, "benchmarks/gpu/train_check.py", "--device", device, *steps, "--out", str(path)]


# In the order they run. Limits are the full set's (CUDA) and the CPU check's; the quick set's are QUICK_LIMITS.
STAGES = [
    Stage("tests", "tests.json", tests_command, {"cuda": 180, "cpu": 180}, quick=True),
    Stage("attention", "attention.json", attention_command, {"cuda": 130, "cpu": 150}, quick=True),
    Stage("decode", "decode.json", decode_command, {"cuda": 80, "cpu": 90}, quick=True, full=True),
    Stage("model_prefill", "model_prefill.json", model_prefill_command, {"cuda": 60, "cpu": 150}, quick=True),
    # "auto" measures its crossover against flash SDPA first (1K-64K, top-1 and top-2: FlexAttention's compilation and
    # up to GPU_BUDGET_S of timed calls each), then runs the lengths.
    Stage("auto", "auto.json", auto_command, {"cuda": 80, "cpu": 150}, full=True),
    Stage("peak_memory", "peak_memory.json", peak_memory_command, {"cuda": 50, "cpu": 90}, full=True),
    Stage("profile", "profile.json", profile_command, {"cuda": 50, "cpu": 120}, full=True),
    Stage("train", "train.json", train_command, {"cuda": 20, "cpu": 120}, full=True),
    # Last in the full set, with the time the target stages left: the GPU path at 64K in pieces and in one piece, a
    # diagnosis of the 64K figures rather than a target (the module docstring).
    Stage("pieces", "pieces.json", pieces_command, {"cuda": 50, "cpu": 150}, full=True),
]
# Measured on an H200 (benchmarks/results/gpu/): every stage process first compiles FlexAttention for its calls
# (about 20-30 s cold); the CUDA tests took 5-28 s each, 32 of them (a verdict per configuration is now shared by
# the tests of a module); attention at 64K-1M 127 s (commit e9ee7e1); train 14 s, auto at 1K-256K 40 s, peak memory
# at 1M 41 s (commit fa950a2); the profile with mask costs at 64K-256K 109 s (commit 432b95d).
QUICK_LIMITS = {"tests": 180, "attention": 130, "decode": 50, "model_prefill": 60}
DEADLINES = {"quick": 420, "full": 330, "cpu": 1200}
STAGE_NAMES = [stage.name for stage in STAGES]
SUMMARY = "summary.json"


def selected_stages(only: Optional[list[str]], skip: list[str], quick: bool, device: str = "cuda") -> list[Stage]:
    """The stages a run takes, in order: those named by `only`, else the --quick set or the full one (on the CPU:
    every stage); less `skip`."""
    if only:
        chosen = [stage for stage in STAGES if stage.name in only]
    elif quick:
        chosen = [stage for stage in STAGES if stage.quick]
    else:
        chosen = [stage for stage in STAGES if stage.full or device == "cpu"]
    return [stage for stage in chosen if stage.name not in skip]


def default_out() -> Path:
    """$OUT/gpu where $OUT is set (a runner's folder of results to bring back), else benchmarks/results/gpu."""
    return Path(os.environ["OUT"]) / "gpu" if os.environ.get("OUT") else ROOT / "benchmarks" / "results" / "gpu"


def run_stage(argv: list[str], timeout: float, env: dict[str, str], name: str) -> dict[str, Any]:
    """Run one stage's command in its own process group, its output streamed with a prefix; stop the whole group
    at `timeout`. Returns its exit code, wall time, whether it timed out, and the tail of its output."""
    tail: collections.deque[str] = collections.deque(maxlen=60)
    start = time.perf_counter()
    process = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )

    def pump() -> None:
        for line in process.stdout:
            tail.append(line.rstrip("\n"))
            print(f"[{name}] {line}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(process.pid, signal.SIGTERM)  # the stage and the processes it started (its group)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    reader.join(timeout=5)
    return {
        "returncode": process.returncode,
        "wall_s": round(time.perf_counter() - start, 1),
        "timed_out": timed_out,
        "output_tail": "\n".join(tail)[-4000:],
    }


# --- the summary -------------------------------------------------------------------------------------------------


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tokens_label(n: int) -> str:
    return f"{n // 1048576}M" if n % 1048576 == 0 else f"{n // 1024}K" if n % 1024 == 0 else str(n)


def fallbacks(row: dict) -> int:
    """Focus calls of a stage's row that ran the reference path instead of the GPU path (`hard.path_record`)."""
    return sum((row.get("gpu_path") or {}).get("fallback_calls", {}).values())


def figure(
    stage: str, name: str, dense: Any, focus: Any, ratio: Optional[float], unit: str, target=None, source=None
) -> dict:
    """One summary row; `target` is (comparison, value), a GPU target, e.g. (">=", 2.5); `source`: the stage's row
    it comes from, whose fallback calls it records (a figure measured on a fallback is not a Focus figure)."""
    return {
        "stage": stage,
        "figure": name,
        "dense": dense,
        "focus": focus,
        "ratio": ratio,
        "unit": unit,
        "target": target,
        "fallback_calls": None if source is None else fallbacks(source),
    }


def gpu_path_summary(out: Path) -> dict:
    """Across the stage files: verify's verdicts, the Focus calls that fell back to the reference path by stage, and
    FlexAttention's compilations by stage (the most any row saw), with what they mean for the figures."""
    verdicts: dict[str, str] = {}
    calls: dict[str, int] = {}
    compilations: dict[str, dict] = {}
    for stage in ("attention", "pieces", "auto", "decode", "peak_memory", "model_prefill"):
        data = load(out / f"{stage}.json")
        rows = data.get("rows", []) if isinstance(data, dict) else data if isinstance(data, list) else []
        for row in rows:
            record = row.get("gpu_path") if isinstance(row, dict) else None
            if not record:
                continue
            verdicts.update(record.get("verdicts", {}))
            calls[stage] = calls.get(stage, 0) + fallbacks(row)
            for kind, count in record.get("flex_compilations", {}).items():
                compilations.setdefault(stage, {})[kind] = max(count, compilations.get(stage, {}).get(kind, 0))
    total = sum(calls.values())
    return {
        "verdicts": verdicts,
        "fallback_calls": calls,
        "flex_compilations": compilations,
        "focus_figures": (
            "every Focus figure ran the GPU path (no call fell back)"
            if total == 0
            else f"{total} Focus calls fell back to the reference path: the figures of their rows are not Focus "
            "figures and meet no target"
        ),
    }


# The GPU targets, on CUDA: (stage, top_k, tokens) -> (comparison, value).
TARGETS = {
    ("attention", 1, 65536): (">=", 2.5),
    ("attention", 1, 262144): (">=", 5.0),
    ("attention", 1, 1048576): (">=", 6.5),
    ("attention", 2, 1048576): (">=", 3.0),
    ("decode", 1, 262144): (">=", 2.0),
    ("decode", 1, 1048576): (">=", 4.0),
    ("model_prefill", None, 131072): (">=", 2.0),
}


def peak_target(top_k: int, tokens: int) -> Optional[tuple[str, float]]:
    """The peak-memory target of a Focus row: at most 1.1x dense for top-1 at 64K tokens and for every top-k at 1M."""
    return ("<=", 1.10) if tokens == 1048576 or (tokens == 65536 and top_k == 1) else None


def prefill_figures(out: Path, stage: str) -> list[dict]:
    """The figures of a stage run by layer_prefill.py (attention, pieces): time and peak memory per row, against the
    dense calls of the same run. The pieces stage's say whether the call ran in pieces, and its setting of
    FOCUS_HF_GPU_ONE_PIECE_ROWS (`one_piece_rows`); both settings are held to the attention stage's targets."""
    data = load(out / f"{stage}.json")
    rows = []
    for row in data.get("rows", []) if isinstance(data, dict) else []:
        label = f"top-{row['top_k']} prefill {tokens_label(row['tokens'])}"
        if stage == "pieces":
            label += " in pieces" if row.get("in_pieces") else " one piece"
        setting = {"one_piece_rows": row["one_piece_rows"]} if stage == "pieces" else {}
        if "error" in row:
            rows.append({**figure(stage, label, None, row["error"], None, ""), **setting})
            continue
        target = TARGETS.get(("attention", row["top_k"], row["tokens"]))
        rows.append(figure(stage, label, row["dense_s"], row["focus_s"], row["speedup"], "s", target, row))
        rows[-1].update(setting)
        if row.get("peak_ratio") is not None:
            dense, focus = row["dense_peak_bytes"] / 2**20, row["focus_peak_bytes"] / 2**20
            target = peak_target(row["top_k"], row["tokens"])
            rows.append(figure(stage, label + " peak", dense, focus, row["peak_ratio"], "MiB", target, row))
            rows[-1].update(setting)
    return rows


def figures(out: Path, cuda: bool) -> list[dict]:
    """Every figure of the stage files in `out`, each with its ratio against the dense baseline of the same run."""
    rows: list[dict] = []
    tests = load(out / "tests.json")
    if isinstance(tests, dict):
        counts = tests.get("counts", {})
        summary = ", ".join(f"{count} {outcome}" for outcome, count in sorted(counts.items())) or "none ran"
        bad = sum(counts.get(key, 0) for key in ("failed", "error", "collection error"))
        ok = counts.get("passed", 0) > 0 and bad == 0 and tests.get("finished", False)
        rows.append(figure("tests", "pytest -m cuda", None, summary, None, "", ("all pass", ok)))
    rows += prefill_figures(out, "attention") + prefill_figures(out, "pieces")
    for stage in ("auto", "decode"):
        data = load(out / f"{stage}.json")
        for row in data if isinstance(data, list) else []:
            tokens = row.get("seq_len") or row.get("cache_len")
            label = f"{'cache ' if stage == 'decode' else ''}{tokens_label(tokens)}"
            if "error" in row:  # the whole length failed
                rows.append(figure(stage, f"every top-k {label}", None, row["error"], None, ""))
                continue
            label = f"top-{row['top_k']} {label}" + (" compiled" if row.get("compiled") else "")
            if row.get("dense_s") is None:
                rows.append(figure(stage, label, None, row.get("focus_s"), None, "s"))
                continue
            # Decoding steps are held to their targets eager and compiled alike.
            target = (">=", 0.95) if stage == "auto" and tokens >= 1024 else TARGETS.get((stage, row["top_k"], tokens))
            scale, unit = (1e3, "ms") if stage == "decode" else (1, "s")
            dense, focus = row["dense_s"] * scale, row["focus_s"] * scale
            rows.append(figure(stage, label, dense, focus, dense / focus, unit, target, row))
            # What "auto" chose (the entries of the table of paths that ran, the crossover it measured).
            rows[-1].update(chose=row.get("focus_path"), dense_below=row.get("dense_below"))
    memory = load(out / "peak_memory.json")
    memory = memory if isinstance(memory, list) else []
    for row in memory:
        if row.get("top_k") is None:
            continue
        dense = next((r for r in memory if r.get("top_k") is None and r["seq_len"] == row["seq_len"]), None)
        key = "peak_allocated_mib" if "peak_allocated_mib" in row else "peak_rss_mib"
        label = f"top-{row['top_k']} peak {tokens_label(row['seq_len'])}" + ("" if cuda else " (RSS)")
        if dense is None or key not in row or key not in dense:
            rows.append(figure("peak_memory", label, None, row.get("error"), None, ""))
            continue
        target = peak_target(row["top_k"], row["seq_len"])
        rows.append(figure("peak_memory", label, dense[key], row[key], row[key] / dense[key], "MiB", target, row))
    model = load(out / "model_prefill.json")
    for row in model.get("rows", []) if isinstance(model, dict) else []:
        label = f"prefill {tokens_label(row['tokens'])}"
        if "error" in row:
            rows.append(figure("model_prefill", label, None, row["error"], None, ""))
            continue
        target = TARGETS.get(("model_prefill", None, row["tokens"]))
        rows.append(figure("model_prefill", label, row["dense_s"], row["focus_s"], row["speedup"], "s", target, row))
        if row.get("peak_ratio") is not None:
            dense, focus = row["dense_peak_bytes"] / 2**20, row["focus_peak_bytes"] / 2**20
            rows.append(figure("model_prefill", label + " peak", dense, focus, row["peak_ratio"], "MiB", None, row))
    profile = load(out / "profile.json")
    for row in profile.get("rows", []) if isinstance(profile, dict) else []:
        label = f"top-{row['top_k']} {tokens_label(row['tokens'])} where the time goes"
        lines = row.get("by_focus_line") or [{}]
        text = row.get("error") or (
            f"{row['wall_s']:.3g} s; device {row['device_ms_total']:.4g} ms, most in {lines[0].get('where')} "
            f"({lines[0].get('device_ms', 0):.4g} ms); syncs {sum(row.get('syncs', {}).values())}"
        )
        # Host time against device time (the call's wall time over the time its kernels ran): 1x where the host keeps
        # the device busy.
        device_s = (row.get("device_ms_total") or 0) / 1e3
        wall_over_device = row["wall_s"] / device_s if device_s and "error" not in row else None
        rows.append(figure("profile", label, None, text, wall_over_device, "wall / device"))
    train = load(out / "train.json")
    if isinstance(train, dict):
        ran = train.get("returncode") == 0 and train.get("router_dtypes") == ["F32"]
        result = (
            f"ran on {train.get('trained_on')}, {train.get('base_dtype')} base, F32 routers, "
            f"{train.get('wall_s', 0):.0f} s, kept {train.get('kept_before', 0):.3f}->{train.get('kept_after', 0):.3f}"
            if ran
            else f"exit code {train.get('returncode')}: {train.get('error')}"
        )
        rows.append(figure("train", "focus-hf train --objective distill", None, result, None, "", ("runs", ran)))
    for row in rows:
        row["meets_target"] = meets(row, cuda)
    return rows


def meets(row: dict, cuda: bool) -> Optional[bool]:
    """Whether a figure meets its GPU target; None where it has none, or off CUDA (the targets are GPU ones).
    A figure whose Focus calls fell back to the reference path meets none: it is not a Focus figure."""
    target = row["target"]
    if target is None or not cuda:
        return None
    if row.get("fallback_calls"):
        return False
    comparison, value = target
    if isinstance(value, bool):
        return value
    if row["ratio"] is None:
        return False
    return row["ratio"] >= value if comparison == ">=" else row["ratio"] <= value


def number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(rows: list[dict], stages: dict[str, dict]) -> None:
    print("\nstage status")
    for name, status in stages.items():
        state = status.get("status")
        print(f"  {name:<14} {state:<10} {status.get('wall_s', '-'):>6} s  {status.get('file', '')}")
    header = ("stage", "figure", "dense", "focus", "ratio", "unit", "target", "meets")
    lines = []
    for row in rows:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        target = row["target"]
        target_text = (
            "-" if target is None else target[0] if isinstance(target[1], bool) else f"{target[0]} {target[1]}x"
        )
        met = {None: "-", True: "yes", False: "NO"}[row["meets_target"]]
        name = row["figure"] + (f" [{row['chose']}]" if row.get("chose") else "")
        if "one_piece_rows" in row:
            name += f" [FOCUS_HF_GPU_ONE_PIECE_ROWS {row['one_piece_rows']}]"
        lines.append((row["stage"], name, number(row["dense"]), number(row["focus"]), ratio, row["unit"]))
        lines[-1] += (target_text, met)
    widths = [max(len(str(line[i])) for line in [header, *lines]) for i in range(len(header))]
    widths[3] = min(widths[3], 70)
    print("\nfigures (ratio: dense time / Focus time; for memory, Focus / dense; dense measured in this run)")
    for line in [header, *lines]:
        print("  " + "  ".join(str(cell)[:70].ljust(width) for cell, width in zip(line, widths)))


def write_summary(out: Path, base: dict, stages: dict, cuda: bool) -> list[dict]:
    rows = figures(out, cuda)
    summary = {**base, "stages": stages, "gpu_path": gpu_path_summary(out), "figures": rows}
    summary["targets"] = (
        "the GPU targets, checked on this run's figures" if cuda else "not checked: the targets are for CUDA"
    )
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, help="result folder (default: $OUT/gpu, else benchmarks/results/gpu)")
    parser.add_argument("--only", nargs="+", choices=STAGE_NAMES, help="run these stages only")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the quick set (the CUDA tests, prefill at 64K-1M, eager decoding at 256K / 1M, model prefill at 128K) "
        "under its own stage limits and a 420 s deadline: the first of two runs within 15 minutes of GPU time; "
        "the full set (the default) is the second",
    )
    parser.add_argument("--skip", nargs="+", choices=STAGE_NAMES, default=[], help="leave these stages out")
    parser.add_argument(
        "--deadline",
        type=float,
        help="seconds for all stages together (default: 420 for --quick and 330 for the full set on CUDA, 1200 on the "
        "CPU)",
    )
    parser.add_argument(
        "--timeout", action="append", default=[], metavar="STAGE=SECONDS", help="change one stage's time limit"
    )
    args = parser.parse_args()

    import torch

    from focus_hf.benchmarking.records import provenance

    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu/run.py: no CUDA GPU here; run it on a CUDA machine, or with --device cpu to check it.")
        return 2
    limits = {stage.name: stage.timeout[args.device] for stage in STAGES}
    if args.quick and args.device == "cuda":
        limits.update({name: min(limits[name], seconds) for name, seconds in QUICK_LIMITS.items()})
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        if name not in limits or not seconds.replace(".", "", 1).isdigit():
            parser.error(f"--timeout takes STAGE=SECONDS with STAGE one of {STAGE_NAMES}, got {item!r}")
        limits[name] = float(seconds)
    selected = selected_stages(args.only, args.skip, args.quick, args.device)
    default = DEADLINES["cpu" if args.device == "cpu" else "quick" if args.quick else "full"]
    deadline = time.perf_counter() + (args.deadline or default)
    out = (args.out or default_out()).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stage in STAGES:  # results of an earlier run must not pass for this one's
        (out / stage.file).unlink(missing_ok=True)
    (out / SUMMARY).unlink(missing_ok=True)

    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(ROOT), env.get("PYTHONPATH")) if p)
    device = torch.device(args.device)
    base = {
        **provenance(device, shlex.join(sys.orig_argv)),
        "mode": args.device,
        "out": str(out),
        "note": "random-weight models and random routers (balanced by causal Sinkhorn): speed, memory and "
        "correctness only; quality is measured on the CPU with the real SmolLM2"
        + ("" if args.device == "cuda" else "; --device cpu: small sizes in float32, a check of the script only"),
    }
    cuda = args.device == "cuda"
    print(f"{base['device']}: stages {[s.name for s in selected]} -> {out}", flush=True)
    stages: dict[str, dict] = {}
    for index, stage in enumerate(selected):
        path = out / stage.file
        argv = stage.command(args.device, path, args.quick)
        left = deadline - time.perf_counter() - RESERVE_PER_STAGE * (len(selected) - index - 1)
        timeout = min(limits[stage.name], left)
        status: dict[str, Any] = {"file": stage.file, "command": shlex.join(argv), "timeout_s": round(timeout)}
        if timeout < 10:
            status.update(status="skipped", reason="out of time: the overall deadline was reached")
        else:
            print(f"\n=== {stage.name} (limit {timeout:.0f} s): {status['command']}", flush=True)
            stage_env = dict(env, FOCUS_HF_TEST_REPORT=str(path)) if stage.name == "tests" else env
            status.update(run_stage(argv, timeout, stage_env, stage.name))
            state = "timed out" if status["timed_out"] else "ok" if status["returncode"] == 0 else "failed"
            status["status"] = state
            status["has_results"] = path.is_file()
        stages[stage.name] = status
        write_summary(out, base, stages, cuda)
    rows = write_summary(out, base, stages, cuda)
    print_table(rows, stages)
    path = gpu_path_summary(out)
    print(f"\nGPU path: {path['focus_figures']}; fallback calls by stage {path['fallback_calls']}")
    print(f"verdicts: {path['verdicts']}\nFlexAttention compilations by stage: {path['flex_compilations']}")
    print(f"\nwrote {out}/ ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return 0 if all(status.get("status") == "ok" for status in stages.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
