"""How long `focus-hf demo` takes and how much memory it needs, as a new user runs it: from a fresh focus_hf cache
(the GGUF conversion and the kernel build included), with the default options.

    python benchmarks/model/demo_run.py           # appends a row to benchmarks/results/demo_run.json

The demo runs as a child process (`focus-hf demo --out <scratch folder>`); this script records its wall time, its
peak resident memory (the largest of the process's, from the kernel's rusage), the CPU time it used, and the machine:
CPU model, cores, memory, and the load average sampled every 10 s. Other work on the machine slows the demo: the
row says how much CPU the other processes took on average (load average minus what the demo itself used), and the
docs say "shared with other work" when that exceeds half a core. `docs/hooks/figures.py` reads the last row into the
README, docs/getting-started.md and `focus-hf demo --help` (through docs/hooks/generated.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "demo_run.json"
LOAD_SAMPLE_SECONDS = 10


def memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return None


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "peft", "focus-hf"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def sample_load(samples: list[float], stop: threading.Event) -> None:
    while not stop.wait(LOAD_SAMPLE_SECONDS):
        samples.append(os.getloadavg()[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"JSON file to append to (default: {RESULTS})")
    parser.add_argument("demo_args", nargs="*", help="extra `focus-hf demo` options (after --); default: none")
    args = parser.parse_args(argv)
    from focus_hf.attention.crossover import cpu_name  # imports torch: after --help

    scratch = Path(tempfile.mkdtemp(prefix="focus-demo-run-"))
    env = dict(os.environ, FOCUS_HF_CACHE=str(scratch / "cache"))  # fresh: conversion and kernel build included
    env.pop("FOCUS_HF_NO_CALIBRATION", None)  # as a user runs it: the dense/sparse crossover is measured
    command = [sys.executable, "-m", "focus_hf.cli", "demo", "--out", str(scratch / "focus-demo"), *args.demo_args]
    samples: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_load, args=(samples, stop), daemon=True)
    load_before = os.getloadavg()
    started = time.perf_counter()
    sampler.start()
    try:
        child = subprocess.run(command, env=env, cwd=scratch)
    finally:
        stop.set()
        sampler.join()
    wall = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if child.returncode:
        print(f"focus-hf demo exited with {child.returncode}; nothing recorded", file=sys.stderr)
        return child.returncode
    results = json.loads((scratch / "focus-demo" / "eval_results.json").read_text())
    cpu_seconds = usage.ru_utime + usage.ru_stime
    mean_load = sum(samples) / len(samples) if samples else None
    row = {
        "command": "focus-hf demo" + "".join(f" {arg}" for arg in args.demo_args),
        "fresh_cache": True,
        "wall_seconds": round(wall, 1),
        # ru_maxrss is in kilobytes on Linux: the peak resident memory of the demo process.
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "cpu_seconds": round(cpu_seconds, 1),
        "demo_total_seconds": results.get("total_seconds"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "memory_bytes": memory_bytes(),
        "load_average_before": [round(value, 2) for value in load_before],
        "load_average_mean": round(mean_load, 2) if mean_load is not None else None,
        # The load average counts the demo's own runnable threads too; what is left is other work.
        "other_load_mean": round(mean_load - cpu_seconds / wall, 2) if mean_load is not None else None,
        "platform": platform.platform(),
        "versions": versions(),
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    rows = json.loads(args.results.read_text()) if args.results.is_file() else []
    rows.append(row)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(row, indent=2))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
