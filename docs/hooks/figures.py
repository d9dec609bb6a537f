"""Every measured figure the docs show, read from the committed JSON.

A page holds `<!--fig:NAME-->TEXT<!--/fig-->` where a figure goes, and `generated.py` writes `value(NAME)` in as
TEXT. A figure is a small function over the JSON rows, so the page can only show what a committed file holds, and a
re-run benchmark updates the docs with it (`python docs/hooks/generated.py`). Tables work the same way
(`table.NAME`). The tests (`tests/test_docs.py`) check that the docs' Markdown holds no figure outside these
generated parts, that every one is as the JSON says now, and that every other figure the README quotes is one of
these values. `recording()` tells which files a computation read (the plots record a digest of them).

Pure Python (json only): no mkdocs, no torch.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

ROOT = Path(__file__).resolve().parents[2]

# The committed measurements the docs read (paths relative to the repository root).
ATTENTION = "benchmarks/results/attention_cpu.json"
ATTENTION_QUERY_ROUTER = "benchmarks/results/attention_cpu_query_router.json"
ATTENTION_DECODE = "benchmarks/results/attention_cpu_decode.json"
ATTENTION_MEMORY = "benchmarks/results/attention_cpu_peak_memory.json"
ATTENTION_AUTO = {k: f"benchmarks/results/attention_cpu_auto_K{k}.json" for k in (4, 8, 16)}
ATTENTION_BF16 = "benchmarks/results/attention_cpu_bf16.json"
# Each machine's runs, in one file per machine (benchmarks/machine_results.py adds them): a run is read as
# "<machine file>#<run>", the runs of a build named <stem>_<build>.
MACHINES = "benchmarks/results/machines"
AVX2_MACHINE = f"{MACHINES}/avx2-epyc.json"  # AMD EPYC Zen 3: AVX2 + FMA, no AVX-512
CPU_TARGETS = ("native", "x86-64-v3", "x86-64-v2")
AVX512_MACHINE = f"{MACHINES}/avx512-epyc.json"  # AMD EPYC with AVX-512 and avx512_bf16
AVX512_TARGETS = ("native", "x86-64-v4", "x86-64-v3", "x86-64-v2")
# Builds run there with torch's own kernels capped to the build's instruction sets (a processor of that level).
AVX512_EMULATED = ("x86-64-v3_torch-avx2", "x86-64-v2_torch-default")
XEON_MACHINE = f"{MACHINES}/xeon-amx.json"  # Intel Xeon (Emerald Rapids): AVX-512, avx512_bf16, AMX
XEON_TARGETS = ("native", "x86-64-v4", *AVX512_EMULATED)
XEON_BF16_RUNS = ("native", "native_before-amx-tiles")  # the bfloat16 products in tiles, and in vectors before
XEON_MODEL_RUNS = ("native", "native_one-thread", *AVX512_EMULATED)  # two threads; generate() after 1K, 2K on one
ZEN5_MACHINE = f"{MACHINES}/zen5-epyc.json"  # AMD EPYC Zen 5 (family 26): AVX-512, avx512_bf16, no AMX
# x86-64-v2 again with MKL and libm capped too (benchmarks/cpu/capped.py): MKL ignores MKL_ENABLE_INSTRUCTIONS on AMD
ZEN5_V2_CAPPED = "x86-64-v2_capped"
ZEN5_FIRST_RUNS = ("native", *AVX512_EMULATED)
ZEN5_TARGETS = (*ZEN5_FIRST_RUNS, ZEN5_V2_CAPPED)
# and each build again, decoding with the waiting steps' inputs copied into buffers (native from 1K, the others
# after 16K)
ZEN5_MODEL_RUNS = (
    *ZEN5_FIRST_RUNS,
    *(f"{target}_noted-steps-copied" for target in ZEN5_FIRST_RUNS),
    ZEN5_V2_CAPPED,
    "native_grouped-fill",  # after 16K again with the group-sorted copies filled in one pass
)
# generate() after 1K and 2K with rounds enough for 20 s of decoding (--min-seconds) and the stepped medians, every
# build (the x86-64 levels under benchmarks/cpu/capped.py), steps decided once a run (DecodingRun)
ZEN5_SHORT_RUNS = ("native_dense-steps", "x86-64-v3_capped_dense-steps", f"{ZEN5_V2_CAPPED}_dense-steps")
ZEN5_BOOKKEEPING = f"{ZEN5_MACHINE}#decode_bookkeeping_native"
BF16_EXACTNESS = "benchmarks/results/attention_cpu_bf16_exactness.json"
ATTENTION_PARTS = "benchmarks/results/attention_cpu_parts.json"
CROSSOVER = "benchmarks/results/crossover_cpu.json"
CEILING = "benchmarks/results/arithmetic_ceiling.json"
MODEL_PREFILL = "benchmarks/results/model_prefill.json"
MODEL_DECODE = "benchmarks/results/model_decode.json"
MODEL_DECODE_STATIC = "benchmarks/results/model_decode_static.json"
MODEL_STEPS = "benchmarks/results/model_steps.json"
MODEL_STEPS_STATIC = "benchmarks/results/model_steps_static.json"
SINKS = "benchmarks/results/sink_default.json"
QUALITY_PPL = "benchmarks/results/quality/ppl_2048.json"
QUALITY_KL = "benchmarks/results/quality/kl.json"
QUALITY_PASSKEY = "benchmarks/results/quality/passkey.json"
QUALITY_150_PPL = "benchmarks/results/quality-150-steps/ppl_2048.json"
LC_PPL = "benchmarks/long_context/results/ppl.json"
LC_PASSKEY = "benchmarks/long_context/results/passkey.json"
LC_SPEED = "benchmarks/long_context/results/speed.json"
LC_GENERATE = "benchmarks/long_context/results/generate.json"
LC_AUDIT = "benchmarks/long_context/results/audit.json"
LC_ADAPTER_LOG = "benchmarks/long_context/adapter/training_log.json"
LC_ADAPTER_CONFIG = "benchmarks/long_context/adapter/adapter_config.json"
VLLM_SERVING = "benchmarks/results/vllm_serving.json"
LC_CALIBRATION = "benchmarks/long_context/calibration.json"
GPU_SUMMARY = "benchmarks/results/gpu/summary.json"  # benchmarks/gpu/run.sh: every GPU stage's figures, one run
# The profile of commit 3056b1b, then the chunked scans measured (commit 432b95d).
GPU_PROFILE_BEFORE = "benchmarks/results/gpu/profile-3056b1b/profile.json"
GPU_AFTER = "benchmarks/results/gpu/chunked-scan/summary.json"
GPU_PROFILE_AFTER = "benchmarks/results/gpu/chunked-scan/profile.json"
# The quick set of 456c31e (the window band in torch bands, profiled), then the window band as one windowed flash call.
GPU_QUICK = "benchmarks/results/gpu/quick-456c31e/summary.json"
GPU_PROFILE_QUICK = "benchmarks/results/gpu/quick-456c31e/profile.json"
GPU_WINDOW = "benchmarks/results/gpu/window-e9ee7e1/summary.json"
# The GPU path's host operations and peak memory, counted on the CPU (benchmarks/gpu/host_operations.py): before the
# prefill ran in pieces past 32768 query rows, and after; the *-64k files hold the prefill at 32K and 64K.
HOST_OPERATIONS = {
    name: f"benchmarks/results/gpu/host-operations/{name}.json"
    for name in ("before", "after", "before-64k", "after-64k")
}
DEMO_RUN = "benchmarks/results/demo_run.json"  # benchmarks/model/demo_run.py: `focus-hf demo` timed from a fresh cache

AS_SAVED = "focus as saved top-1, w=512, 18 dense heads, dense below 2048"  # the committed adapter's rows
FOCUS_SAVED = "Focus hard as saved (top-1, w=512, 18 dense heads, dense below 2048)"  # the same, model benchmarks
FULL_MODEL = "full attention (adapter disabled)"  # the base model's rows in the model benchmarks


_recording: list[set[str]] = []


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
    """Inside the block, the set it yields collects the path of every file `load` is asked for."""
    read: set[str] = set()
    _recording.append(read)
    try:
        yield read
    finally:
        _recording.remove(read)


def load(path: str) -> Any:
    """The parsed JSON file at `path` (relative to the repository root), or with `#RUN` one run of a machine's file."""
    file, _, run = path.partition("#")
    for read in _recording:
        read.add(file)
    data = _parse(file)
    return data["runs"][run] if run else data


def exists(path: str) -> bool:
    """Whether `path` (a file, or `<machine file>#<run>`) is committed."""
    file, _, run = path.partition("#")
    return (ROOT / file).is_file() and (not run or run in _parse(file)["runs"])


@functools.cache
def _parse(path: str) -> Any:
    return json.loads((ROOT / path).read_text(encoding="utf-8"))


def rows(path: str) -> list[dict]:
    """The rows of a results file: the list itself, or its "rows" entry."""
    data = load(path)
    return data if isinstance(data, list) else data["rows"]


