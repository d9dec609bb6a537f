"""A pytest plugin that writes every test's outcome to a JSON file as soon as the test finishes.

benchmarks/gpu/run.py loads it (`-p pytest_report`, this folder on PYTHONPATH, the file in $FOCUS_HF_TEST_REPORT) for
its CUDA-test stage: when the stage's time limit stops pytest part-way, the outcomes of the tests that ran are on
disk already (a JUnit XML file would only be written at the end). The file holds the run's device, versions, git
commit, command and date, the counts per outcome, and one entry per test (node id, outcome, seconds, and the skip
reason or the first lines of the failure).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest

_PATH = os.environ.get("FOCUS_HF_TEST_REPORT")
_RESULT: dict = {}
_START = time.perf_counter()


def _write() -> None:
    if _PATH:
        counts: dict[str, int] = {}
        for test in _RESULT["tests"]:
            counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
        _RESULT["counts"] = counts
        _RESULT["wall_s"] = time.perf_counter() - _START
        Path(_PATH).write_text(json.dumps(_RESULT, indent=2) + "\n")


def _message(report: pytest.TestReport) -> str | None:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])  # (file, line, reason)
    if report.failed:
        lines = str(report.longrepr).strip().splitlines()
        return "\n".join(lines[-15:])  # the end of a traceback names the error
    return None


def pytest_sessionstart(session: pytest.Session) -> None:
    import torch

    from focus_hf.benchmarking.records import provenance

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _RESULT.update(provenance(device, shlex.join(sys.orig_argv)))
    _RESULT.update(cuda_available=torch.cuda.is_available(), finished=False, counts={}, tests=[])
    _write()


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed and _RESULT:
        _RESULT["tests"].append(
            {"nodeid": report.nodeid, "outcome": "collection error", "message": str(report.longrepr)[-2000:]}
        )
        _write()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One entry per test: its call's outcome, or the setup's when the setup skipped or failed, and an error entry
    for a failing teardown."""
    if not _RESULT:
        return
    if report.when == "call":
        outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
    elif report.when == "setup" and not report.passed:
        outcome = "skipped" if report.skipped else "error"
    elif report.when == "teardown" and report.failed:
        outcome = "error"
    else:
        return
    _RESULT["tests"].append(
        {"nodeid": report.nodeid, "outcome": outcome, "seconds": report.duration, "message": _message(report)}
    )
    _write()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _RESULT:
        _RESULT.update(finished=True, exitstatus=int(exitstatus), collected=session.testscollected)
        _write()
