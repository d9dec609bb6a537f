"""What `focus-hf bench` and the benchmark scripts record (`focus_hf.benchmarking`), on the CPU and (marked `cuda`) on a
GPU: provenance in every row, rows written as they come, a failing length reported without losing the others, and the
GPU's timing and memory measurements."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from focus_hf.attention.cpu import build, native
from focus_hf.attention.gpu.paged_keys import FILE_EVERY
from focus_hf.benchmarking import records, timing
from focus_hf.cli import main as cli_main
from focus_hf.commands import bench

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SMALL = ["--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--window", "16"]


def test_the_commit_given_by_the_runner_wins_over_a_copied_git_folder(monkeypatch):
    # A copy of the working tree may carry an older .git than the tree it holds: the variable names the tree's commit.
    records.git_commit.cache_clear()
    monkeypatch.setenv("FOCUS_HF_GIT_COMMIT", "0123abc")
    try:
        assert records.git_commit() == "0123abc"
        monkeypatch.delenv("FOCUS_HF_GIT_COMMIT")
        records.git_commit.cache_clear()
        found = records.git_commit()
        assert found is None or len(found.removesuffix("-dirty")) == 40  # this checkout's own, where it has a .git
    finally:
        records.git_commit.cache_clear()


def test_rows_record_versions_commit_date_and_dense_kernel(tmp_path):
    path = tmp_path / "rows.json"
    argv = ["bench", "--device", "cpu", "--seq-lens", "200", "--top-k", "1", "--repeats", "1", "--backend", "sdpa"]
    assert cli_main(argv + SMALL + ["--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())
    for field in ("torch", "transformers", "peft", "focus_hf", "date"):
        assert row[field], field
    assert "git_commit" in row and row["device"].startswith("cpu")
    assert row["dense_kernel"] == "sdpa (torch's choice)"
    assert row["command"] is None  # called in-process: no command line of its own to record
    # What other processes took of the machine while the length was timed (the load average counts the run's own).
    assert row["other_cores_busy"] is None or row["other_cores_busy"] >= 0
    # The processor, its instruction sets and how the C kernels were built (what the figures depend on).
    assert row["processor"] and isinstance(row["instruction_sets"], list)
    assert set(row["instruction_sets"]) <= set(build.INSTRUCTION_SETS)
    kernels = row["cpu_kernels"]
    if native.native_kernels() is None:
        assert kernels["built"] is False
    else:
        assert kernels["built"] and kernels["compiler"] and "-O3" in kernels["flags"]
        assert set(kernels["uses"]) <= set(native.BUILD_FEATURES.values())
        # no instructions the processor lacks (a -march=native build uses what the compiler knows of them)
        assert "avx512 vectors" not in kernels["uses"] or "avx512f" in row["instruction_sets"]
        assert "avx512_bf16 dot products" not in kernels["uses"] or "avx512_bf16" in row["instruction_sets"]
        assert "amx_bf16 tiles" not in kernels["uses"] or "amx_bf16" in row["instruction_sets"]
    # torch's own kernels, which dense SDPA runs: their dispatch level and the variables that limit it
    assert row["torch_kernels"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(row["torch_kernels"]["limits"]) <= set(build.TORCH_ISA_LIMITS)


def test_the_limits_set_on_torchs_kernels_are_recorded(monkeypatch):
    for name in build.TORCH_ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    assert build.torch_kernels()["limits"] == {}
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert build.torch_kernels() == {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "limits": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    }


def test_a_failing_length_is_reported_and_the_others_measured(tmp_path, monkeypatch, capsys):
    measure = bench.bench_length

    def failing_at_300(args, seq_len, device, dtype):
        if seq_len == 300:
            raise RuntimeError("no kernel found to launch")
        return measure(args, seq_len, device, dtype)

    monkeypatch.setattr(bench, "bench_length", failing_at_300)
    path = tmp_path / "rows.json"
    argv = ["bench", "--device", "cpu", "--seq-lens", "200", "300", "400", "--repeats", "1", "--backend", "sdpa"]
    assert cli_main(argv + SMALL + ["--json", str(path)]) == 1
    rows = json.loads(path.read_text())
    assert [row["seq_len"] for row in rows] == [200, 300, 400]
    assert rows[1]["error"] == "RuntimeError: no kernel found to launch" and rows[1]["device"].startswith("cpu")
    assert "speedup" in rows[0] and "speedup" in rows[2]
    assert "no kernel found to launch" in capsys.readouterr().err  # the traceback


def test_row_log_writes_after_every_row(tmp_path):
    log = records.RowLog(str(tmp_path / "sub" / "rows.json"))
    log.add({"seq_len": 1})
    assert json.loads((tmp_path / "sub" / "rows.json").read_text()) == [{"seq_len": 1, "command": None}]
    log.add({"seq_len": 2})
    assert [row["seq_len"] for row in json.loads((tmp_path / "sub" / "rows.json").read_text())] == [1, 2]


def test_time_call_returns_the_mean_of_its_steps():
    calls = []
    wall, cpu = timing.time_call(lambda: calls.append(1), steps=5)
    assert len(calls) == 5 and wall >= 0 and cpu >= 0


# --- CUDA only (benchmarks/gpu/run.sh runs these on a CUDA machine) ---

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_SHAPE = ["--device", "cuda", "--dtype", "bfloat16", "--heads", "8", "--kv-heads", "2", "--head-dim", "64"]


@pytest.mark.cuda
@needs_cuda
def test_cuda_bench_rows_name_the_gpu_and_the_dense_kernel(tmp_path):
    path = tmp_path / "rows.json"
    argv = ["bench", *GPU_SHAPE, "--seq-lens", "4096", "--top-k", "1", "2", "--window", "64", "--repeats", "2"]
    assert cli_main(argv + ["--backend", "sdpa", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [row["top_k"] for row in rows] == [1, 2]
    for row in rows:
        assert row["device"] == torch.cuda.get_device_name()
        assert row["dense_kernel"] == "flash (torch SDPA)" or row["dense_kernel"].startswith("sdpa (torch's choice;")
        assert row["speedup"] == pytest.approx(row["dense_s"] / row["focus_s"])


@pytest.mark.cuda
@needs_cuda
def test_cuda_decode_times_steps_in_bursts(tmp_path):
    path = tmp_path / "decode.json"
    argv = ["bench", "--decode", *GPU_SHAPE, "--seq-lens", "4096", "--top-k", "1", "--window", "64"]
    assert cli_main(argv + ["--decode-repeats", "3", "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())
    # A timing covers one filing period of the paged copy: its steps and the one step that files.
    assert row["steps_per_timing"] == FILE_EVERY and row["dense_s"] > 0 and row["focus_s"] > 0


@pytest.mark.cuda
@needs_cuda
def test_cuda_peak_memory_is_the_allocators_peak(tmp_path):
    path = tmp_path / "memory.json"
    argv = ["bench", "--peak-memory", *GPU_SHAPE, "--seq-lens", "8192", "--top-k", "1", "--window", "64"]
    assert cli_main(argv + ["--backend", "sdpa", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [(row["variant"], row["top_k"]) for row in rows] == [("dense SDPA", None), ("Focus", 1)]
    inputs_mib = 8192 * (8 + 2 + 2) * 64 * 2 / 2**20  # q, k, v in bf16
    for row in rows:
        assert "error" not in row, row
        assert row["allocated_before_call_mib"] >= inputs_mib
        assert row["peak_allocated_mib"] >= row["allocated_before_call_mib"] + 8192 * 8 * 64 * 2 / 2**20  # + output


def test_capped_runs_name_every_cap_of_their_level_and_rows_record_them():
    script = BENCHMARKS / "cpu" / "capped.py"
    spec = importlib.util.spec_from_file_location("capped", script)
    capped = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(capped)
    v2_amd, v2_intel = capped.caps_for("x86-64-v2", "AuthenticAMD"), capped.caps_for("x86-64-v2", "GenuineIntel")
    # MKL ignores MKL_ENABLE_INSTRUCTIONS on AMD processors and runs AVX2 + FMA sgemm kernels: only MKL_CBWR holds it
    assert v2_amd["MKL_CBWR"] == "COMPATIBLE" and "MKL_CBWR" not in v2_intel
    assert v2_intel["FOCUS_HF_CPU_TARGET"] == "x86-64-v2" and v2_intel["ATEN_CPU_CAPABILITY"] == "default"
    assert "-FMA" in v2_intel["GLIBC_TUNABLES"]  # libm's expf otherwise resolves to its FMA variant
    assert capped.caps_for("native", "AuthenticAMD") == {"FOCUS_HF_CPU_TARGET": "native"}
    # every variable it sets is one the rows record
    assert set(v2_amd) - {"FOCUS_HF_CPU_TARGET"} <= set(build.TORCH_ISA_LIMITS)
    assert set(capped.caps_for("x86-64-v3", "GenuineIntel")) - {"FOCUS_HF_CPU_TARGET"} <= set(build.TORCH_ISA_LIMITS)
    probe = "import json, torch; from focus_hf.attention.cpu import build; print(json.dumps(build.torch_kernels()))"
    ran = subprocess.run(
        [sys.executable, str(script), "x86-64-v2", "--", sys.executable, "-c", probe],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    record = json.loads(ran.stdout)
    assert record["capability"] == "DEFAULT"
    expected = capped.caps_for("x86-64-v2", capped.processor_vendor())
    expected.pop("FOCUS_HF_CPU_TARGET")
    assert record["limits"] == expected


def test_benchmark_scripts_import_the_library_without_path_tricks():
    # The scripts import focus_hf.benchmarking as installed; none edits sys.path to reach a neighbour.
    scripts = sorted(BENCHMARKS.rglob("*.py"))
    assert scripts
    assert [path.relative_to(BENCHMARKS) for path in scripts if "sys.path" in path.read_text(encoding="utf-8")] == []
    script = BENCHMARKS / "model" / "prefill.py"
    assert records.repository_of(str(script)) == BENCHMARKS.parent
    command = records.script_command(str(script), ["--seq-lens", "1024"])
    assert command == "python benchmarks/model/prefill.py --seq-lens 1024"


def test_a_machines_file_gathers_its_runs_by_name(tmp_path):
    script = BENCHMARKS / "machine_results.py"
    spec = importlib.util.spec_from_file_location("machine_results", script)
    machine_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(machine_results)
    rows, printed = tmp_path / "rows.json", tmp_path / "printed.txt"
    rows.write_text(json.dumps([{"seq_len": 1024, "speedup": 2.0}]))
    printed.write_text("Speed: ...\n")
    machine = tmp_path / "machines" / "box.json"
    with pytest.raises(SystemExit, match="--machine"):
        machine_results.add_runs(machine, {"attention_parts_native": rows})
    machine_results.add_runs(machine, {"attention_parts_native": rows, "demo/printed.txt": printed}, "a test box")
    rows.write_text(json.dumps([{"seq_len": 4096, "speedup": 3.0}]))
    data = machine_results.add_runs(machine, {"attention_parts_native": rows})  # a run of the same name is replaced
    assert data == json.loads(machine.read_text())
    assert data["machine"] == "a test box" and data["runs"]["demo/printed.txt"] == "Speed: ...\n"
    assert data["runs"]["attention_parts_native"] == [{"seq_len": 4096, "speedup": 3.0}]