def pick(path: str, index: int | None = None, **match: Any) -> dict:
    """The one row of `path` whose fields equal `match` (the `index`-th when several runs match)."""
    found = [row for row in rows(path) if all(row.get(key) == value for key, value in match.items())]
    if index is not None:
        return found[index]
    if len(found) != 1:
        raise LookupError(f"{path}: {len(found)} rows match {match}, expected 1 (give an index)")
    return found[0]


def ppl_rows(seq_len: int, data: str) -> list[dict]:
    """The long-context perplexity rows of one length and corpus, each with `ppl_ratio` (over dense, same blocks)."""
    mine = [dict(row) for row in rows(LC_PPL) if row["seq_len"] == seq_len and row["data"] == data]
    dense = [row["ppl"] for row in mine if row["kind"] == "dense"]
    for row in mine:
        row["ppl_ratio"] = row["ppl"] / dense[-1]
    return mine


def ppl_ratio(variant: str, seq_len: int = 8192, data: str = "python-docs") -> float:
    (row,) = [row for row in ppl_rows(seq_len, data) if row["variant"] == variant]
    return row["ppl_ratio"]


def density(variant: str, seq_len: int = 8192, data: str = "python-docs") -> float:
    (row,) = [row for row in ppl_rows(seq_len, data) if row["variant"] == variant]
    return row["density"]


# --- formats ---------------------------------------------------------------------------------------------------


def times(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}x"


def percent(share: float, digits: int = 1) -> str:
    return f"{100 * share:.{digits}f}%"


def fixed(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}f}"


def count(value: int) -> str:
    return f"{value:,}"


# --- figures ---------------------------------------------------------------------------------------------------


def _attention(path: str, seq_len: int, top_k: int, field: str = "speedup") -> Callable[[], str]:
    def figure() -> str:
        row = pick(path, seq_len=seq_len, top_k=top_k)
        return times(row[field]) if field == "speedup" else fixed(row[field], 2)

    return figure


def _decode(cache_len: int, top_k: int = 1) -> Callable[[], str]:
    return lambda: times(pick(ATTENTION_DECODE, cache_len=cache_len, top_k=top_k)["speedup"])


def _bf16_error(field: str, floor: str = "reference_rounded_to_bf16") -> Callable[[], str]:
    """Focus's (or dense SDPA's) root-mean-square error in bfloat16 over that of its float64 reference rounded to
    bfloat16 (`floor`), at the longest length measured, top-1: how many times bfloat16's own rounding error it
    carries."""

    def figure() -> str:
        longest = max(row["seq_len"] for row in rows(BF16_EXACTNESS))
        row = pick(BF16_EXACTNESS, seq_len=longest, top_k=1)
        return times(row[field]["rms"] / row[floor]["rms"])

    return figure


def _lc_speed(seq_len: int, variant: str = AS_SAVED, index: int | None = None) -> Callable[[], str]:
    return lambda: times(pick(LC_SPEED, index, seq_len=seq_len, variant=variant)["speedup"])


def _passkey(variant: str, index: int | None = None) -> str:
    row = pick(LC_PASSKEY, index, variant=variant)
    cases = row["cases"]
    return f"{sum(case['correct'] for case in cases)}/{len(cases)}"


def _adapter_megabytes() -> str:
    # Routers are saved in fp32 whatever the base's dtype: 4 bytes per trainable parameter.
    return f"{load(LC_ADAPTER_LOG)['trainable_parameters'] * 4 / 1e6:.1f} MB"


def _audit(variant: str, field: str) -> Callable[[], str]:
    return lambda: percent(pick(LC_AUDIT, variant=variant)[field])


def _quality_ppl(variant: str, path: str = QUALITY_PPL, digits: int = 2) -> Callable[[], str]:
    return lambda: fixed(pick(path, variant=variant)["ppl"], digits)


def _quality_vs_base(variant: str, path: str = QUALITY_PPL) -> Callable[[], str]:
    def figure() -> str:
        base = pick(path, variant="base (full attention)")["ppl"]
        return f"{100 * (pick(path, variant=variant)['ppl'] / base - 1):+.1f}%"

    return figure


def _accuracies(path: str, variant: str) -> str:
    accuracy = pick(path, variant=variant)["accuracy"]
    return " / ".join(percent(accuracy[length], 0) for length in sorted(accuracy, key=int))


def _sinks(setting: str) -> Callable[[], str]:
    return lambda: fixed(pick(SINKS, setting=setting)["ppl"], 2)


def _memory_ratio(seq_len: int, top_k: int) -> Callable[[], str]:
    def figure() -> str:
        def added(row: dict) -> float:
            return row["peak_rss_mib"] - row["rss_before_call_mib"]

        dense = pick(ATTENTION_MEMORY, seq_len=seq_len, variant="dense SDPA")
        return times(added(pick(ATTENTION_MEMORY, seq_len=seq_len, variant="Focus", top_k=top_k)) / added(dense))

    return figure


def _auto_cells() -> list[float]:
    return [row["speedup"] for path in ATTENTION_AUTO.values() for row in rows(path)]


def _model(path: str, prompt_len: int, field: str = "speedup") -> Callable[[], str]:
    return lambda: times(pick(path, prompt_len=prompt_len, variant=FOCUS_SAVED)[field])


def _ceiling(call: str) -> Callable[[], str]:
    return lambda: percent(pick(CEILING, call=call)["fraction_of_gemm"], 0)


def _demo() -> dict:
    """The last measured run of `focus-hf demo` with the default options."""
    return [row for row in rows(DEMO_RUN) if row["command"] == "focus-hf demo"][-1]


def _demo_machine() -> str:
    row = _demo()
    cpu = " ".join(word for word in row["cpu"].split() if word not in ("Processor", "(R)", "(TM)"))
    return f"a {row['cores']}-core {cpu}" + (", shared with other work" if row["other_load_mean"] > 0.5 else "")


def _demo_measured() -> str:
    row = _demo()
    # The CPU time does not depend on what else the machine ran; the wall time does.
    return (
        f"{round(row['wall_seconds'] / 60)} minutes and {row['peak_rss_bytes'] / 1e9:.1f} GB of memory on "
        f"{_demo_machine()}, using {round(row['cpu_seconds'] / 60)} minutes of CPU time"
    )


def _vllm(prompt_tokens: int, field: str) -> Callable[[], str]:
    return lambda: times(pick(VLLM_SERVING, prompt_tokens=prompt_tokens)[field])


def _gpu(stage: str, figure: str, summary: str = GPU_SUMMARY) -> dict:
    """One figure of a committed GPU run's summary (`benchmarks/gpu/run.py`)."""
    found = [row for row in load(summary)["figures"] if row["stage"] == stage and row["figure"] == figure]
    if not found:
        raise KeyError(f"{summary} has no figure {figure!r} of stage {stage!r}")
    return found[0]


def _gpu_ratio(stage: str, figure: str, summary: str = GPU_SUMMARY) -> Callable[[], str]:
    return lambda: times(_gpu(stage, figure, summary)["ratio"])


def _profile_row(path: str, tokens: int, top_k: int) -> dict:
    return next(row for row in load(path)["rows"] if row["tokens"] == tokens and row["top_k"] == top_k)


def _scan_ms(path: str, tokens: int) -> float:
    """Device milliseconds of routing's prefix sums in one top-1 prefill: torch's cumsum operator before the chunked
    scans (its table row), the chunked scan's labelled function after."""
    row = _profile_row(path, tokens, 1)
    labelled = [line["device_ms"] for line in row["by_focus_line"] if line["where"].endswith("prefix_scan.py: _scan")]
    if labelled:
        return labelled[0]
    return next(op["self_device_ms"] for op in row["top_device_ops"] if op["op"] == "aten::cumsum")


def _module_ms(path: str, tokens: int, top_k: int, module: str) -> str:
    """Device milliseconds of one prefill spent in the functions of one focus_hf module (the profile's lines)."""
    lines = _profile_row(path, tokens, top_k)["by_focus_line"]
    return f"{sum(line['device_ms'] for line in lines if line['where'].startswith(module + ':')):.0f} ms"


def _range_mask_over_floor(path: str, tokens: int) -> float:
    """The own-group pass's FlexAttention call (top-2) under the path's mask over the same call with no mask on the
    same block lists (`mask_costs`: the mask's cost over the kernel's floor)."""
    variants = next(row for row in load(path)["mask_costs"] if row["tokens"] == tokens)["variants"]
    return variants["path"] / variants["none"]


def _history(path: str) -> str:
    """One attention layer's bfloat16 speedup at 16K tokens, top-1, one thread, in the run at `path`."""
    return times(pick(path, seq_len=16384, top_k=1, dtype="bfloat16")["speedup"])


def _host_operations(when: str, field: str, top_k: int = 1) -> Callable[[], str]:
    """A 64K prefill's figure in the CPU accounting of the GPU path, `when` "before" or "after" the pieces: its peak
    memory over flash SDPA's, or a count of its prefill row (launches, kernel calls)."""

    def figure() -> str:
        if field == "peak_ratio":
            return times(pick(HOST_OPERATIONS[when], call="peak memory", tokens=65536, top_k=top_k)[field])
        return count(pick(HOST_OPERATIONS[f"{when}-64k"], call="prefill", tokens=65536, top_k=top_k)[field])

    return figure


