"""The GPU script (benchmarks/gpu/run.sh) runs end to end on the CPU at small sizes, so that it cannot rot where no
GPU is at hand; and its summary holds figures against the GPU targets correctly."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# benchmarks/gpu/run.py, by path: a plain `import run` could return another folder's run.py.
_spec = importlib.util.spec_from_file_location("gpu_run", ROOT / "benchmarks" / "gpu" / "run.py")
gpu_run = sys.modules["gpu_run"] = importlib.util.module_from_spec(_spec)  # registered first: it holds a dataclass
_spec.loader.exec_module(gpu_run)

STAGE_FILES = ["tests.json", "attention.json", "pieces.json", "auto.json", "decode.json", "peak_memory.json"]
STAGE_FILES += ["model_prefill.json", "train.json", "profile.json"]
PROVENANCE = ("device", "git_commit", "command", "date")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One run of the whole script with --device cpu: (exit code, output, result folder)."""
    out = tmp_path_factory.mktemp("gpu-check")
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    finished = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh"), "--device", "cpu", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    return finished.returncode, finished.stdout + finished.stderr, out


def read(folder: Path, name: str):
    return json.loads((folder / name).read_text())


def test_cpu_run_writes_every_stage_and_the_summary(cpu_run):
    returncode, output, out = cpu_run
    assert returncode == 0, output[-4000:]
    assert sorted(path.name for path in out.iterdir()) == sorted([*STAGE_FILES, "summary.json"])
    summary = read(out, "summary.json")
    assert summary["mode"] == "cpu" and summary["device"].startswith("cpu")
    full = [stage.name for stage in gpu_run.selected_stages(None, [], quick=False, device="cpu")]
    assert full == gpu_run.STAGE_NAMES  # on the CPU, every stage
    assert {name: stage["status"] for name, stage in summary["stages"].items()} == dict.fromkeys(full, "ok")
    assert all(summary["stages"][name]["has_results"] for name in full)
    assert {row["stage"] for row in summary["figures"]} == set(full)
    assert all(row["meets_target"] is None for row in summary["figures"])  # the targets are CUDA ones
    assert summary["gpu_path"]["focus_figures"].startswith("every Focus figure ran the GPU path")
    assert "figures (ratio" in output and "top-1 prefill 512" in output  # the printed table


def test_every_json_records_device_versions_commit_command_and_date(cpu_run):
    _, _, out = cpu_run
    for name in [*STAGE_FILES, "summary.json"]:
        data = read(out, name)
        records = data if isinstance(data, list) else [data]
        assert records, name
        for record in records:
            assert all(record.get(field) for field in ("device", "command", "date")), (name, record)
            assert "git_commit" in record and record["device"].startswith("cpu"), name
            versions = record.get("versions", record)  # benchmark files nest them, `focus-hf bench` rows do not
            assert all(versions.get(package) for package in ("torch", "transformers", "peft")), (name, record)


