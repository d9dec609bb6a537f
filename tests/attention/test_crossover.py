"""The measured dense/sparse crossover of backend "auto" (`focus_hf.attention.crossover`): search, cache, env
overrides. No assertion depends on a timing: measurements are faked, except one run of the real timer on tiny
lengths that checks only that it returns a length it measured, and one reading of the machine's load while a child
process spins."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import focus_hf.attention.cpu.build as build
import focus_hf.attention.cpu.native as native
import focus_hf.attention.crossover as crossover
import focus_hf.attention.crossover_measurement as measurement
import focus_hf.attention.hard as hard
from focus_hf.attention.paths import measured_paths
from focus_hf.attention.pattern import FocusPattern, allowed_pairs
from focus_hf.attention.reference import dense_attention
from focus_hf.cli import main as cli_main


def fake_timer(sparse_wins_from, wins_at=()):
    """time_at(n) for find_crossover: sparse faster from `sparse_wins_from` keys on, and also at `wins_at`."""
    measured = []

    def time_at(length):
        measured.append(length)
        sparse_wins = length >= sparse_wins_from or length in wins_at
        return 1.0, 0.5 if sparse_wins else 2.0

    return time_at, measured


def test_crossover_is_the_first_of_two_sparse_wins_and_stops_there():
    time_at, measured = fake_timer(1024)
    found, rows = measurement.find_crossover(time_at)
    assert found == 1024
    assert measured == [256, 512, 1024, 2048]
    assert [row["length"] for row in rows] == measured


def test_a_single_sparse_win_is_not_a_crossover():
    time_at, measured = fake_timer(4096, wins_at=(512,))
    found, _ = measurement.find_crossover(time_at)
    assert found == 4096 and measured[-1] == 8192


def test_a_win_within_the_margin_is_not_a_win():
    def barely_faster(length):  # sparse ahead by less than WIN_MARGIN below 4,096 keys, by more from there
        return 1.0, (0.5 if length >= 4096 else 0.99 / measurement.WIN_MARGIN + 0.01)

    found, rows = measurement.find_crossover(barely_faster)
    assert all(row["sparse_s"] < row["dense_s"] for row in rows)
    assert found == 4096


def test_sparse_never_winning_keeps_dense_up_to_the_longest_length():
    time_at, measured = fake_timer(10**9)
    found, _ = measurement.find_crossover(time_at)
    assert measured == list(measurement.LENGTHS)
    assert found == measurement.MAX_LENGTH


def test_budget_stops_the_search_and_keeps_dense_where_it_won():
    time_at, measured = fake_timer(10**9)
    ticks = iter(range(100))
    found, _ = measurement.find_crossover(time_at, budget_s=1.5, clock=lambda: float(next(ticks)))
    assert measured == [256, 512]  # elapsed 1 s after the first length, 2 s after the second
    assert found == 1024


@pytest.fixture
def calibrating(monkeypatch, tmp_path):
    """Calibration enabled, an empty cache under tmp_path, and a fake `measure` that records its calls."""
    monkeypatch.delenv(crossover.NO_CALIBRATION_ENV, raising=False)
    monkeypatch.delenv(crossover.CROSSOVER_ENV, raising=False)
    monkeypatch.setenv("FOCUS_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(crossover, "_known", {})
    calls = []

    def fake_measure(shape, device, call, lengths=None, clock=None):
        calls.append(shape)
        found = 512 * shape.top_k + (1 if shape.kind == "decode" else 0)
        return found, [{"length": found, "dense_s": 1.0, "sparse_s": 0.5}]

    monkeypatch.setattr(crossover, "measure", fake_measure)
    monkeypatch.setattr(crossover, "other_cores_meter", lambda: lambda: 0.0)  # an idle machine, no waiting
    return calls


def dense_below(*args):
    """`crossover.dense_below` as `hard.hard_attention` asks it (measuring through itself)."""
    return crossover.dense_below(*args, hard.hard_attention)


def tensors(heads=9, kv_heads=3, length=8):
    return torch.zeros(1, heads, length, 16), torch.zeros(1, kv_heads, length, 16)


def test_calibration_runs_once_per_shape_and_is_reused(calibrating, tmp_path):
    query, key = tensors()
    assert dense_below(query, key, 1, 8, 128, "shared") == 512
    assert dense_below(query, key, 1, 8, 128, "shared") == 512
    assert len(calibrating) == 1
    entries = json.loads((tmp_path / crossover.CACHE_FILE).read_text())["entries"]
    (entry,) = entries.values()
    assert entry["dense_below"] == 512 and entry["shape"]["kind"] == "shared" and entry["shape"]["heads"] == 9

    # A new process (nothing known in memory) reads the file instead of measuring.
    crossover._known.clear()
    assert dense_below(query, key, 1, 8, 128, "shared") == 512
    assert len(calibrating) == 1

    # Any other shape or path is measured on its own, and both stay in the file.
    assert dense_below(query, key, 2, 8, 128, "shared") == 1024
    assert dense_below(query, key, 1, 8, 128, "decode") == 513
    assert dense_below(*tensors(heads=6, kv_heads=2), 1, 8, 128, "shared") == 512
    assert len(calibrating) == 4
    assert len(json.loads((tmp_path / crossover.CACHE_FILE).read_text())["entries"]) == 4


def test_measurement_under_load_is_not_stored(calibrating, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(crossover, "other_cores_meter", lambda: lambda: 1.4)
    monkeypatch.setattr(crossover, "_said_under_load", [])
    query, key = tensors()
    assert dense_below(query, key, 1, 8, 128, "decode") == 513
    assert dense_below(query, key, 1, 8, 128, "decode") == 513  # this process keeps it
    assert len(calibrating) == 1 and not (tmp_path / crossover.CACHE_FILE).exists()
    assert dense_below(query, key, 2, 8, 128, "decode") == 1025  # another shape, measured under load too
    assert err_count(capsys, "other processes kept 1.4 CPU cores busy") == 1  # said once per process
    # The next process measures again; on an idle machine the result is stored, with the load it saw.
    crossover._known.clear()
    monkeypatch.setattr(crossover, "other_cores_meter", lambda: lambda: 0.1)
    assert dense_below(query, key, 1, 8, 128, "decode") == 513
    assert len(calibrating) == 3
    (entry,) = json.loads((tmp_path / crossover.CACHE_FILE).read_text())["entries"].values()
    assert entry["other_cores_busy"] == 0.1


def err_count(capsys, message: str) -> int:
    return capsys.readouterr().err.count(message)


def test_other_cores_are_the_machine_s_busy_time_less_our_own(monkeypatch):
    # (machine busy s, own CPU s, wall s) at start and stop: 3 busy seconds in 2 wall seconds, 1 of them ours.
    readings = iter([(100.0, 10.0, 50.0), (103.0, 11.0, 52.0)])
    monkeypatch.setattr(crossover, "cpu_counters", lambda: next(readings))
    assert crossover.other_cores_meter()() == pytest.approx(1.0)
    monkeypatch.setattr(crossover, "cpu_counters", lambda: None)  # no /proc/stat
    assert crossover.other_cores_meter()() is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat (Linux)")
def test_other_cores_meter_sees_a_spinning_process():
    spinning = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the child has started
        busy = crossover.other_cores_meter()()  # waits WATCH_MIN_S, using no CPU itself
    finally:
        spinning.kill()
        spinning.wait()
    assert busy is not None and busy > 0.5  # the child alone keeps one core busy


def test_shape_key_names_the_machine_and_the_call():
    query, key = tensors()
    shape = crossover.make_shape(query.bfloat16(), key.bfloat16(), 2, 8, 64, "probe")
    assert shape.processor == crossover.processor_name() and shape.threads == torch.get_num_threads()
    assert (shape.dtype, shape.heads, shape.kv_heads, shape.head_dim) == ("bfloat16", 9, 3, 16)
    assert (shape.top_k, shape.num_groups, shape.window, shape.kind) == (2, 8, 64, "probe")
    assert shape.kernels == native.kernels_identity() and shape.kernels in shape.key
    assert shape.torch_kernels.split()[0] == torch.backends.cpu.get_cpu_capability()


def test_a_crossover_measured_with_torchs_kernels_capped_is_not_read_without_the_cap(monkeypatch):
    # Dense SDPA, the other side of the crossover, runs torch's own kernels: capped at AVX2 (or its BLAS capped) it
    # can take twice as long as uncapped on an AVX-512 processor, so the two settings are two shapes.
    query, key = tensors()
    for name in build.TORCH_ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    free = crossover.make_shape(query, key, 1, 4, 8, "shared")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    capped = crossover.make_shape(query, key, 1, 4, 8, "shared")
    assert capped.torch_kernels == f"{free.torch_kernels} MKL_ENABLE_INSTRUCTIONS=AVX2"
    assert capped.key != free.key
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert crossover.make_shape(query, key, 1, 4, 8, "shared").torch_kernels.startswith("DEFAULT ")


def test_a_crossover_measured_with_one_build_is_measured_again_with_another(calibrating, monkeypatch):
    # Which sparse path is faster depends on the C kernels' build (an SSE build's kernels ran at half the torch
    # path's speed where the AVX2 build's ran ahead of it): a cached crossover holds for the build that measured it.
    query, key = tensors()
    monkeypatch.setattr(crossover, "kernels_identity", lambda: "focus-kernels-avx2")
    dense_below(query, key, 1, 8, 128, "shared")
    dense_below(query, key, 1, 8, 128, "shared")
    assert [shape.kernels for shape in calibrating] == ["focus-kernels-avx2"]
    monkeypatch.setattr(crossover, "kernels_identity", lambda: "focus-kernels-sse")
    dense_below(query, key, 1, 8, 128, "shared")
    monkeypatch.setattr(crossover, "kernels_identity", lambda: "torch")  # FOCUS_HF_NATIVE=0, or no compiler
    dense_below(query, key, 1, 8, 128, "shared")
    assert [shape.kernels for shape in calibrating] == ["focus-kernels-avx2", "focus-kernels-sse", "torch"]
    monkeypatch.setattr(crossover, "_known", {})  # a new process: the cache file answers for each build
    monkeypatch.setattr(crossover, "kernels_identity", lambda: "focus-kernels-avx2")
    dense_below(query, key, 1, 8, 128, "shared")
    assert len(calibrating) == 3


@pytest.mark.parametrize("content", ["not json", '{"version": 0, "entries": {}}', '{"version": 1}'])
def test_unreadable_cache_is_measured_again_and_rewritten(calibrating, tmp_path, content):
    (tmp_path / crossover.CACHE_FILE).write_text(content)
    query, key = tensors()
    assert dense_below(query, key, 1, 8, 128, "shared") == 512
    assert len(calibrating) == 1
    assert json.loads((tmp_path / crossover.CACHE_FILE).read_text())["version"] == crossover.CACHE_VERSION


def test_unwritable_cache_keeps_the_value_in_memory(calibrating, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FOCUS_HF_CACHE", str(blocker / "sub"))  # a folder under a file cannot be created
    query, key = tensors()
    assert dense_below(query, key, 1, 8, 128, "shared") == 512
    assert dense_below(query, key, 1, 8, 128, "shared") == 512
    assert len(calibrating) == 1
    assert "could not write the crossover cache" in capsys.readouterr().err


def test_forced_crossover_skips_measurement(calibrating, monkeypatch):
    monkeypatch.setenv(crossover.CROSSOVER_ENV, "777")
    query, key = tensors()
    assert dense_below(query, key, 3, 8, 128, "separate") == 777
    monkeypatch.setenv(crossover.CROSSOVER_ENV, "measure")
    assert dense_below(query, key, 3, 8, 128, "separate") == 1536
    assert len(calibrating) == 1
    monkeypatch.setenv(crossover.CROSSOVER_ENV, "soon")
    with pytest.raises(ValueError, match="FOCUS_HF_CROSSOVER"):
        dense_below(query, key, 1, 8, 128, "shared")


def test_no_calibration_uses_the_default_and_ignores_the_cache(calibrating, monkeypatch):
    query, key = tensors()
    dense_below(query, key, 1, 8, 128, "shared")  # measured and cached: 512
    crossover._known.clear()
    monkeypatch.setenv(crossover.NO_CALIBRATION_ENV, "1")
    assert dense_below(query, key, 1, 8, 128, "shared") == crossover.default_dense_below(torch.device("cpu"), 1)
    assert dense_below(query, key, 3, 8, 128, "shared") == crossover.default_dense_below(torch.device("cpu"), 3) == 3072
    assert len(calibrating) == 1


def pattern_of(query_groups, key_groups, sink, **options) -> FocusPattern:
    """The pattern of `routed_case`'s calls: 4 groups, a window of 8."""
    return FocusPattern(query_groups, key_groups, sink, 4, 8, **options)