def _gpu_targets() -> str:
    judged = [row for row in load(GPU_SUMMARY)["figures"] if row.get("meets_target") is not None]
    return f"{sum(row['meets_target'] for row in judged)} of {len(judged)}"


FIGURES: dict[str, Callable[[], str]] = {
    # each machine's file says what the machine is
    **{
        f"machine.{name}": lambda path=path: load(path)["machine"]
        for name, path in (
            ("avx2", AVX2_MACHINE),
            ("avx512", AVX512_MACHINE),
            ("xeon", XEON_MACHINE),
            ("zen5", ZEN5_MACHINE),
        )
    },
    "gpu.device": lambda: load(GPU_SUMMARY)["device"],
    "gpu.commit": lambda: load(GPU_SUMMARY)["git_commit"][:7],
    "gpu.targets_met": _gpu_targets,
    "gpu.top1_256k": _gpu_ratio("attention", "top-1 prefill 256K"),
    "gpu.auto_top1_256k": _gpu_ratio("auto", "top-1 256K"),
    "gpu.auto_top1_1k": _gpu_ratio("auto", "top-1 1K"),
    "gpu.after.top1_256k": _gpu_ratio("attention", "top-1 prefill 256K", GPU_AFTER),
    "gpu.scan_before_256k": lambda: f"{_scan_ms(GPU_PROFILE_BEFORE, 262144):.0f} ms",
    "gpu.scan_after_256k": lambda: f"{_scan_ms(GPU_PROFILE_AFTER, 262144):.1f} ms",
    "gpu.wall_before_256k": lambda: f"{1e3 * _profile_row(GPU_PROFILE_BEFORE, 262144, 1)['wall_s']:.0f} ms",
    "gpu.wall_after_256k": lambda: f"{1e3 * _profile_row(GPU_PROFILE_AFTER, 262144, 1)['wall_s']:.0f} ms",
    "gpu.quick.top1_256k": _gpu_ratio("attention", "top-1 prefill 256K", GPU_QUICK),
    "gpu.quick.wall_256k": lambda: f"{_profile_row(GPU_PROFILE_QUICK, 262144, 1)['device_ms_total']:.0f} ms",
    "gpu.quick.bands_256k": lambda: _module_ms(GPU_PROFILE_QUICK, 262144, 1, "focus_hf/attention/gpu/bands.py"),
    "gpu.window.commit": lambda: load(GPU_WINDOW)["git_commit"][:7],
    "gpu.window.top1_64k": _gpu_ratio("attention", "top-1 prefill 64K", GPU_WINDOW),
    "gpu.window.top1_256k": _gpu_ratio("attention", "top-1 prefill 256K", GPU_WINDOW),
    "gpu.window.top1_1m": _gpu_ratio("attention", "top-1 prefill 1M", GPU_WINDOW),
    "gpu.window.top2_1m": _gpu_ratio("attention", "top-2 prefill 1M", GPU_WINDOW),
    "gpu.window.top2_64k": _gpu_ratio("attention", "top-2 prefill 64K", GPU_WINDOW),
    "gpu.window.peak_top2_1m": _gpu_ratio("attention", "top-2 prefill 1M peak", GPU_WINDOW),
    "gpu.quick.range_mask_256k": lambda: times(_range_mask_over_floor(GPU_PROFILE_QUICK, 262144)),
    # the GPU path at 64K before and after it ran in pieces, counted on the CPU
    **{
        f"gpu.pieces.{field}_{when}_top{top_k}_64k": _host_operations(when, field, top_k)
        for field in ("peak_ratio", "launches", "kernel_calls")
        for when in ("before", "after")
        for top_k in (1, 2)
    },
    "gpu.pieces.before_commit": lambda: load(HOST_OPERATIONS["before-64k"])["git_commit"][:7],
    "gpu.pieces.after_commit": lambda: load(HOST_OPERATIONS["after-64k"])["git_commit"][:7],
    # what changed the speed, for the changelog: the same figure before and after a change, each from its own run
    "history.xeon_bf16_vectors_16k": lambda: _history(f"{XEON_MACHINE}#attention_parts_native_before-amx-tiles"),
    "history.xeon_bf16_tiles_16k": lambda: _history(f"{XEON_MACHINE}#attention_parts_native"),
    "history.zen5_generate_16k_kept": lambda: times(
        pick(f"{ZEN5_MACHINE}#model_decode_16k_native", prompt_len=16384, variant=FOCUS_SAVED)["speedup"]
    ),
    "history.zen5_generate_16k_copied": lambda: times(
        pick(f"{ZEN5_MACHINE}#model_decode_16k_native_noted-steps-copied", prompt_len=16384, variant=FOCUS_SAVED)[
            "speedup"
        ]
    ),
    "history.zen5_steps_16k_kept": lambda: times(
        pick(f"{ZEN5_MACHINE}#model_decode_steps_16k_native", prompt_len=16384, variant=FOCUS_SAVED)["speedup"]
    ),
    "history.zen5_steps_16k_copied": lambda: times(
        pick(f"{ZEN5_MACHINE}#model_decode_steps_16k_native_noted-steps-copied", prompt_len=16384, variant=FOCUS_SAVED)[
            "speedup"
        ]
    ),
    # vLLM's CPU engine, Focus (the committed adapter) over vLLM's dense attention (benchmarks/model/vllm_serving.py)
    **{
        f"vllm.{kind}_{length // 1024}k": _vllm(length, f"{kind}_speedup")
        for length in (4096, 8192, 16384, 32768)
        for kind in ("prefill", "decode")
    },
    "vllm.kv_ratio": lambda: times(rows(VLLM_SERVING)[0]["kv_bytes_per_token"]["ratio"]),
    # quality beside that speed: the prompt's perplexity, Focus over dense, and the greedy tokens that agree
    **{
        f"vllm.ppl_{length // 1024}k": lambda length=length: times(
            pick(VLLM_SERVING, prompt_tokens=length)["prompt_ppl"]["ratio"], 3
        )
        for length in (4096, 8192, 16384)
    },
    **{
        f"vllm.ppl_{kind}_{length // 1024}k": lambda length=length, kind=kind: fixed(
            pick(VLLM_SERVING, prompt_tokens=length)["prompt_ppl"][kind], 2
        )
        for length in (4096, 8192, 16384)
        for kind in ("dense", "focus")
    },
    **{
        f"vllm.agree_{length // 1024}k": lambda length=length: pick(VLLM_SERVING, prompt_tokens=length)[
            "greedy_tokens_equal_to_dense"
        ]
        for length in (4096, 8192, 16384, 32768)
    },
    # `focus-hf demo` with the defaults, from a fresh cache: wall time, peak memory, the machine
    "demo.minutes": lambda: f"{round(_demo()['wall_seconds'] / 60)} minutes",
    "demo.memory": lambda: f"{_demo()['peak_rss_bytes'] / 1e9:.1f} GB",
    "demo.machine": _demo_machine,
    "demo.measured": _demo_measured,
    # the committed long-context adapter (SmolLM2-135M-Instruct, distilled, K=8, top-1, w=512, 18 dense heads)
    "adapter.parameters": lambda: count(load(LC_ADAPTER_LOG)["trainable_parameters"]),
    "adapter.size": _adapter_megabytes,
    "adapter.dense_heads": lambda: str(len(load(LC_ADAPTER_CONFIG)["dense_heads"])),
    "adapter.dense_below": lambda: count(load(LC_ADAPTER_CONFIG)["dense_below"]),
    "lc.ppl_8k": lambda: times(ppl_ratio(AS_SAVED), 3),
    "lc.ppl_4k": lambda: times(ppl_ratio(AS_SAVED, 4096), 3),
    "lc.ppl_source_8k": lambda: times(ppl_ratio(AS_SAVED, data="python-source"), 3),
    "lc.density_8k": lambda: fixed(density(AS_SAVED), 2),
    "lc.passkey": lambda: _passkey(AS_SAVED),
    "lc.passkey_prompts": lambda: str(len(pick(LC_PASSKEY, variant=AS_SAVED)["cases"])),
    "lc.passkey_dense": lambda: _passkey("dense", index=-1),  # the run of the committed adapter's prompts
    "lc.prefill_512": _lc_speed(512),
    "lc.prefill_1k": _lc_speed(1024),
    "lc.prefill_2k": _lc_speed(2048),
    "lc.prefill_4k": _lc_speed(4096),
    "lc.prefill_8k": _lc_speed(8192),
    "lc.prefill_16k": _lc_speed(16384),
    "lc.prefill_32k": _lc_speed(32768),
    "lc.prefill_8k_w128": _lc_speed(8192, "focus top-1, w=128, 0 dense heads", index=0),
    "lc.prefill_8k_w128_run2": _lc_speed(8192, "focus top-1, w=128, 0 dense heads", index=1),
    "lc.prefill_8k_adaptive": _lc_speed(8192, "focus adaptive p=0.9999 (at most 2), w=128, 0 dense heads"),
    "lc.prefill_8k_w512_3": _lc_speed(8192, "focus top-1, w=512, 3 dense heads"),
    "lc.ppl_8k_w512_3": lambda: times(ppl_ratio("focus top-1, w=512, 3 dense heads"), 3),
    "lc.ppl_8k_w128": lambda: times(ppl_ratio("focus top-1, w=128, 0 dense heads"), 3),
    "lc.ppl_8k_w128_top2": lambda: times(ppl_ratio("focus top-2, w=128, 0 dense heads"), 3),
    "lc.ppl_8k_streaming": lambda: times(ppl_ratio("streaming (training-free)"), 3),
    "lc.passkey_w512_3": lambda: _passkey("focus top-1, w=512, 3 dense heads"),
    "audit.window_128": _audit("focus top-1, w=128, 0 dense heads", "local"),
    "audit.adapter_128": _audit("focus top-1, w=128, 0 dense heads", "adapter"),
    "audit.oracle_128": _audit("focus top-1, w=128, 0 dense heads", "oracle"),
    "audit.key_oracle_128": _audit("focus top-1, w=128, 0 dense heads", "key_oracle"),
    "audit.adapter_saved": _audit(AS_SAVED, "adapter"),
    # one attention layer on this CPU (K=8, w=128, 4 sinks, 9x64 heads / 3 kv, fp32, backend auto)
    "attn.top1_1k": _attention(ATTENTION, 1024, 1),
    "attn.top1_4k": _attention(ATTENTION, 4096, 1),
    "attn.top1_16k": _attention(ATTENTION, 16384, 1),
    "attn.top1_64k": _attention(ATTENTION, 65536, 1),
    "attn.top2_4k": _attention(ATTENTION, 4096, 2),
    "attn.top2_16k": _attention(ATTENTION, 16384, 2),
    "attn.top2_64k": _attention(ATTENTION, 65536, 2),
    "attn.qr_top1_64k": _attention(ATTENTION_QUERY_ROUTER, 65536, 1),
    "attn.decode_1k": _decode(1024),
    "attn.decode_8k": _decode(8192),
    "attn.decode_64k": _decode(65536),
    "attn.decode_128k": _decode(131072),
    "attn.decode_top2_1k": _decode(1024, 2),
    "attn.decode_top2_64k": _decode(65536, 2),
    "attn.bf16_top1_4k": _attention(ATTENTION_BF16, 4096, 1),
    "attn.bf16_top1_16k": _attention(ATTENTION_BF16, 16384, 1),
    "attn.bf16_top1_64k": _attention(ATTENTION_BF16, 65536, 1),
    # The same layer on the current kernels: the AVX-512 machine's `focus-hf bench` again, and the AVX2 machine's
    # `auto` at 64K on one thread (the path it chose).
    "avx512.top1_64k": _attention(f"{AVX512_MACHINE}#attention_bench_native", 65536, 1),
    "avx512.bf16_top1_64k": _attention(f"{AVX512_MACHINE}#attention_bench_bf16_native", 65536, 1),
    "avx2.auto_top1_64k": _attention(f"{AVX2_MACHINE}#attention_auto_native", 65536, 1),
    "xeon.bf16_top1_64k": lambda: times(
        pick(f"{XEON_MACHINE}#attention_parts_native", seq_len=65536, top_k=1, dtype="bfloat16")["speedup"]
    ),
    "attn.bf16_top2_4k": _attention(ATTENTION_BF16, 4096, 2),
    "attn.bf16_top2_16k": _attention(ATTENTION_BF16, 16384, 2),
    "attn.bf16_top2_64k": _attention(ATTENTION_BF16, 65536, 2),
    "attn.bf16_error": _bf16_error("focus_sparse_bf16"),
    "attn.bf16_dense_error": _bf16_error("dense_sdpa_bf16_causal", "dense_reference_rounded_to_bf16"),
    "attn.auto_lowest": lambda: times(min(_auto_cells())),
    "attn.auto_cells": lambda: str(len(_auto_cells())),
    "attn.auto_kept": lambda: str(sum(value >= 0.95 for value in _auto_cells())),
    "attn.memory_128k_top1": _memory_ratio(131072, 1),
    "attn.memory_128k_top2": _memory_ratio(131072, 2),
    "ceiling.sdpa_4k": _ceiling("dense causal SDPA, 4,096 tokens"),
    "ceiling.sdpa_256": _ceiling("dense causal SDPA, 256 tokens"),
    # SmolLM2-135M-Instruct end to end with the committed adapter
    "model.prefill_8k": lambda: times(pick(MODEL_PREFILL, seq_len=8192, variant=FOCUS_SAVED)["speedup"]),
    "model.prefill_16k": lambda: times(pick(MODEL_PREFILL, seq_len=16384, variant=FOCUS_SAVED)["speedup"]),
    "model.decode_8k": _model(MODEL_DECODE, 8192),
    "model.decode_16k": _model(MODEL_DECODE, 16384),
    "model.decode_static_16k": _model(MODEL_DECODE_STATIC, 16384),
    "model.steps_2k": _model(MODEL_STEPS, 2048),
    "model.steps_8k": _model(MODEL_STEPS, 8192),
    "model.steps_16k": _model(MODEL_STEPS, 16384),
    "model.steps_static_16k": _model(MODEL_STEPS_STATIC, 16384),
    # attention sinks (random routers, 2,048 tokens)
    "sinks.full": _sinks("full attention"),
    "sinks.top1_0": _sinks("hard top-1, 0 sinks"),
    "sinks.top1_1": _sinks("hard top-1, 1 sinks"),
    # the quality study (LM-loss training, 40 steps, 2,048 tokens)
    "quality.base": _quality_ppl("base (full attention)"),
    "quality.k4_hard2": _quality_vs_base("smollm2-python-docs-k4 hard top-2"),
    "quality.k4_hard3": _quality_vs_base("smollm2-python-docs-k4 hard top-3"),
    "quality.k8_hard2": _quality_vs_base("smollm2-python-docs-k8 hard top-2"),
    "quality.lora16": _quality_vs_base("LoRA r=16 (q,v)"),
    "quality.kl_lora4": lambda: f"{pick(QUALITY_KL, variant='LoRA r=4 (q,v)')['kl_inside']:.1e}",
    "quality.kl_lora16": lambda: f"{pick(QUALITY_KL, variant='LoRA r=16 (q,v)')['kl_inside']:.1e}",
    "quality.greedy_focus": lambda: percent(
        pick(QUALITY_KL, variant="smollm2-python-docs-k8 hard top-1")["greedy_same_inside"], 0
    ),
    "quality.greedy_lora4": lambda: percent(pick(QUALITY_KL, variant="LoRA r=4 (q,v)")["greedy_same_inside"], 0),
    "quality.greedy_lora16": lambda: percent(pick(QUALITY_KL, variant="LoRA r=16 (q,v)")["greedy_same_inside"], 0),
    "quality.passkey_base": lambda: _accuracies(QUALITY_PASSKEY, "base (full attention)"),
    "quality.passkey_k8": lambda: _accuracies(QUALITY_PASSKEY, "smollm2-python-docs-k8 hard top-2"),
    "quality150.base": _quality_ppl("base (full attention)", QUALITY_150_PPL, 3),
    "quality150.k4_soft": _quality_ppl("smollm2-python-docs-k4 soft", QUALITY_150_PPL, 3),
    "quality150.k4_hard3": _quality_vs_base("smollm2-python-docs-k4 hard top-3", QUALITY_150_PPL),
    "quality150.k4_hard2": _quality_vs_base("smollm2-python-docs-k4 hard top-2", QUALITY_150_PPL),
}


