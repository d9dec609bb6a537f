"""benchmarks/cpu/commits_compared.py: rows of two commits' runs matched and compared."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu" / "commits_compared.py"
spec = importlib.util.spec_from_file_location("commits_compared", SCRIPT)
commits_compared = importlib.util.module_from_spec(spec)
spec.loader.exec_module(commits_compared)


def _row(seq_len, top_k, focus_s, dense_s, **extra):
    return {"seq_len": seq_len, "top_k": top_k, "focus_s": focus_s, "dense_s": dense_s,
            "speedup": dense_s / focus_s, "date": "any", "load_avg_1m": 0.5, **extra}  # fmt: skip


def test_rows_are_matched_by_what_they_measure_and_compared_by_their_medians():
    base = [[_row(1024, 1, 1.0, 2.0), _row(1024, 2, 2.0, 2.0)], [_row(1024, 2, 4.0, 2.0), _row(1024, 1, 3.0, 2.0)],
            [_row(1024, 1, 2.0, 2.0, date="other"), _row(1024, 2, 3.0, 2.0)]]  # fmt: skip
    head = [[_row(1024, 1, 1.0, 2.0), _row(1024, 2, 1.5, 2.0)]] * 3
    rows = {(r["row"]["seq_len"], r["row"]["top_k"]): r for r in commits_compared.compare(base, head)}
    assert set(rows) == {(1024, 1), (1024, 2)}
    top1 = rows[1024, 1]
    assert top1["base"]["focus_s"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert top1["head_over_base"]["focus_s"] == pytest.approx(0.5)
    assert top1["head_over_base"]["speedup"] == pytest.approx(2.0 / 1.0)  # medians of the speedups: 2 over 1
    assert rows[1024, 2]["head_over_base"]["dense_s"] == pytest.approx(1.0)
    assert "date" not in top1["row"] and "load_avg_1m" not in top1["row"]


def test_rows_that_differ_between_the_commits_are_refused():
    with pytest.raises(ValueError, match="rows differ"):
        commits_compared.compare([[_row(1024, 1, 1.0, 2.0)]], [[_row(2048, 1, 1.0, 2.0)]])