def routed_case(kind, seq=200, q_len=200, top_k=1, num_groups=4, window=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(1, seq, num_groups, generator=generator)
    key_groups = scores.argmax(-1)
    if kind in ("probe", "separate"):
        scores = torch.rand(1, seq, num_groups, generator=generator)
    query_groups = scores.argsort(-1, descending=True)[..., :top_k][:, seq - q_len :]
    query = torch.randn(1, 6, q_len, 16, generator=generator)
    key, value = torch.randn(2, 1, 2, seq, 16, generator=generator)
    sink = (torch.arange(seq) < 2)[None]
    return query, key, value, query_groups, key_groups, sink


@pytest.mark.parametrize(
    "kind, q_len, top_k",
    [("shared", 200, 1), ("shared", 200, 2), ("probe", 200, 1), ("separate", 200, 2), ("decode", 1, 1)],
)
def test_auto_asks_for_the_path_that_runs_and_is_exact_either_side(monkeypatch, kind, q_len, top_k):
    query, key, value, query_groups, key_groups, sink = routed_case(kind, q_len=q_len, top_k=top_k)
    seen = []
    positions = torch.arange(key.shape[2])
    allowed = allowed_pairs(query_groups, key_groups, sink, positions[key.shape[2] - q_len :], positions, 8)
    reference = dense_attention(query, key, value, allowed[:, None], scaling=0.25)
    pattern = pattern_of(query_groups, key_groups, sink)
    for chosen in measurement.SIDES:  # each side auto may choose
        monkeypatch.setattr(crossover, "auto_path", lambda *args, result=chosen: seen.append(args) or result)
        output = hard.hard_attention(query, key, value, pattern, scaling=0.25, backend="auto")
        torch.testing.assert_close(output, reference, atol=1e-4, rtol=0)
    assert [args[2:] for args in seen] == [(top_k, 4, 8, kind, hard.hard_attention)] * len(measurement.SIDES)
    seen.clear()
    for entry in measured_paths("cpu", kind == "decode").values():  # told which entry to run (as the crossover's
        output = hard.hard_attention(query, key, value, pattern, scaling=0.25, backend="auto", path=entry.name)
        torch.testing.assert_close(output, reference, atol=1e-4, rtol=0)  # measurement is): the same result
    assert not seen


def call_record(query, key, value, pattern, arguments):
    """What a call of `hard.hard_attention` is made of, but for the path it is told to take: tensors' dtype, device,
    shape ranks and layouts (token-major projections or a head-major cache), and every other argument's and pattern
    field's kind."""

    def layout(tensor):
        return (
            tensor.dtype,
            tensor.device,
            tensor.dim(),
            tensor.is_contiguous(),
            tensor.transpose(1, 2).is_contiguous(),
        )

    record = {"tensors": [layout(tensor) for tensor in (query, key, value)]}
    record["decode"] = query.shape[2] == 1 < key.shape[2]
    fields = {name: getattr(pattern, name) for name in pattern.__dataclass_fields__}
    for name, argument in {**fields, **arguments}.items():
        if name == "path":
            continue
        if isinstance(argument, torch.Tensor):
            record[name] = (argument.dtype, argument.dim(), argument.shape[-1] if name == "query_groups" else None)
        elif isinstance(argument, list):
            record[name] = [type(item) for item in argument]
        else:
            record[name] = argument
    return record


@pytest.mark.parametrize("kind, top_k", [("shared", 1), ("shared", 2), ("probe", 1), ("separate", 2), ("decode", 1)])
def test_calibration_times_the_call_that_auto_dispatches(monkeypatch, tmp_path, kind, top_k):
    """The crossover's measurement calls the very function that dispatches "auto"'s call - both paths, with arguments
    of the same kind (layouts, routing, the decoding step's copy of the distant keys) - and nothing else."""
    from focus_hf.attention.cpu.grouped_keys import GroupedKeys

    monkeypatch.delenv(crossover.NO_CALIBRATION_ENV, raising=False)
    monkeypatch.delenv(crossover.CROSSOVER_ENV, raising=False)
    monkeypatch.setenv("FOCUS_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(crossover, "_known", {})
    monkeypatch.setattr(measurement, "LENGTHS", (160, 192))
    monkeypatch.setattr(crossover, "other_cores_meter", lambda: lambda: 0.0)
    dispatch, records = hard.hard_attention, []

    def recorded(query, key, value, pattern, **arguments):
        records.append((arguments.get("path"), call_record(query, key, value, pattern, arguments)))
        return dispatch(query, key, value, pattern, **arguments)

    monkeypatch.setattr(hard, "hard_attention", recorded)
    decode = kind == "decode"
    query, key, value, query_groups, key_groups, sink = routed_case(kind, q_len=1 if decode else 200, top_k=top_k)
    if decode:  # a KV cache is head-major; a fresh projection token-major
        key, value = key.contiguous(), value.contiguous()
    else:
        query, key, value = (tensor.transpose(1, 2).contiguous().transpose(1, 2) for tensor in (query, key, value))
    extra = {"key_copy": [GroupedKeys(4)]} if decode else {}
    own_group = kind != "probe" and kind != "separate"
    # As a model's routing gives it: its sinks (`FocusConfig.sink_tokens`), whether queries probe their own group.
    pattern = pattern_of(query_groups, key_groups, sink, sink_tokens=measurement.SINKS, own_group=own_group)
    with torch.inference_mode():
        recorded(query, key, value, pattern, scaling=0.25, backend="auto", **extra)
    (dispatched_path, dispatched), *timed = records
    assert dispatched_path is None and timed
    assert {path for path, _ in timed} == {entry.name for entry in measured_paths("cpu", decode).values()}
    assert all(record == dispatched for _, record in timed)
    (entry,) = json.loads((tmp_path / crossover.CACHE_FILE).read_text())["entries"].values()
    assert entry["shape"]["kind"] == kind and [row["length"] for row in entry["timings"]][0] == 160


@pytest.mark.parametrize("kind, top_k", [("shared", 2), ("probe", 1), ("decode", 1)])
def test_real_measurement_runs_on_tiny_lengths(kind, top_k):
    query, key = tensors(heads=4, kv_heads=2)
    shape = crossover.make_shape(query, key, top_k, 4, 8, kind)
    found, rows = crossover.measure(shape, torch.device("cpu"), hard.hard_attention, lengths=(32, 64))
    assert found in (32, 64) and [row["length"] for row in rows] in ([32], [32, 64])
    assert all(row["dense_s"] > 0 and row["sparse_s"] > 0 for row in rows)


def test_bench_calibrate_prints_and_stores_crossovers(calibrating, tmp_path, capsys):
    path = tmp_path / "calibrate.json"
    assert cli_main(["bench", "--calibrate", "--top-k", "1", "2", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [(row["top_k"], row["kind"]) for row in rows] == [
        (1, "shared"),
        (1, "probe"),
        (1, "decode"),
        (2, "shared"),
        (2, "separate"),
        (2, "decode"),
    ]
    assert [row["dense_below"] for row in rows] == [512, 512, 513, 1024, 1024, 1025]
    assert all(row["processor"] and "load_avg_1m" in row for row in rows)
    assert "dense_below" in capsys.readouterr().out
    assert len(json.loads((tmp_path / crossover.CACHE_FILE).read_text())["entries"]) == 6


def test_bench_decode_writes_rows(tmp_path):
    path = tmp_path / "decode.json"
    argv = ["bench", "--decode", "--seq-lens", "300", "700", "--top-k", "1", "2", "--window", "16"]
    assert cli_main(argv + ["--decode-repeats", "2", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [(row["cache_len"], row["top_k"]) for row in rows] == [(300, 1), (300, 2), (700, 1), (700, 2)]
    for row in rows:
        assert row["mode"] == "decode" and row["speedup"] == pytest.approx(row["dense_s"] / row["focus_s"])
        assert 0 < row["keys_fraction"] <= 1 and row["processor"] and row["threads"] >= 1
        # The suite runs without calibration: the default crossover decides the path.
        assert row["focus_path"] == ("dense-masked" if row["cache_len"] < row["dense_below"] else "group-sorted copy")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_few_query_attention_equals_the_kernel(dtype, tolerance):
    from focus_hf.attention.backends import cpu_kernel
    from focus_hf.attention.cpu.partials import few_query_attention, hidden_bias

    generator = torch.Generator().manual_seed(3)
    query = torch.randn(2, 6, 3, 16, generator=generator).to(dtype)
    key, value = torch.randn(2, 2, 2, 40, 16, generator=generator).to(dtype)
    visible = torch.rand(2, 1, 3, 40, generator=generator) < 0.7
    bias = hidden_bias(visible, dtype)
    expected, _ = cpu_kernel(query, key, value, causal=False, bias=bias, scale=0.3)
    actual = few_query_attention(query, key, value, bias, 0.3)
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=0)


def test_failed_measurement_falls_back_to_the_default(calibrating, monkeypatch, capsys):
    def broken(shape, device, call, lengths=None, clock=None):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(crossover, "measure", broken)
    query, key = tensors()
    assert dense_below(query, key, 2, 8, 128, "shared") == crossover.default_dense_below(torch.device("cpu"), 2)
    assert "calibration failed" in capsys.readouterr().err


def test_bench_peak_memory_measures_dense_and_focus(tmp_path):
    path = tmp_path / "memory.json"
    argv = ["bench", "--peak-memory", "--seq-lens", "200", "--top-k", "1", "--window", "16", "--threads", "1"]
    assert cli_main(argv + ["--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [(row["variant"], row["top_k"]) for row in rows] == [("dense SDPA", None), ("Focus", 1)]
    for row in rows:
        assert row["peak_rss_mib"] >= row["rss_before_call_mib"] > 0
        # The setup's own peak (inputs, routing) must not count as the call's.
        assert row["peak_reset_before_call"] is sys.platform.startswith("linux")
        assert row["warm_up_tokens"] == 200  # a warm-up call first, at most as long as the measured one


def test_sparse_path_at_takes_the_nearest_measured_length():
    entry = {
        "timings": [
            {"length": 512, "dense_s": 1.0, "sparse_s": 2.0, "sparse_path": "sparse"},
            {"length": 1024, "dense_s": 2.0, "sparse_s": 1.0, "sparse_path": "sparse"},
            {"length": 4096, "dense_s": None, "sparse_s": 1.0, "sparse_path": "sparse-torch"},
        ]
    }
    assert crossover.sparse_path_at(entry, 100) == "sparse"  # below every measured length: the shortest's
    assert crossover.sparse_path_at(entry, 2000) == "sparse"  # 1,024 is nearer by ratio than 4,096
    assert crossover.sparse_path_at(entry, 2048) == "sparse"  # as near: the shorter's
    assert crossover.sparse_path_at(entry, 2100) == "sparse-torch"
    assert crossover.sparse_path_at(entry, 4096) == "sparse-torch"
    assert crossover.sparse_path_at(entry, 10**6) == "sparse-torch"
    assert crossover.sparse_path_at({"dense_below": 8}, 10**6) == "sparse"  # forced or default: the C kernels


def raced_row(length, path, slower=1.2):
    """A timing row of both sparse paths at `length`, `path` the faster, the other `slower` times as slow."""
    times = {"kernels_s": slower, "torch_s": slower, crossover.SIDE_TIMES[path]: 1.0}
    return {"length": length, "dense_s": None, "sparse_s": 1.0, **times, "sparse_path": path}


def test_race_is_due_only_beyond_a_factor_of_two_from_every_length_timed_on_both_paths():
    entry = {"timings": [raced_row(4096, "sparse"), raced_row(16384, "sparse")]}
    assert not crossover.race_due(entry, 32768)
    assert crossover.race_due(entry, 32769) and crossover.race_due(entry, 65536)
    assert not crossover.race_due(entry, 2048) and not crossover.race_due(entry, 10000)
    # The nearest timed length had one path far slower: that one is not raced.
    far_apart = {"timings": [raced_row(4096, "sparse"), raced_row(16384, "sparse-torch", slower=crossover.RACE_WITHIN)]}
    assert not crossover.race_due(far_apart, 65536)
    assert crossover.sparse_path_at(far_apart, 65536) == "sparse-torch"
    # One sparse path timed (CUDA, or no C compiler), or nothing timed (forced, default): nothing to race.
    assert not crossover.race_due({"timings": [{"length": 64, "sparse_s": 1.0, "sparse_path": "sparse"}]}, 10**6)
    assert not crossover.race_due({"dense_below": 8}, 10**6)


@pytest.fixture
def stored_entry(monkeypatch, tmp_path):
    """A cache holding the entry of `routed_case("shared")`'s shape: both sparse paths timed at 64 keys (the C kernels
    faster), the crossover at 32; returns the cache file's entries, read again on each call."""
    if native.native_kernels() is None:
        pytest.skip("no C compiler: the sparse path has only its torch operations")
    monkeypatch.setenv("FOCUS_HF_CACHE", str(tmp_path))
    monkeypatch.delenv(crossover.NO_CALIBRATION_ENV, raising=False)
    monkeypatch.delenv(crossover.CROSSOVER_ENV, raising=False)
    crossover._known.clear()
    query, key, *_ = routed_case("shared")
    shape = crossover.make_shape(query, key, 1, 4, 8, "shared")
    crossover.write_entry(shape, {"dense_below": 32, "timings": [raced_row(64, "sparse")]})
    yield lambda: crossover.read_cache()[shape.key]
    crossover._known.clear()


def test_a_call_far_beyond_the_timed_lengths_races_both_sparse_paths_once(monkeypatch, stored_entry):
    """200 keys, timed at 64 only: the call runs on both sparse paths (torch operations, then the C kernels), exactly;
    its row joins the entry in memory and in the file; the next call runs the faster path alone."""
    monkeypatch.setattr(crossover, "other_cores_meter", lambda: lambda: 0.0)  # an idle machine: the row is stored
    query, key, value, query_groups, key_groups, sink = routed_case("shared")
    positions = torch.arange(key.shape[2])
    allowed = allowed_pairs(query_groups, key_groups, sink, positions, positions, 8)
    reference = dense_attention(query, key, value, allowed[:, None], scaling=0.25)
    pattern = pattern_of(query_groups, key_groups, sink, own_group=True)
    assert crossover.race_pending(query, key, 1, 4, 8, "shared", hard.hard_attention)
    runs = []
    real = crossover.race_sparse_paths

    def watched(*arguments):
        run = arguments[-1]
        return real(*arguments[:-1], lambda path: runs.append(path) or run(path))

    monkeypatch.setattr(crossover, "race_sparse_paths", watched)
    output = hard.hard_attention(query, key, value, pattern, scaling=0.25, backend="auto")
    torch.testing.assert_close(output, reference, atol=1e-4, rtol=0)
    assert runs == ["sparse-torch", "sparse"]
    row = stored_entry()["timings"][-1]
    assert row["length"] == 200 and row["timed_on"] == "a call" and row["dense_s"] is None
    assert row["sparse_s"] == min(row["kernels_s"], row["torch_s"]) == row[crossover.SIDE_TIMES[row["sparse_path"]]]
    assert not crossover.race_pending(query, key, 1, 4, 8, "shared", hard.hard_attention)
    output = hard.hard_attention(query, key, value, pattern, scaling=0.25, backend="auto")
    torch.testing.assert_close(output, reference, atol=1e-4, rtol=0)
    assert len(runs) == 2 and len(stored_entry()["timings"]) == 2
    assert crossover.auto_path(query, key, 1, 4, 8, "shared", hard.hard_attention) == row["sparse_path"]
    crossover._known.clear()  # a new process reads the row from the file
    assert not crossover.race_pending(query, key, 1, 4, 8, "shared", hard.hard_attention)


def test_a_race_under_load_is_kept_in_this_process_only(monkeypatch, stored_entry):
    monkeypatch.setattr(crossover, "other_cores_meter", lambda: lambda: crossover.OTHER_CORES_MAX + 1)
    query, key, value, query_groups, key_groups, sink = routed_case("shared")
    pattern = pattern_of(query_groups, key_groups, sink, own_group=True)
    hard.hard_attention(query, key, value, pattern, scaling=0.25, backend="auto")
    assert not crossover.race_pending(query, key, 1, 4, 8, "shared", hard.hard_attention)
    assert len(stored_entry()["timings"]) == 1
    crossover._known.clear()
    assert crossover.race_pending(query, key, 1, 4, 8, "shared", hard.hard_attention)


def test_no_race_for_decoding_steps_or_calls_autograd_records(stored_entry):
    query, key, *_ = routed_case("shared")
    assert crossover.auto_path(query, key, 1, 4, 8, "shared", hard.hard_attention) == crossover.RACE
    recorded = query.clone().requires_grad_()
    assert crossover.auto_path(recorded, key, 1, 4, 8, "shared", hard.hard_attention) == "sparse"
    with torch.no_grad():
        assert crossover.auto_path(recorded, key, 1, 4, 8, "shared", hard.hard_attention) == crossover.RACE
    # a decoding step's entry, timed at 64 keys: a step at 200 keys takes the nearest length's path
    shape = crossover.make_shape(query[:, :, -1:], key, 1, 4, 8, "decode")
    crossover.write_entry(shape, {"dense_below": 32, "timings": [raced_row(64, "sparse-torch")]})
    assert crossover.auto_path(query[:, :, -1:], key, 1, 4, 8, "decode", hard.hard_attention) == "sparse-torch"


def test_auto_runs_the_torch_path_where_it_was_measured_faster(monkeypatch, tmp_path):
    """A cached entry that measured torch's sparse path faster from 128 keys on: calls of 200 keys run it (no C
    kernel call), exactly; below the crossover the dense masked call runs."""
    from focus_hf.attention.cpu import native

    monkeypatch.setenv("FOCUS_HF_CACHE", str(tmp_path))
    monkeypatch.delenv(crossover.NO_CALIBRATION_ENV, raising=False)
    monkeypatch.delenv(crossover.CROSSOVER_ENV, raising=False)
    crossover._known.clear()
    query, key, value, query_groups, key_groups, sink = routed_case("shared")
    shape = crossover.make_shape(query, key, 1, 4, 8, "shared")
    rows = [
        {"length": 64, "dense_s": 1.0, "sparse_s": 2.0, "sparse_path": "sparse"},
        {"length": 128, "dense_s": 2.0, "sparse_s": 1.0, "sparse_path": "sparse-torch"},
    ]
    crossover.write_entry(shape, {"dense_below": 128, "timings": rows})
    kernel_calls = []
    real = native.native_kernels

    def watched():
        kernels = real()
        if kernels is not None:
            kernel_calls.append(True)
        return kernels

    monkeypatch.setattr(native, "native_kernels", watched)
    positions = torch.arange(key.shape[2])
    allowed = allowed_pairs(query_groups, key_groups, sink, positions, positions, 8)
    reference = dense_attention(query, key, value, allowed[:, None], scaling=0.25)
    pattern = pattern_of(query_groups, key_groups, sink, own_group=True)
    assert crossover.auto_path(query, key, 1, 4, 8, "shared", hard.hard_attention) == "sparse-torch"
    output = hard.hard_attention(query, key, value, pattern, scaling=0.25, backend="auto")
    torch.testing.assert_close(output, reference, atol=1e-4, rtol=0)
    assert not kernel_calls  # every kernel lookup inside the torch path answered None
    short = slice(0, 100)
    assert crossover.auto_path(query[:, :, short], key[:, :, short], 1, 4, 8, "shared", hard.hard_attention) == "dense"
    crossover._known.clear()


def test_measurement_times_both_sparse_paths_on_the_cpu():
    from focus_hf.attention.cpu import native

    if native.native_kernels() is None:
        pytest.skip("no C compiler: the sparse path has only its torch operations")
    query, key = tensors(heads=4, kv_heads=2)
    shape = crossover.make_shape(query, key, 1, 4, 8, "shared")
    _, rows = crossover.measure(shape, torch.device("cpu"), hard.hard_attention, lengths=(32, 64))
    for row in rows:
        assert row["sparse_path"] in crossover.SPARSE_SIDES
        assert row["sparse_s"] == min(row["kernels_s"], row["torch_s"]) == row[crossover.SIDE_TIMES[row["sparse_path"]]]


def test_bench_makes_a_pending_race_before_it_times_and_names_the_path(monkeypatch, tmp_path, capsys):
    """`focus-hf bench` at a length "auto" has not timed both sparse paths near: the race runs once, untimed, and
    the row names the path the timed calls took."""
    if native.native_kernels() is None:
        pytest.skip("no C compiler: the sparse path has only its torch operations")
    monkeypatch.setenv("FOCUS_HF_CACHE", str(tmp_path))
    monkeypatch.delenv(crossover.NO_CALIBRATION_ENV, raising=False)
    monkeypatch.delenv(crossover.CROSSOVER_ENV, raising=False)
    monkeypatch.setattr(crossover, "other_cores_meter", lambda: lambda: 0.0)
    crossover._known.clear()
    query, key = torch.zeros(1, 9, 8, 64), torch.zeros(1, 3, 8, 64)  # the bench's default layer
    shape = crossover.make_shape(query, key, 1, 8, 16, "shared")
    crossover.write_entry(shape, {"dense_below": 32, "timings": [raced_row(64, "sparse")]})
    races = []
    real = crossover.race_sparse_paths
    monkeypatch.setattr(crossover, "race_sparse_paths", lambda *arguments: races.append(1) or real(*arguments))
    path = tmp_path / "rows.json"
    argv = ["bench", "--seq-lens", "300", "--top-k", "1", "--window", "16", "--repeats", "2", "--json", str(path)]
    assert cli_main(argv) == 0
    (row,) = json.loads(path.read_text())
    (stored,) = crossover.read_cache().values()
    raced = stored["timings"][-1]
    assert len(races) == 1 and raced["length"] == 300 and raced["timed_on"] == "a call"
    assert row["focus_path"] == raced["sparse_path"] and row["repeats"] == 2 and row["race"] == raced
    assert raced["sparse_path"] in capsys.readouterr().out
    crossover._known.clear()
