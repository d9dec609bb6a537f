"""Where the GPU path starts running its parts in pieces: `budget.one_piece_rows()`, FOCUS_HF_GPU_ONE_PIECE_ROWS or
32768 query rows. A 64K-token prefill runs in pieces by default and in one piece with the variable set high (counted
with benchmarks/gpu/host_operations.py's accounting stand-ins, which compute nothing); a call gives the dense
reference's output both ways (on the exact CPU stand-ins, at a length where the variable decides)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from attention_cases import ATOL, BASE_CASE, run_case

import focus_hf.attention.gpu.budget as budget
import focus_hf.attention.gpu.window as window_module

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("host_operations", ROOT / "benchmarks" / "gpu" / "host_operations.py")
host_operations = sys.modules.setdefault("host_operations", importlib.util.module_from_spec(_spec))
if not hasattr(host_operations, "main"):
    _spec.loader.exec_module(host_operations)

HIGH = str(1 << 40)


@pytest.fixture(autouse=True)
def _default_setting(monkeypatch):
    monkeypatch.delenv(budget.ONE_PIECE_ROWS_ENV, raising=False)


def spied_budgets(monkeypatch) -> list[int]:
    """The budgets `budget.temporary_bytes` hands the parts of the GPU path from now on, in order."""
    seen: list[int] = []
    original = budget.temporary_bytes

    def spy(query: torch.Tensor) -> int:
        seen.append(original(query))
        return seen[-1]

    monkeypatch.setattr(budget, "temporary_bytes", spy)
    return seen


def test_the_variable_sets_where_pieces_start_and_bad_values_are_refused_by_name(monkeypatch):
    assert budget.one_piece_rows() == budget.ONE_PIECE_ROWS == 32768
    for value, rows in (("0", 0), (" 65536 ", 65536), ("", 32768)):
        monkeypatch.setenv(budget.ONE_PIECE_ROWS_ENV, value)
        assert budget.one_piece_rows() == rows
    query = torch.empty(1, 2, 40000, 4)
    monkeypatch.setenv(budget.ONE_PIECE_ROWS_ENV, "40000")
    assert budget.temporary_bytes(query) == sys.maxsize
    monkeypatch.setenv(budget.ONE_PIECE_ROWS_ENV, "39999")
    assert budget.temporary_bytes(query) == int(query.nbytes * budget.TEMPORARY_SHARE)
    for bad in ("-1", "32k", "1.5", "many"):
        monkeypatch.setenv(budget.ONE_PIECE_ROWS_ENV, bad)
        with pytest.raises(ValueError, match=f"{budget.ONE_PIECE_ROWS_ENV} must be a whole number.*{bad!r}"):
            budget.temporary_bytes(query)


def test_a_64k_prefill_runs_in_pieces_by_default_and_in_one_piece_with_the_variable_set_high(monkeypatch):
    # The benchmark's layer with fewer heads (pieces start at a number of query rows, whatever the heads).
    args = host_operations.layer_args(heads=4, kv_heads=1)
    seen = spied_budgets(monkeypatch)
    with torch.inference_mode(), host_operations.gpu_path_on(host_operations.accounting_kernels()):
        short = {row["top_k"]: row for row in host_operations.prefill_rows(args, 1024)}
        assert seen and set(seen) == {sys.maxsize}
        seen.clear()
        pieces = {row["top_k"]: row for row in host_operations.prefill_rows(args, 65536)}
        assert seen and sys.maxsize not in seen
        seen.clear()
        monkeypatch.setenv(budget.ONE_PIECE_ROWS_ENV, HIGH)
        whole = {row["top_k"]: row for row in host_operations.prefill_rows(args, 65536)}
        assert seen and set(seen) == {sys.maxsize}
    for top_k in (1, 2):
        # In one piece a call's kernels are as many at 64K as at 1K; in pieces they are more.
        assert whole[top_k]["kernel_calls"] == short[top_k]["kernel_calls"], (whole[top_k], short[top_k])
        assert pieces[top_k]["kernel_calls"] > whole[top_k]["kernel_calls"], (pieces[top_k], whole[top_k])
        assert pieces[top_k]["launches"] > whole[top_k]["launches"]


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_output_is_the_dense_references_in_one_piece_and_in_pieces(monkeypatch, top_k):
    # 0 puts this short call in pieces (as past 32768 rows by default), chunks of the window band down to 16 rows.
    monkeypatch.setattr(window_module, "MIN_CHUNK_ROWS", 16)
    seen = spied_budgets(monkeypatch)
    outputs = {}
    for setting in ("0", HIGH):
        monkeypatch.setenv(budget.ONE_PIECE_ROWS_ENV, setting)
        seen.clear()
        output, reference, rows = run_case(dict(BASE_CASE, top_k=top_k), backend="gpu-path")
        torch.testing.assert_close(output[rows], reference[rows], atol=ATOL, rtol=0)
        assert seen and (sys.maxsize in seen) == (setting == HIGH), seen
        outputs[setting] = output[rows]
    torch.testing.assert_close(outputs["0"], outputs[HIGH], atol=ATOL, rtol=0)