# --- tables ----------------------------------------------------------------------------------------------------


def _table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def sinks_table() -> str:
    data = rows(SINKS)
    counts = sorted({row["sinks"] for row in data if "sinks" in row})
    body = [
        [f"top-{top_k} PPL"] + [fixed(pick(SINKS, sinks=n, top_k=top_k)["ppl"], 2) for n in counts] for top_k in (1, 2)
    ]
    body.append(
        ["full attention"] + [fixed(pick(SINKS, setting="full attention")["ppl"], 2)] + [""] * (len(counts) - 1)
    )
    return _table(["sinks"] + [str(n) for n in counts], body)


def quality_table() -> str:
    names = {
        "base (full attention)": "base",
        "smollm2-python-docs-k4 soft": "K=4 soft",
        "smollm2-python-docs-k4 hard top-2": "K=4 hard top-2",
        "smollm2-python-docs-k8 soft": "K=8 soft",
        "smollm2-python-docs-k8 hard top-2": "K=8 hard top-2",
        "LoRA r=4 (q,v)": "LoRA r=4",
        "LoRA r=16 (q,v)": "LoRA r=16",
    }
    return _table(
        ["held-out PPL, 2,048 tokens"] + list(names.values()),
        [["python-docs"] + [fixed(pick(QUALITY_PPL, variant=v)["ppl"], 2) for v in names]],
    )