def test_stage_files_hold_the_measurements(cpu_run):
    _, _, out = cpu_run
    tests = read(out, "tests.json")
    assert tests["finished"] and tests["tests"]
    if not torch.cuda.is_available():  # the CUDA tests skip cleanly here, and say why
        assert {test["outcome"] for test in tests["tests"]} == {"skipped"}
        assert all(test["message"] for test in tests["tests"])

    attention = read(out, "attention.json")
    assert [(row["tokens"], row["top_k"]) for row in attention["rows"]] == [(512, 1), (512, 2), (1024, 1), (1024, 2)]
    for row in attention["rows"]:
        assert row["speedup"] == pytest.approx(row["dense_s"] / row["focus_s"])
        assert row["dense_peak_bytes"] is None  # no GPU memory to measure on the CPU, and none is made up

    pieces = read(out, "pieces.json")
    assert pieces["focus_backend"] == "gpu-path" and pieces["one_piece_rows_settings"] == ["default", "0"]
    # Every top-k once per setting, each saying its setting and whether it ran in pieces (1K: one piece by default).
    assert [(row["top_k"], row["one_piece_rows"], row["in_pieces"]) for row in pieces["rows"]] == [
        (1, "default", False),
        (1, "0", True),
        (2, "default", False),
        (2, "0", True),
    ]
    for row in pieces["rows"]:
        assert row["tokens"] == 1024 and row["speedup"] == pytest.approx(row["dense_s"] / row["focus_s"])
        assert row["gpu_path"]["paths"] == {"gpu-sparse": 8} and not row["gpu_path"]["fallback_calls"]
    assert len({row["dense_s"] for row in pieces["rows"]}) == 1  # against the same dense calls

    auto = read(out, "auto.json")
    assert [(row["seq_len"], row["top_k"], row["backend"]) for row in auto] == [
        (1024, 1, "auto"),
        (1024, 2, "auto"),
        (2048, 1, "auto"),
        (2048, 2, "auto"),
    ]
    decode = read(out, "decode.json")
    assert [(row["cache_len"], row["top_k"]) for row in decode] == [(1024, 1), (1024, 2), (2048, 1), (2048, 2)]
    assert all(row["mode"] == "decode" and row["dense_s"] > 0 and row["focus_s"] > 0 for row in decode)

    memory = read(out, "peak_memory.json")
    assert [(row["variant"], row["top_k"]) for row in memory] == [("dense SDPA", None), ("Focus", 1)]
    assert all(row["peak_rss_mib"] > 0 for row in memory)

    model = read(out, "model_prefill.json")
    assert model["weights"].startswith("random") and model["architecture"]["hidden_size"] == 576
    assert model["focus"]["window"] == 512 and model["focus"]["num_groups"] == 8  # the committed adapter's settings
    assert [row["tokens"] for row in model["rows"]] == [1024] and model["rows"][0]["speedup"] > 0
    assert 1 / 8 <= model["group_balance"]["largest_group_share_max"] < 1

    train = read(out, "train.json")
    assert train["returncode"] == 0 and train["trained_on"] == "cpu" and train["router_dtypes"] == ["F32"]
    assert train["train_command"].startswith("focus-hf train --objective distill")


def test_the_sets_fit_what_the_device_tool_brings_back():
    # The device tool brings back 8 files: each set's stage files and summary.json. Together the two sets run every
    # stage, the CUDA tests first.
    full = [stage.name for stage in gpu_run.selected_stages(None, [], quick=False)]
    quick = [stage.name for stage in gpu_run.selected_stages(None, [], quick=True)]
    assert len(full) + 1 <= 8 and len(quick) + 1 <= 8
    assert quick == ["tests", "attention", "decode", "model_prefill"]
    assert full == ["decode", "auto", "peak_memory", "profile", "train", "pieces"]
    assert set(quick) | set(full) == set(gpu_run.STAGE_NAMES)
    assert [stage.name for stage in gpu_run.selected_stages(["train", "profile"], [], quick=False)] == [
        "profile",
        "train",
    ]
    # Within 15 minutes of GPU time in all, of which about a minute to start the machine and copy the files to it.
    for name, kind in (("quick", True), ("full", False)):
        stages = gpu_run.selected_stages(None, [], quick=kind)
        limits = [gpu_run.QUICK_LIMITS[stage.name] if kind else stage.timeout["cuda"] for stage in stages]
        assert sum(limits) <= gpu_run.DEADLINES[name], (name, limits)
    assert gpu_run.DEADLINES["quick"] + gpu_run.DEADLINES["full"] + 60 <= 15 * 60


