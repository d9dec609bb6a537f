"""Where, when and how a benchmark row was measured, and how rows are kept.

`machine_fields` (the device, the processor with its instruction sets and the C kernels' build, threads, load,
versions, commit and date) goes into every row of `focus-hf bench` and of the scripts under `benchmarks/`;
`provenance` heads a script's JSON file. `RowLog` and `write_json` write a run's rows after every row, so that a run
stopped part-way (a time limit) keeps what it measured.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:
    import argparse

    import torch


def other_cores(device: torch.device) -> Callable[[], Optional[float]]:
    """Start watching the machine while a length is timed; the returned function gives the cores other processes
    kept busy meanwhile, on average (`crossover.other_cores_meter`; None on a GPU or where /proc/stat is missing). The
    rows' 1-minute load average counts the benchmark's own threads; this does not."""
    from focus_hf.attention.crossover import other_cores_meter

    if device.type != "cpu":
        return lambda: None
    stop = other_cores_meter()

    def busy() -> Optional[float]:
        cores = stop()
        return None if cores is None else round(cores, 2)

    return busy


def device_name(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def machine_fields(device: torch.device) -> dict:
    """Where and when a row was measured: device, processor name (on the CPU with its instruction sets and how the C
    kernels were built: compiler, target, what the build uses), threads, load, package versions, the source's git
    commit and the date."""
    import torch

    from focus_hf.attention.cpu.build import instruction_sets, torch_kernels
    from focus_hf.attention.cpu.native import build_record
    from focus_hf.attention.crossover import processor_name

    cpu = {}
    if device.type == "cpu":
        cpu = {"instruction_sets": instruction_sets(), "cpu_kernels": build_record(), "torch_kernels": torch_kernels()}
    return {
        "device": device_name(device),
        "processor": processor_name(device),
        **cpu,
        "threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0],  # other processes on the machine skew CPU timings
        **{name: version for name, version in package_versions().items() if name != "python"},
        "git_commit": git_commit(),
        "date": now(),
    }


def gpu_path_backend(args: argparse.Namespace, device: torch.device) -> bool:
    """Whether the row's Focus calls run the GPU path: on CUDA, or `--backend gpu-path`."""
    from focus_hf.attention.backends import canonical_backend
    from focus_hf.attention.paths import path_platform

    return path_platform(device, canonical_backend(args.backend, warn=False)) == "gpu"


def gpu_path_fields(args: argparse.Namespace, device: torch.device) -> dict:
    """On the GPU path (CUDA, or `--backend gpu-path`), what ran the row's Focus calls (`hard.path_record`): verify's
    verdicts, the calls since the row's length began that fell back to the reference path - a row with any is not a
    Focus figure - and FlexAttention's compilations. Nothing elsewhere."""
    if not gpu_path_backend(args, device):
        return {}
    from focus_hf.attention.hard import path_record

    return {"gpu_path": path_record()}


def provenance(device: torch.device, command: Optional[str]) -> dict:
    """What a benchmark's JSON records about its run: device, package versions, git commit, command and date."""
    return {
        "device": device_name(device),
        "versions": package_versions(),
        "git_commit": git_commit(),
        "command": command,
        "date": now(),
    }


def package_versions() -> dict[str, Optional[str]]:
    """Versions of Python and of the packages a result depends on (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    import focus_hf

    versions: dict[str, Optional[str]] = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("transformers", "peft"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    versions["focus_hf"] = focus_hf.__version__
    return versions


@functools.lru_cache(maxsize=1)
def git_commit() -> Optional[str]:
    """$FOCUS_HF_GIT_COMMIT where set (a copy of a working tree, whose .git - if it has one - may be older than the
    tree), else the commit of the focus_hf checkout that runs ("-dirty" with uncommitted changes to tracked files),
    else None."""
    if os.environ.get("FOCUS_HF_GIT_COMMIT"):
        return os.environ["FOCUS_HF_GIT_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists():
        git = ["git", "-C", str(root)]
        try:
            head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
            status = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True)
        except OSError:  # no git executable
            head = None
        if head is not None and head.returncode == 0:
            return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")
    return None


def now() -> str:
    """The current date and time, ISO 8601 with the UTC offset."""
    return datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds")


def command_line() -> Optional[str]:
    """The command that runs `focus-hf`, as typed (`focus-hf ...` or `python -m focus_hf.cli ...`); None when the
    command line is not focus-hf's own (called in-process, e.g. by a test)."""
    if not sys.argv:
        return None
    if Path(sys.argv[0]).name == "focus-hf":
        return shlex.join(["focus-hf", *sys.argv[1:]])
    if Path(sys.argv[0]).parts[-2:] == ("focus_hf", "cli.py"):
        return shlex.join(["python", "-m", "focus_hf.cli", *sys.argv[1:]])
    return None


class RowLog:
    """The rows of one run, each stamped with the command, written to `path` (when given) as a JSON list after every
    row, so that a run stopped part-way (a time limit) keeps what it measured."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = Path(path) if path else None
        self.rows: list[dict] = []
        self.failed = False  # a length failed (`rows_or_error`): the command exits with 1
        self.command = command_line()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, row: dict) -> dict:
        row["command"] = self.command  # so committed results say how they were produced
        self.rows.append(row)
        if self.path is not None:
            self.path.write_text(json.dumps(self.rows, indent=2) + "\n")
        return row


def rows_or_error(
    measure: Callable[[], list[dict]], log: RowLog, length_key: str, length: int, device: torch.device
) -> list[dict]:
    """The rows `measure()` returns; when it fails (out of memory, a path that breaks), one error row in their place
    and the traceback on stderr, so that the lengths after it are still measured (the command then exits with 1)."""
    import torch

    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - reported in the row, on stderr and in the exit code
        traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log.failed = True
        log.add({length_key: length, "error": error_text(error), **machine_fields(device)})
        return []


def repository_of(script: str) -> Path:
    """The checkout a benchmark script lies in: the folder above its `benchmarks/` (`script`: its `__file__`)."""
    path = Path(script).resolve()
    return next(folder.parent for folder in path.parents if folder.name == "benchmarks")


def script_command(script: str, argv: Optional[Sequence[str]] = None) -> str:
    """The command that produced a benchmark script's row, as recorded in it: `python benchmarks/... ARGS` (`script`:
    its `__file__`, written from the repository root; `argv` default: this process's arguments)."""
    where = Path(script).resolve().relative_to(repository_of(script)).as_posix()
    return " ".join(["python", where, *(argv if argv is not None else sys.argv[1:])])


def write_json(path: Optional[Path], data: object) -> None:
    """Write what was measured so far as JSON, when a path is given (after every measurement, so that an interrupted
    run keeps it)."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def error_text(error: BaseException) -> str:
    """An exception as one short line for a result row."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]


def log(message: str) -> None:
    """Print a progress line with the time of day."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)