def _window(row: dict) -> int:
    """A row's window: recorded in the row, else in its command (the training-free baselines), else 128."""
    words = row.get("command", "").split()
    return row.get("window") or (int(words[words.index("--window") + 1]) if "--window" in words else 128)


def long_context_table() -> str:
    """The committed adapter and the settings it was chosen against, at 8K tokens (python-docs held-out)."""
    ppl = ppl_rows(8192, "python-docs")
    labels = {
        AS_SAVED: "**committed adapter** (top-1, w=512, 18 dense heads)",
        "focus top-1, w=512, 3 dense heads": "same routers, 3 dense heads",
        "focus top-2, w=512, 3 dense heads": "same routers, top-2, 3 dense heads",
        "focus top-1, w=128, 0 dense heads": "same routers, w=128, no dense heads",
        "focus adaptive p=0.9999 (at most 2), w=128, 0 dense heads": "same, adaptive probing p=0.9999 (w=128)",
    }
    chosen = [(row, labels[row["variant"]]) for variant in labels for row in ppl if row["variant"] == variant]
    for row in sorted((r for r in ppl if r["kind"] == "blocks"), key=lambda r: (_window(r), r["density"])):
        share = row["block_density"]
        chosen.append((row, f"block selection (training-free), w={_window(row)}, {share:g} of distant blocks"))
    chosen += [(row, "window + sinks only (training-free)") for row in ppl if row["kind"] == "streaming"]
    passkeys = {row["variant"]: row for row in rows(LC_PASSKEY)}
    prefill: dict[str, float] = {}
    for row in rows(LC_SPEED):
        if row["seq_len"] == 8192:
            prefill.setdefault(row["variant"], row["speedup"])  # the first measured row of each setting
    body = []
    for row, label in chosen:
        key = passkeys.get(row["variant"])
        passkey = "-" if key is None else f"{sum(c['correct'] for c in key['cases'])}/{len(key['cases'])}"
        speed = times(prefill[row["variant"]]) if row["variant"] in prefill else "-"
        body.append([label, fixed(row["density"], 2), times(row["ppl_ratio"], 3), passkey, speed])
    header = ["at 8,192 tokens", "share of causal pairs", "PPL vs dense", "passkey 1K-8K", "prefill vs dense"]
    return _table(header, body)


def auto_table() -> str:
    """Backend auto against dense SDPA for every K, top-k and length."""
    lengths = sorted({row["seq_len"] for row in rows(ATTENTION_AUTO[8])})
    body = []
    for k, path in ATTENTION_AUTO.items():
        for top_k in sorted({row["top_k"] for row in rows(path)}):
            cells = [times(pick(path, seq_len=n, top_k=top_k)["speedup"]) for n in lengths]
            body.append([str(k), str(top_k)] + cells)
    return _table(["K", "top-k"] + [count(n) for n in lengths], body)


def targets_table() -> str:
    """The speed targets of the attention layer and where they stand, each judged from the JSON."""

    def ratio(path: str, seq_len: int, top_k: int) -> float:
        row = pick(path, seq_len=seq_len, top_k=top_k)
        return row["speedup"] / row["ideal_speedup"]

    lengths = (4096, 16384, 65536)
    floors = {4096: 0.6, 16384: 0.8, 65536: 0.8}
    eff = {
        (routing, k): " / ".join(fixed(ratio(path, n, k), 2) for n in lengths)
        for routing, path in (("own", ATTENTION), ("query", ATTENTION_QUERY_ROUTER))
        for k in (1, 2)
    }
    efficient = all(ratio(ATTENTION, n, k) >= floors[n] for n in lengths for k in (1, 2))
    prefill = [row["speedup"] for row in rows(ATTENTION) if row["seq_len"] >= 1024]
    decode = [row["speedup"] for row in rows(ATTENTION_DECODE) if row["cache_len"] >= 1024]
    decode_64k = pick(ATTENTION_DECODE, cache_len=65536, top_k=1)["speedup"]
    bf16 = {k: " / ".join(value(f"attn.bf16_top{k}_{n // 1024}k") for n in lengths) for k in (1, 2)}
    checks = [
        (
            "`auto` >= 0.95x dense at every length from 1K (prefill, top-1 and top-2, K=8)",
            f"lowest {times(min(prefill))}",
            min(prefill) >= 0.95,
        ),
        (
            "`auto` >= 0.95x dense in every cell (K 4-16, top-k 1-4, 256-16K tokens)",
            f"{value('attn.auto_kept')} of {value('attn.auto_cells')} cells, lowest {value('attn.auto_lowest')}",
            min(_auto_cells()) >= 0.95,
        ),
        (
            "efficiency (speedup / pair-count ideal) >= 0.6 at 4K, >= 0.8 at 16K and 64K",
            f"top-1 {eff['own', 1]}, top-2 {eff['own', 2]} (query router: {eff['query', 1]}, {eff['query', 2]})",
            efficient,
        ),
        (
            "decoding >= 0.95x dense at every cache from 1K (top-1 and top-2), >= 3x at 64K (top-1, K=8)",
            f"{times(min(decode))} at the lowest, {times(decode_64k)} at 64K",
            min(decode) >= 0.95 and decode_64k >= 3,
        ),
        (
            "bfloat16 prefill against dense bfloat16 SDPA, 4K / 16K / 64K",
            f"top-1 {bf16[1]}, top-2 {bf16[2]}; root-mean-square error {value('attn.bf16_error')} that of bfloat16's "
            f"rounding (dense bfloat16 SDPA: {value('attn.bf16_dense_error')})",
            None,
        ),
        (
            "peak memory of a 128K prefill <= dense",
            f"{value('attn.memory_128k_top1')} (top-1), {value('attn.memory_128k_top2')} (top-2)",
            None,
        ),
    ]
    verdict = {True: "met", False: "**not met**", None: ""}
    return _table(["target", "measured", ""], [[target, measured, verdict[ok]] for target, measured, ok in checks])


def parts_table() -> str:
    """Where a prefill's time goes on one thread, per visible pair and query head, against dense SDPA's kernel."""
    body = []
    for row in sorted(rows(ATTENTION_PARTS), key=lambda row: (row["dtype"], row["top_k"], row["seq_len"])):
        body.append(
            [
                row["dtype"],
                f"top-{row['top_k']}",
                count(row["seq_len"]),
                fixed(row["dense_ns_per_pair_head"], 2),
                fixed(row["set_a_ns_per_pair_head"], 2),
                fixed(row["local_ns_per_pair_head"], 2),
                percent(row["set_a_cpu_s"] / row["focus_cpu_s"], 0),
                percent(row["local_cpu_s"] / row["focus_cpu_s"], 0),
                times(row["speedup"]) + " / " + times(row["ideal_speedup"]),
            ]
        )
    header = [
        "dtype",
        "top-k",
        "tokens",
        "dense ns",
        "own-group pass ns",
        "local ns",
        "own-group pass time",
        "local time",
    ]
    return _table(header + ["speedup / ideal"], body)


# Each CPU measured, its native build: (name, machine file, runs read per figure - the newest run holding it).
PLATFORMS = (
    ("AMD EPYC, AVX2 (Zen 3)", AVX2_MACHINE, {"generate": "model_decode_native", "steps": "model_decode_steps_native"}),
    ("AMD EPYC, AVX-512", AVX512_MACHINE, {"generate": "model_decode_native", "steps": "model_decode_steps_native"}),
    (
        "Intel Xeon, AVX-512 + AMX",
        XEON_MACHINE,
        {"generate": "model_decode_native", "steps": "model_decode_steps_native"},
    ),
    (
        "AMD EPYC, AVX-512 (Zen 5)",
        ZEN5_MACHINE,
        {"generate": "model_decode_native_noted-steps-copied", "steps": "model_decode_steps_native_dense-steps"},
    ),
)


def _platform_cell(path: str, length_field: str, length: int, **match: Any) -> str:
    """A speedup of the run at `path` (a Focus row at `length`), linked to the run; "-" where not measured."""
    found = [
        row for row in rows(path) if row.get(length_field) == length and all(row.get(k) == v for k, v in match.items())
    ]
    return f"[{times(found[0]['speedup'])}]({path})" if found else "-"


def platforms_table() -> str:
    """Per CPU measured, the native build: one attention layer (one thread, CPU time) at 16K tokens, top-1, float32
    and bfloat16; one decoding step against a 64K cache; the whole model's prefill of 8K tokens, generate() after an
    8K prompt and decoding steps after 2K, each against the base model in the same run."""
    body = []
    for name, machine, runs in PLATFORMS:
        parts = f"{machine}#attention_parts_native"
        body.append(
            [
                name,
                _platform_cell(parts, "seq_len", 16384, top_k=1, dtype="float32"),
                _platform_cell(parts, "seq_len", 16384, top_k=1, dtype="bfloat16"),
                _platform_cell(f"{machine}#attention_decode_native", "cache_len", 65536, top_k=1),
                _platform_cell(f"{machine}#model_prefill_native", "seq_len", 8192, variant=FOCUS_SAVED),
                _platform_cell(f"{machine}#{runs['generate']}", "prompt_len", 8192, variant=FOCUS_SAVED),
                _platform_cell(f"{machine}#{runs['steps']}", "prompt_len", 2048, variant=FOCUS_SAVED),
            ]
        )
    header = ["processor (2 cores)", "layer 16K float32", "layer 16K bfloat16", "decoding step, 64K cache"]
    return _table(header + ["model prefill 8K", "generate() after 8K", "decoding steps after 2K"], body)


