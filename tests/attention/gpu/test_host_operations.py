"""What the GPU path asks of the host, counted with torch's profiler on the CPU (benchmarks/gpu/host_operations.py):
no call reads the device (on CUDA each read is a sync, which a CUDA graph cannot capture), a call's operators do not
grow with its length or its groups, and its peak memory stays within 1.1x of one flash SDPA call's, the same at every
length. The kernels are the accounting stand-ins of CUDA's (their outputs, nothing computed): the exact path is
tested against the dense reference elsewhere (test_gpu_path.py, test_window.py, test_paged_keys.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import focus_hf.attention.gpu.budget as budget
import focus_hf.attention.gpu.paged_keys as paged_keys
import focus_hf.attention.gpu.window as window_module

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("host_operations", ROOT / "benchmarks" / "gpu" / "host_operations.py")
host_operations = sys.modules.setdefault("host_operations", importlib.util.module_from_spec(_spec))
if not hasattr(host_operations, "main"):
    _spec.loader.exec_module(host_operations)

BEFORE = ROOT / "benchmarks" / "results" / "gpu" / "host-operations" / "before.json"


layer = host_operations.layer_args  # the benchmark's layer (layer_prefill.py's), with changes


@pytest.fixture
def on_accounting_kernels():
    with torch.inference_mode(), host_operations.gpu_path_on(host_operations.accounting_kernels()):
        yield


def prefill(args, tokens):
    return {row["top_k"]: row for row in host_operations.prefill_rows(args, tokens)}


@pytest.mark.usefixtures("on_accounting_kernels")
def test_a_prefill_reads_nothing_and_its_operators_grow_neither_with_length_nor_with_groups():
    counts = [prefill(layer(groups=groups), tokens) for tokens, groups in ((512, 8), (2048, 8), (2048, 4))]
    for rows in counts:
        for row in rows.values():
            assert row["device_reads"] == 0, row["reads_by_operator"]
    for top_k in (1, 2):
        assert len({rows[top_k]["operators"] for rows in counts}) == 1, [rows[top_k]["operators"] for rows in counts]


@pytest.mark.usefixtures("on_accounting_kernels")
def test_a_prefill_launches_fewer_kernels_than_before_and_reads_nothing_in_pieces_too(monkeypatch):
    before = json.loads(BEFORE.read_text())["rows"]
    now = prefill(layer(), 1024)
    for top_k, row in now.items():
        old = next(r for r in before if r["call"] == "prefill" and r["tokens"] == 1024 and r["top_k"] == top_k)
        assert old["device_reads"] == 2 and row["device_reads"] == 0
        assert row["launches"] < old["launches"] and row["operators"] < old["operators"], (row, old)
    # Past ONE_PIECE_ROWS the parts go in runs of heads and chunks of rows: more operators, still no read.
    monkeypatch.setattr(budget, "ONE_PIECE_ROWS", 0)
    monkeypatch.setattr(window_module, "MIN_CHUNK_ROWS", 64)
    for row in prefill(layer(), 2048).values():
        assert row["device_reads"] == 0, row["reads_by_operator"]
        assert row["kernel_calls"] > now[row["top_k"]]["kernel_calls"]


@pytest.mark.usefixtures("on_accounting_kernels")
def test_a_decoding_step_reads_nothing_and_costs_the_same_at_every_cache_length(monkeypatch):
    monkeypatch.setattr(paged_keys, "FILE_EVERY", 16)  # 16 steps per cache, one of them filing
    args = layer(heads=8, kv_heads=2)
    steps = {cache: host_operations.decode_rows(args, cache) for cache in (512, 1536)}
    for rows in steps.values():
        assert {row["step"] for row in rows} >= {"plain step", "filing step"}
        for row in rows:
            assert row["device_reads"] == 0, row  # the filing step too: no step waits for the device
    for top_k in (1, 2):
        for step in ("plain step", "filing step"):
            operators = {
                cache: next(r["operators"] for r in rows if r["top_k"] == top_k and r["step"] == step)
                for cache, rows in steps.items()
            }
            assert len(set(operators.values())) == 1, (top_k, step, operators)


@pytest.mark.usefixtures("on_accounting_kernels")
def test_peak_memory_is_within_1_1x_of_flash_sdpa_and_the_same_at_every_length(monkeypatch):
    # ONE_PIECE_ROWS at 0: the parts take their budget (a share of the output) at these short lengths already, as
    # they do past 32K query rows, where the ratio is the same (benchmarks/results/gpu/host-operations/after.json
    # has it at 64K with the defaults).
    monkeypatch.setattr(budget, "ONE_PIECE_ROWS", 0)
    monkeypatch.setattr(window_module, "MIN_CHUNK_ROWS", 64)
    ratios = {
        tokens: {row["top_k"]: row["peak_ratio"] for row in host_operations.memory_rows(layer(), tokens)}
        for tokens in (4096, 8192)
    }
    for top_k in (1, 2):
        assert all(rows[top_k] <= 1.1 for rows in ratios.values()), ratios
        assert abs(ratios[4096][top_k] - ratios[8192][top_k]) < 0.01, ratios
    # One piece at these lengths by default: more memory (it is small there), fewer operators.
    monkeypatch.setattr(budget, "ONE_PIECE_ROWS", 32768)
    whole = host_operations.memory_rows(layer(), 4096)
    assert all(row["peak_ratio"] > ratios[4096][row["top_k"]] for row in whole)