def test_the_cuda_tests_collect_with_exactness_first():
    # The tests stage's pytest, collecting only: every test marked `cuda` still collects here, in the order the stage
    # runs them - the GPU path's exactness and fallbacks first, torch.compile last.
    command = gpu_run.tests_command("cpu", Path("unused.json"))
    collected = subprocess.run(
        [*command[: command.index("-p")], "--collect-only", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    tests = [line for line in collected.stdout.splitlines() if "::" in line]
    every = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert sorted(tests) == sorted(line for line in every.stdout.splitlines() if "::" in line)
    assert tests[0].startswith(gpu_run.FIRST_TEST_FILE)
    names = [test.split("::")[1].split("[")[0] for test in tests if test.startswith(gpu_run.FIRST_TEST_FILE)]
    assert names[0] == "test_every_check_passes_on_this_device"
    exactness = max(
        names.index(name) for name in ("test_backends_equal_the_reference", "test_the_reported_case_is_exact")
    )
    assert exactness < names.index("test_flex_double_answers_as_the_compiled_kernel")
    assert names[-2:] == [
        "test_compiled_model_equals_the_eager_model",
        "test_lengths_and_batches_compile_a_bounded_number_of_times",
    ]


def test_the_profile_attributes_the_time_to_the_gpu_path(cpu_run):
    _, _, out = cpu_run
    profile = read(out, "profile.json")
    assert profile["git_commit"] and profile["layer"]["backend"] == "gpu-path"
    (row,) = profile["rows"]
    assert row["tokens"] == 1024 and row["wall_s"] > 0 and "error" not in row
    # The time is found in the GPU path's own functions (the CPU stand-ins' kernels here), not left unattributed.
    assert any("focus_hf/attention/gpu/" in line["where"] for line in row["by_focus_line"][:3])
    assert row["top_cpu_ops"]
    figures = read(out, "summary.json")["figures"]
    assert any(entry["stage"] == "profile" and "where the time goes" in entry["figure"] for entry in figures)


def test_quick_decode_on_the_cpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    command = [
        "bash",
        str(ROOT / "benchmarks" / "gpu" / "run.sh"),
        "--device",
        "cpu",
        "--quick",
        "--out",
        str(tmp_path),
    ]
    finished = subprocess.run(
        [*command, "--only", "decode"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert finished.returncode == 0, (finished.stdout + finished.stderr)[-4000:]
    assert [row["cache_len"] for row in read(tmp_path, "decode.json")] == [2048, 2048]  # the quick set's cache


def write_json(folder: Path, name: str, data) -> None:
    (folder / name).write_text(json.dumps(data))


def fallback_record(calls: int) -> dict:
    return {
        "verdicts": {"cuda: FlexAttention, cuda:0, bfloat16, 4x64": "exact"},
        "fallback_calls": {"recompile limit": calls},
        "flex_compilations": {"partial": 8, "full": 2, "decode": 1, "output": 0},
    }


def test_summary_gathers_verdicts_fallbacks_and_compilations(tmp_path):
    write_json(tmp_path, "decode.json", [{"cache_len": 1024, "top_k": 1, "gpu_path": fallback_record(2)}])
    write_json(tmp_path, "attention.json", {"rows": [{"tokens": 4096, "top_k": 1, "gpu_path": fallback_record(0)}]})
    summary = gpu_run.gpu_path_summary(tmp_path)
    assert summary["fallback_calls"] == {"attention": 0, "decode": 2}
    assert summary["verdicts"] == {"cuda: FlexAttention, cuda:0, bfloat16, 4x64": "exact"}
    assert summary["flex_compilations"]["decode"]["partial"] == 8
    assert "2 Focus calls fell back" in summary["focus_figures"]
    write_json(tmp_path, "decode.json", [])
    assert gpu_run.gpu_path_summary(tmp_path)["focus_figures"].startswith("every Focus figure ran the GPU path")


def test_summary_holds_figures_against_the_targets(tmp_path):
    write_json(tmp_path, "tests.json", {"finished": True, "counts": {"passed": 12, "skipped": 1}})
    attention = [
        {"tokens": 65536, "top_k": 1, "dense_s": 1.0, "focus_s": 0.5, "speedup": 2.0},  # target 2.5x: missed
        {"tokens": 1048576, "top_k": 1, "dense_s": 11.0, "focus_s": 1.6, "speedup": 11 / 1.6},  # target 6.5x: met
        {"tokens": 1048576, "top_k": 2, "error": "OutOfMemoryError: ..."},
    ]
    attention[1].update(dense_peak_bytes=100 * 2**20, focus_peak_bytes=105 * 2**20, peak_ratio=1.05)
    write_json(tmp_path, "attention.json", {"rows": attention})
    pieces = [
        {"tokens": 65536, "top_k": 1, "one_piece_rows": "default", "in_pieces": True, "dense_s": 1.0, "focus_s": 0.5},
        {"tokens": 65536, "top_k": 1, "one_piece_rows": "1048576", "in_pieces": False, "dense_s": 1.0, "focus_s": 0.3},
        {"tokens": 65536, "top_k": 2, "one_piece_rows": "1048576", "in_pieces": False, "error": "OutOfMemoryError"},
    ]
    for row in pieces[:2]:
        row.update(speedup=row["dense_s"] / row["focus_s"], dense_peak_bytes=100 * 2**20, peak_ratio=None)
    pieces[0].update(focus_peak_bytes=107 * 2**20, peak_ratio=1.07)
    write_json(tmp_path, "pieces.json", {"rows": pieces})
    decode = [
        {"cache_len": 262144, "top_k": 1, "dense_s": 2e-4, "focus_s": 1e-4},
        # Fast, but its Focus calls fell back to the reference path: not a Focus figure.
        {"cache_len": 1048576, "top_k": 1, "dense_s": 7e-4, "focus_s": 1e-4, "gpu_path": fallback_record(3)},
        {"cache_len": 1048576, "error": "OutOfMemoryError: CUDA out of memory"},  # a length that failed as a whole
    ]
    write_json(tmp_path, "decode.json", decode)
    write_json(tmp_path, "auto.json", [{"seq_len": 1024, "top_k": 1, "dense_s": 1.0, "focus_s": 1.1}])
    memory = [
        {"seq_len": 1048576, "top_k": None, "variant": "dense SDPA", "peak_allocated_mib": 100.0},
        {"seq_len": 1048576, "top_k": 1, "variant": "Focus", "peak_allocated_mib": 115.0},
    ]
    write_json(tmp_path, "peak_memory.json", memory)
    rows = {(row["stage"], row["figure"]): row for row in gpu_run.figures(tmp_path, cuda=True)}

    assert rows["tests", "pytest -m cuda"]["meets_target"] is True
    assert rows["attention", "top-1 prefill 64K"]["meets_target"] is False
    assert rows["attention", "top-1 prefill 1M"]["meets_target"] is True
    assert rows["attention", "top-1 prefill 1M peak"]["ratio"] == pytest.approx(1.05)
    assert rows["attention", "top-2 prefill 1M"]["ratio"] is None  # an error is shown, not a figure
    # The pieces stage: both settings held to the 64K target, each row naming its setting.
    assert rows["pieces", "top-1 prefill 64K in pieces"]["meets_target"] is False  # 2x < 2.5x
    assert rows["pieces", "top-1 prefill 64K one piece"]["ratio"] == pytest.approx(1 / 0.3)
    assert rows["pieces", "top-1 prefill 64K one piece"]["meets_target"] is True
    assert rows["pieces", "top-1 prefill 64K one piece"]["one_piece_rows"] == "1048576"
    assert rows["pieces", "top-1 prefill 64K in pieces peak"]["ratio"] == pytest.approx(1.07)
    assert rows["pieces", "top-1 prefill 64K in pieces peak"]["meets_target"] is True  # <= 1.1x
    assert rows["pieces", "top-1 prefill 64K in pieces peak"]["one_piece_rows"] == "default"
    assert ("pieces", "top-1 prefill 64K one piece peak") not in rows  # no peak measured: none shown
    assert rows["pieces", "top-2 prefill 64K one piece"]["focus"].startswith("OutOfMemoryError")
    assert rows["decode", "top-1 cache 256K"]["ratio"] == pytest.approx(2.0)
    assert rows["decode", "top-1 cache 256K"]["unit"] == "ms" and rows["decode", "top-1 cache 256K"]["meets_target"]
    assert rows["decode", "top-1 cache 1M"]["ratio"] == pytest.approx(7.0)  # above its 4x target, but:
    assert rows["decode", "top-1 cache 1M"]["fallback_calls"] == 3
    assert rows["decode", "top-1 cache 1M"]["meets_target"] is False
    assert rows["decode", "every top-k cache 1M"]["focus"].startswith("OutOfMemoryError")
    assert rows["auto", "top-1 1K"]["meets_target"] is False  # 0.91x < 0.95x
    assert rows["peak_memory", "top-1 peak 1M"]["ratio"] == pytest.approx(1.15)
    assert rows["peak_memory", "top-1 peak 1M"]["meets_target"] is False
    # Off CUDA no target is judged: they are GPU targets.
    assert all(row["meets_target"] is None for row in gpu_run.figures(tmp_path, cuda=False))


def test_a_profile_name_torch_recorded_as_invalid_utf8_loses_only_that_name():
    # One CPU run lost its whole profile row to a UnicodeDecodeError from a name torch's profiler handed back.
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    import profile_layer

    class Unreadable:
        stack, cpu_parent = None, None

        @property
        def name(self):
            raise UnicodeDecodeError("utf-8", b"\x85", 0, 1, "invalid start byte")

    class Labelled:
        stack, name = None, "op"
        cpu_parent = type("Range", (), {"stack": None, "name": "focus_hf/attention/gpu/bands.py: band_attention",
                                        "cpu_parent": Unreadable()})()  # fmt: skip

    assert profile_layer.focus_frame(Unreadable()) == "(outside focus_hf)"
    assert profile_layer.focus_frame(Labelled()) == "focus_hf/attention/gpu/bands.py: band_attention"


def test_a_profile_that_raises_invalid_utf8_is_taken_again_at_last_without_stacks(monkeypatch):
    # Two CI runs lost the profile row to a UnicodeDecodeError raised where no name is read one by one (torch turning
    # its results into events): the profile is taken again, the third time without Python stacks.
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    import profile_layer

    import focus_hf.attention.hard as hard

    # A function without a module (made by exec, as one in CI's process was) is left unlabelled, not a failure.
    homeless = types.FunctionType((lambda: None).__code__, {})
    homeless.__module__ = None
    monkeypatch.setattr(hard, "homeless_function", homeless, raising=False)

    def failing_profiles(failures: int):
        taken: list[bool] = []

        class Profile:
            def __init__(self, activities, with_stack):
                taken.append(with_stack)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def events(self):
                if len(taken) <= failures:
                    raise UnicodeDecodeError("utf-8", b"\xba", 0, 1, "invalid start byte")
                return []

            def key_averages(self):
                return []

        return Profile, taken

    profile, taken = failing_profiles(1)
    summary = profile_layer.profiled(lambda: 0.25, [], 5, profile=profile)
    assert taken == [True, True] and summary["profile_tries"] == 2 and summary["with_stack"] is True
    assert summary["profiled_wall_s"] == 0.25 and summary["device_ms_total"] == 0 and summary["by_focus_line"] == []
    profile, taken = failing_profiles(2)
    assert profile_layer.profiled(lambda: 0.25, [], 5, profile=profile)["with_stack"] is False
    profile, taken = failing_profiles(3)
    with pytest.raises(UnicodeDecodeError):
        profile_layer.profiled(lambda: 0.25, [], 5, profile=profile)
    assert taken == [True, True, False]