def target_rows(
    stem: str, machine: str = AVX2_MACHINE, targets: tuple[str, ...] = CPU_TARGETS
) -> Iterator[tuple[str, str, dict]]:
    """(build, results file, row) of each build's <machine>/<stem>_<build>.json."""
    for target in targets:
        path = f"{machine}#{stem}_{target}"
        for row in rows(path):
            yield target, path, row


def cpu_targets_table(
    machine: str = AVX2_MACHINE, targets: tuple[str, ...] = CPU_TARGETS, dtype: Optional[str] = None
) -> str:
    """One attention layer per build of the C kernels (`FOCUS_HF_CPU_TARGET`), all measured on one machine by
    benchmarks/cpu/prefill_parts.py (one thread, CPU time): speedup over dense SDPA of the C kernels and of the torch
    path, the pair-count ideal, and the own-group pass's cost per pair against dense SDPA's (rows of `dtype` only,
    if given)."""
    body = []
    for target, path, row in target_rows("attention_parts", machine, targets):
        if dtype is not None and row["dtype"] != dtype:
            continue
        build = row["cpu_kernels"]
        body.append(
            [
                build_label(target, path, row),
                str(build["vector_floats"]),
                f"{row['seq_len']:,}",
                str(row["top_k"]),
                times(row["speedup"]),
                times(row["torch_path_speedup"]),
                times(row["ideal_speedup"]),
                f"{row['speedup'] / row['ideal_speedup']:.2f}",
                f"{row['set_a_ns_per_pair_head']:.2f} / {row['dense_ns_per_pair_head']:.2f}",
            ]
        )
    header = ["build", "floats per vector", "tokens", "top-k", "C kernels", "torch path", "ideal", "efficiency"]
    return _table(header + ["own-group pass / dense ns per pair"], body)


def bench_table(paths: tuple[str, ...]) -> str:
    """`focus-hf bench` rows (prefill, backend auto) of the files or runs at `paths`: dense SDPA and Focus in turn in
    one process, wall clock of the threads each row records."""
    body = []
    for path in paths:
        for row in rows(path):
            body.append(
                [
                    f"[{row['dtype']}]({path})",
                    f"{row['seq_len']:,}",
                    str(row["top_k"]),
                    f"{row['dense_s'] * 1e3:.1f} / {row['focus_s'] * 1e3:.1f} ms",
                    times(row["speedup"]),
                    times(row["ideal_speedup"]),
                    f"{row['speedup'] / row['ideal_speedup']:.2f}",
                    str(row["threads"]),
                ]
            )
    header = ["dtype", "tokens", "top-k", "dense / Focus", "speedup", "ideal", "efficiency", "threads"]
    return _table(header, body)


def build_label(target: str, path: str, row: dict) -> str:
    """A per-build row's first cell: the build linked to its results file, with what `native` resolved to, and the
    level torch's own kernels were capped to where the run's name says so (`<build>_torch-<level>`; `<build>_capped`:
    with MKL and libm too, benchmarks/cpu/capped.py), or the variant it names (`<build>_<variant>`:
    `before-amx-tiles`)."""
    build, _, variant = target.partition("_")
    label = f"[{build}]({path})"
    if build == "native":
        label += f" ({row['cpu_kernels']['march']})"
    if variant.startswith("torch-"):
        label += f", torch's kernels capped at {variant.removeprefix('torch-')}"
    elif variant == "capped":
        label += ", torch's kernels, MKL and libm capped at the same level"
    elif variant:
        label += f", {variant.replace('-', ' ')}"
    return label


def cpu_targets_decode_table(machine: str = AVX2_MACHINE, targets: tuple[str, ...] = CPU_TARGETS) -> str:
    """One decoding step of one attention layer per build of the C kernels (`focus-hf bench --decode`, one thread),
    `auto` against dense SDPA on the same cache, all measured on one machine."""
    body = []
    for target, path, row in target_rows("attention_decode", machine, targets):
        body.append(
            [
                f"[{target}]({path})",
                f"{row['cache_len']:,}",
                str(row["top_k"]),
                f"{row['dense_s'] * 1e3:.3f} / {row['focus_s'] * 1e3:.3f}",
                times(row["speedup"]),
                times(row["ideal_speedup"]),
                row["focus_path"],
            ]
        )
    header = ["build", "cache tokens", "top-k", "dense / Focus ms", "speedup", "ideal", "Focus path"]
    return _table(header, body)


# What each `focus_path` of a `focus-hf bench` row is (`hard.hard_attention`'s paths).
AUTO_PATHS = {"sparse": "C kernels", "sparse-torch": "torch path", "dense": "dense masked call"}


def cpu_targets_auto_table(machine: str = AVX2_MACHINE, targets: tuple[str, ...] = CPU_TARGETS) -> str:
    """One attention layer's prefill far beyond the lengths "auto" calibrates, per build (`focus-hf bench --backend
    auto`, one thread): the race of its two sparse paths on the untimed first call (each path's seconds), the path
    "auto" then ran, and that run against dense SDPA."""
    body = []
    for target, path, row in target_rows("attention_auto", machine, targets):
        race = row["race"]
        body.append(
            [
                f"[{target}]({path})" + ("" if row["dtype"] == "float32" else f", {row['dtype']}"),
                f"{row['seq_len']:,}",
                str(row["top_k"]),
                "-" if race is None else f"{race['kernels_s']:.2f} / {race['torch_s']:.2f}",
                AUTO_PATHS.get(row["focus_path"], row["focus_path"]),
                (
                    f"{row['dense_s']:.1f} / {row['focus_s']:.2f} s"
                    if row["dense_s"] >= 1
                    else f"{row['dense_s'] * 1e3:.1f} / {row['focus_s'] * 1e3:.1f} ms"
                ),
                times(row["speedup"]),
                times(row["ideal_speedup"]),
                f"{row['speedup'] / row['ideal_speedup']:.2f}",
            ]
        )
    header = ["build", "tokens", "top-k", "race: C kernels / torch path s", "auto ran", "dense / Focus", "speedup"]
    return _table(header + ["ideal", "efficiency"], body)


def cpu_targets_demo_table(machine: str = AVX2_MACHINE, targets: tuple[str, ...] = CPU_TARGETS) -> str:
    """`focus-hf demo`'s speed line per build of the C kernels, on one machine: the demo's own (<machine>/demo: its
    eval_results.json and printed lines), then benchmarks/model/demo_speed.py's repeat of that step on the adapter it
    wrote, once per build."""
    demo = load(f"{machine}#demo/eval_results")
    runs = [("native, `focus-hf demo` itself", f"{machine}#demo/printed.txt", demo["speed"])]
    for target in targets:
        path = f"{machine}#demo_speed_{target}"
        runs.append((f"{target}, `benchmarks/model/demo_speed.py`", path, rows(path)[0]))
    body = [
        [
            f"[{name}]({path})",
            f"{speed['seq_len']:,}",
            f"{speed['full_seconds']:.1f} / {speed['hard_seconds']:.1f} s",
            times(speed["speedup"]),
            str(speed["threads"]),
        ]
        for name, path, speed in runs
    ]
    return _table(["build", "prefill tokens", "full attention / Focus", "speedup", "threads"], body)


def cpu_targets_model_table(machine: str = AVX2_MACHINE, targets: tuple[str, ...] = CPU_TARGETS) -> str:
    """The whole model (SmolLM2-135M with the committed adapter) per build of the C kernels, all measured on one
    machine: one prefill (benchmarks/model/prefill.py) and generate()'s decoding speed after a prompt
    (benchmarks/model/generate.py), each against the base model in the same run, with the quality of the setting."""
    body = []
    for target in targets:
        # (path, row) by length of each build's files: model_<kind>_<build>.json, and model_<kind>_16k_<build>.json
        # where the longest prompts ran apart
        prefill = lengths_of("model_prefill", machine, target, "seq_len")
        decode = lengths_of("model_decode", machine, target, "prompt_len")
        for length in sorted(set(prefill) | set(decode)):
            cells = [f"[{target}]({(prefill.get(length) or decode[length])[0]})", f"{length:,}", "-", "-", "-", "-"]
            if length in prefill:
                prefill_path, row = prefill[length]
                full = pick(prefill_path, seq_len=length, variant=FULL_MODEL)
                cells[2:4] = [f"{full['seconds']:.1f} / {row['seconds']:.1f} s", times(row["speedup"])]
                cells[4] = f"{row['ppl_vs_full']:.3f}"
            if length in decode:
                decode_path, row = decode[length]
                full = pick(decode_path, prompt_len=length, variant=FULL_MODEL)
                rate = f"{full['decode_tokens_per_s']:.1f} / {row['decode_tokens_per_s']:.1f}"
                cells[5] = f"{rate} tokens/s, {times(row['speedup'])} ({row['argmax_agree']}/{row['new_tokens']} agree)"
            body.append(cells)
    header = ["build", "prompt tokens", "prefill: base / Focus", "prefill speedup", "perplexity vs base"]
    return _table(header + ["generate(): base / Focus (greedy tokens as the base model's)"], body)


def lengths_of(stem: str, machine: str, target: str, length_field: str) -> dict[int, tuple[str, dict]]:
    """(file, Focus row) by length of a build's <machine>/<stem>_<build>.json and, where it exists,
    <machine>/<stem>_16k_<build>.json (the longest prompts, run apart)."""
    found = {}
    for path in (f"{machine}#{stem}_{target}", f"{machine}#{stem}_16k_{target}"):
        if exists(path):
            found.update({row[length_field]: (path, row) for row in rows(path) if row["variant"] == FOCUS_SAVED})
    return found


def cpu_targets_steps_table(machine: str = AVX2_MACHINE, targets: tuple[str, ...] = CPU_TARGETS) -> str:
    """Decoding steps of the whole model per build of the C kernels, the base model's and Focus's taken in turn in one
    process (benchmarks/model/decode_steps.py), medians, all measured on one machine (with the longest prompts'
    file, model_decode_steps_16k_<build>.json, where they ran apart)."""
    body = []
    for target in targets:
        for length, (path, row) in sorted(lengths_of("model_decode_steps", machine, target, "prompt_len").items()):
            full = pick(path, prompt_len=length, variant=FULL_MODEL)
            body.append(
                [
                    f"[{target}]({path})",
                    f"{length:,}",
                    f"{full['step_ms']:.1f} / {row['step_ms']:.1f} ms",
                    times(row["speedup"]),
                    str(row["steps"]),
                ]
            )
    return _table(["build", "prompt tokens", "step: base / Focus", "speedup", "steps each"], body)


def decode_bookkeeping_table(path: str) -> str:
    """What Focus's layers cost a decoding step outside the attention modules they wrap
    (benchmarks/model/decode_bookkeeping.py): the adapter disabled, Focus as saved, and Focus deciding every dense step
    afresh, stepped in turn, medians."""
    body = [
        [
            f"[{row['prompt_len']:,}]({path})",
            row["variant"],
            f"{row['step_ms']:.1f} ms",
            f"{row['bookkeeping_ms']:.2f} ms",
            f"{row['bookkeeping_us_per_layer']:.1f} us",
        ]
        for row in rows(path)
    ]
    return _table(["prompt tokens", "variant", "step", "outside the attention modules", "per layer"], body)


def processors_table() -> str:
    """Which processor each CPU results file of the attention layer was measured on, with its instruction sets, the C
    kernels' build and the cores other processes kept busy while it was timed, where the rows record them (rows
    written before they did say "not recorded")."""
    paths = [ATTENTION, ATTENTION_QUERY_ROUTER, ATTENTION_DECODE, ATTENTION_BF16, BF16_EXACTNESS, ATTENTION_PARTS]
    paths.append(CROSSOVER)
    paths += [*ATTENTION_AUTO.values(), ATTENTION_MEMORY, CEILING]
    body = []
    for path in paths:
        found = [row for row in rows(path) if "processor" in row]
        first = found[0] if found else {"processor": "not recorded"}
        kernels = first.get("cpu_kernels")
        build = "not recorded"
        if kernels is not None:
            build = ", ".join(kernels["uses"]) if kernels.get("built") else "not built: torch operations"
        others = [row["other_cores_busy"] for row in found if row.get("other_cores_busy") is not None]
        loads = [row["load_avg_1m"] for row in found if "load_avg_1m" in row]
        machine = f"at most {max(others):.2f} cores" if others else "not recorded"
        if loads:
            machine += f" (1-min load {min(loads):.2f}-{max(loads):.2f}, the run's own threads included)"
        body.append(
            [
                f"[{path.removeprefix('benchmarks/results/')}]({path})",
                first["processor"],
                ", ".join(first["instruction_sets"]) if "instruction_sets" in first else "not recorded",
                build,
                machine,
            ]
        )
    header = ["results file", "processor", "instruction sets", "C kernels use", "other processes while timed"]
    return _table(header, body)


def model_targets_table() -> str:
    """The long-context targets the committed adapter was built against, each judged from the JSON."""
    prefill = {row["seq_len"]: row["speedup"] for row in rows(LC_SPEED) if row["variant"] == AS_SAVED}
    passkey = pick(LC_PASSKEY, variant=AS_SAVED)
    kept = sum(case["correct"] for case in passkey["cases"]) / len(passkey["cases"])
    checks = [
        ("perplexity <= 1.02x of dense at 8K", value("lc.ppl_8k"), ppl_ratio(AS_SAVED) <= 1.02),
        (
            "<= 1.03x on unseen text (python-source, 8K)",
            value("lc.ppl_source_8k"),
            ppl_ratio(AS_SAVED, data="python-source") <= 1.03,
        ),
        ("passkey >= 95% (1K-8K)", value("lc.passkey"), kept >= 0.95),
        (
            "prefill never below 0.95x of dense from 512 tokens",
            f"lowest {times(min(prefill.values()))}",
            min(prefill.values()) >= 0.95,
        ),
        ("prefill >= 1.8x at 8K", value("lc.prefill_8k"), prefill[8192] >= 1.8),
        ("prefill >= 2.5x at 32K", value("lc.prefill_32k"), prefill[32768] >= 2.5),
    ]
    return _table(["target", "measured", ""], [[t, m, "met" if ok else "**not met**"] for t, m, ok in checks])


# Results files whose rows record no command: where their commands are written down instead.
UNRECORDED = {
    SINKS: "`python benchmarks/quality/sink_default.py --seq-len 2048 --blocks 2`",
    "benchmarks/long_context/adapter_audit.json": "`focus-hf audit --adapter benchmarks/long_context/adapter --json "
    "... --png ...` (the command's parameters are in the file)",
    "benchmarks/long_context/results/tradeoff.json": "`python benchmarks/long_context/run.py plot` (from ppl.json)",
}
REPORTS = {  # results folders whose generated report lists the commands of its JSON files
    "benchmarks/results/quality/": "benchmarks/results/quality/report.md",
    "benchmarks/results/quality-150-steps/": "benchmarks/results/quality-150-steps/report.md",
}


# Scripts that moved since a committed row recorded its command: the table shows where each is now.
MOVED_SCRIPTS = {
    "benchmarks/attention_parts.py": "benchmarks/cpu/prefill_parts.py",
    "benchmarks/arithmetic_ceiling.py": "benchmarks/cpu/arithmetic_ceiling.py",
    "benchmarks/bf16_exactness.py": "benchmarks/cpu/bf16_exactness.py",
    "benchmarks/capped.py": "benchmarks/cpu/capped.py",
    "benchmarks/model_prefill.py": "benchmarks/model/prefill.py",
    "benchmarks/model_decode_steps.py": "benchmarks/model/decode_steps.py",
    "benchmarks/model_decode.py": "benchmarks/model/generate.py",
    "benchmarks/decode_bookkeeping.py": "benchmarks/model/decode_bookkeeping.py",
    "benchmarks/demo_run.py": "benchmarks/model/demo_run.py",
    "benchmarks/model/demo_speed.py": "benchmarks/model/demo_speed.py",
    "benchmarks/vllm_serving.py": "benchmarks/model/vllm_serving.py",
    "benchmarks/serving_stress.py": "benchmarks/model/serving_stress.py",
    "benchmarks/gpu_attention.py": "benchmarks/gpu/layer_prefill.py",
    "benchmarks/gpu_model_prefill.py": "benchmarks/gpu/model_prefill.py",
}


def current_command(command: str) -> str:
    """A recorded command with the scripts that moved since named where they are now."""
    for old, new in MOVED_SCRIPTS.items():
        command = command.replace(old, new)
    return command


def recorded_commands(data: Any) -> list[str]:
    """The distinct commands the rows of a results file record (of every run, for a machine's file)."""
    if isinstance(data, dict) and isinstance(data.get("runs"), dict):
        return list(dict.fromkeys(c for run in data["runs"].values() for c in recorded_commands(run)))
    found = [data] if isinstance(data, dict) else data if isinstance(data, list) else []  # text: no command
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        found += data["rows"]
    return list(
        dict.fromkeys(current_command(row["command"]) for row in found if isinstance(row, dict) and row.get("command"))
    )


def commands_table() -> str:
    """Every committed results file, linked, with the commands its rows record."""
    paths = sorted(
        path.relative_to(ROOT).as_posix()
        for folder in ("benchmarks/results", "benchmarks/long_context")
        for path in (ROOT / folder).rglob("*.json")
        if "adapter/" not in path.relative_to(ROOT).as_posix()
    )
    body = []
    for path in paths:
        commands = recorded_commands(load(path))
        if commands:
            text = "<br>".join(f"`{command}`" for command in commands)
        elif path in UNRECORDED:
            text = UNRECORDED[path]
        else:
            reports = [report for folder, report in REPORTS.items() if path.startswith(folder)]
            text = f"see the commands of its [report]({reports[0]})" if reports else "no command recorded in the file"
        body.append([f"[{path.removeprefix('benchmarks/')}]({path})", text])
    return _table(["results file", "commands"], body)


def gpu_table(summary: str = GPU_SUMMARY) -> str:
    """Every figure of a committed GPU run with a target, and the prefill times of one layer, against dense."""
    body = []
    for row in load(summary)["figures"]:
        if (row["target"] is None and row["figure"].endswith("peak")) or row["stage"] == "profile":
            continue  # the profile has its own table (`gpu_profile_table`)
        ratio = "-" if row["ratio"] is None else times(row["ratio"])
        focus = row["focus"] if isinstance(row["focus"], str) else f"{row['focus']:.4g} {row['unit']}"
        dense = "-" if row["dense"] is None else f"{row['dense']:.4g} {row['unit']}"
        target = row["target"]
        wanted = "-" if target is None else target[0]
        if target is not None and not isinstance(target[1], bool):
            wanted = f"{target[0]} {target[1]:g}x"
        met = {None: "-", True: "yes", False: "**no**"}[row.get("meets_target")]
        body.append([row["stage"], row["figure"], dense, focus.replace("|", "/")[:100], ratio, wanted, met])
    return _table(["stage", "figure", "dense", "Focus", "dense / Focus", "target", "met"], body)


GPU_RUNS = (GPU_WINDOW, GPU_QUICK, GPU_AFTER, GPU_SUMMARY)  # the committed runs with prefill figures, newest first


def gpu_runs_table() -> str:
    """One layer's prefill in each committed GPU run (`benchmarks/gpu/run.sh`), newest first, against flash SDPA in
    the same run: the commit, and the ratios of top-1 and top-2 by length ("-": not run by that set)."""
    columns = [(top_k, tokens) for top_k in (1, 2) for tokens in ("64K", "256K", "1M")]
    body = []
    for summary in GPU_RUNS:
        data = load(summary)
        figures = {row["figure"]: row for row in data["figures"] if row["stage"] == "attention"}
        cells = []
        for top_k, tokens in columns:
            row = figures.get(f"top-{top_k} prefill {tokens}")
            cells.append("-" if row is None or row["ratio"] is None else times(row["ratio"]))
        body.append([f"[{data['git_commit'][:7]}]({summary})", data["date"][:10], *cells])
    header = ["commit", "date", *(f"top-{top_k} {tokens}" for top_k, tokens in columns)]
    return _table(header, body)


TABLES: dict[str, Callable[[], str]] = {
    "table.gpu": gpu_table,
    "table.gpu_runs": gpu_runs_table,
    "table.gpu_window": lambda: gpu_table(GPU_WINDOW),
    "table.commands": commands_table,
    "table.platforms": platforms_table,
    "table.model_targets": model_targets_table,
    "table.sinks": sinks_table,
    "table.quality": quality_table,
    "table.long_context": long_context_table,
    "table.auto": auto_table,
    "table.targets": targets_table,
    "table.processors": processors_table,
    "table.cpu_targets": cpu_targets_table,
    "table.cpu_targets_model": cpu_targets_model_table,
    "table.cpu_targets_steps": cpu_targets_steps_table,
    "table.cpu_targets_decode": cpu_targets_decode_table,
    "table.cpu_targets_avx512": lambda: cpu_targets_table(AVX512_MACHINE, AVX512_TARGETS + AVX512_EMULATED, "float32"),
    "table.cpu_targets_avx512_bf16": lambda: cpu_targets_table(AVX512_MACHINE, ("native",), "bfloat16"),
    "table.cpu_targets_avx512_decode": lambda: cpu_targets_decode_table(AVX512_MACHINE, AVX512_TARGETS),
    "table.avx512_bench": lambda: bench_table(
        (f"{AVX512_MACHINE}#attention_bench_native", f"{AVX512_MACHINE}#attention_bench_bf16_native")
    ),
    "table.cpu_targets_avx512_auto": lambda: cpu_targets_auto_table(AVX512_MACHINE, AVX512_TARGETS),
    "table.cpu_targets_avx512_model": lambda: cpu_targets_model_table(AVX512_MACHINE, AVX512_TARGETS),
    "table.cpu_targets_avx512_steps": lambda: cpu_targets_steps_table(AVX512_MACHINE, AVX512_TARGETS),
    "table.cpu_targets_avx512_demo": lambda: cpu_targets_demo_table(AVX512_MACHINE, AVX512_TARGETS),
    "table.cpu_targets_demo": cpu_targets_demo_table,
    "table.cpu_targets_xeon": lambda: cpu_targets_table(XEON_MACHINE, XEON_TARGETS, "float32"),
    "table.cpu_targets_xeon_bf16": lambda: cpu_targets_table(XEON_MACHINE, XEON_BF16_RUNS, "bfloat16"),
    "table.cpu_targets_xeon_auto": lambda: cpu_targets_auto_table(XEON_MACHINE, ("native",)),
    "table.cpu_targets_xeon_decode": lambda: cpu_targets_decode_table(XEON_MACHINE, AVX512_TARGETS),
    "table.cpu_targets_xeon_model": lambda: cpu_targets_model_table(XEON_MACHINE, XEON_MODEL_RUNS),
    "table.cpu_targets_xeon_steps": lambda: cpu_targets_steps_table(XEON_MACHINE, ("native", *AVX512_EMULATED)),
    "table.cpu_targets_xeon_demo": lambda: cpu_targets_demo_table(XEON_MACHINE, ("native", *AVX512_EMULATED)),
    "table.cpu_targets_zen5": lambda: cpu_targets_table(ZEN5_MACHINE, ZEN5_TARGETS, "float32"),
    "table.cpu_targets_zen5_bf16": lambda: cpu_targets_table(ZEN5_MACHINE, ("native",), "bfloat16"),
    "table.cpu_targets_zen5_auto": lambda: cpu_targets_auto_table(ZEN5_MACHINE, ZEN5_TARGETS),
    "table.cpu_targets_zen5_decode": lambda: cpu_targets_decode_table(ZEN5_MACHINE, ZEN5_TARGETS),
    "table.cpu_targets_zen5_model": lambda: cpu_targets_model_table(ZEN5_MACHINE, ZEN5_MODEL_RUNS),
    "table.cpu_targets_zen5_steps": lambda: cpu_targets_steps_table(ZEN5_MACHINE, ZEN5_MODEL_RUNS),
    "table.cpu_targets_zen5_short_model": lambda: cpu_targets_model_table(ZEN5_MACHINE, ZEN5_SHORT_RUNS),
    "table.cpu_targets_zen5_short_steps": lambda: cpu_targets_steps_table(ZEN5_MACHINE, ZEN5_SHORT_RUNS),
    "table.cpu_targets_zen5_bookkeeping": lambda: decode_bookkeeping_table(ZEN5_BOOKKEEPING),
    "table.cpu_targets_zen5_demo": lambda: cpu_targets_demo_table(ZEN5_MACHINE, ZEN5_TARGETS),
    "table.cpu_targets_auto": cpu_targets_auto_table,
    "table.parts": parts_table,
}


# The results files whose recorded command a page shows beside its figures (`command.NAME`).
COMMAND_FILES = {
    "attention": ATTENTION,
    "query_router": ATTENTION_QUERY_ROUTER,
    "auto": ATTENTION_AUTO[8],
    "decode": ATTENTION_DECODE,
    "bf16": ATTENTION_BF16,
    "bf16_exactness": BF16_EXACTNESS,
    "memory": ATTENTION_MEMORY,
    "parts": ATTENTION_PARTS,
    "ceiling": CEILING,
    "crossover": CROSSOVER,
    "model_prefill": MODEL_PREFILL,
    "model_decode": MODEL_DECODE,
    "model_steps": MODEL_STEPS,
    "lc_speed": LC_SPEED,
}


def command(name: str) -> str:
    """The first command the file `COMMAND_FILES[name]` records, as inline code, with moved scripts where they are."""
    return f"`{recorded_commands(load(COMMAND_FILES[name]))[0]}`"


def value(name: str) -> str:
    """The text that replaces `{{ name }}`: a figure or a table, from the committed JSON."""
    if name.startswith("command.") and name.removeprefix("command.") in COMMAND_FILES:
        return command(name.removeprefix("command."))
    source = FIGURES.get(name) or TABLES.get(name)
    if source is None:
        raise KeyError(f"no figure or table named {name!r} in {Path(__file__).name}")
    return source()


def names() -> list[str]:
    return [*FIGURES, *TABLES, *(f"command.{name}" for name in COMMAND_FILES)]
