"""Add benchmark results to a machine's file: one JSON file per machine measured (benchmarks/results/machines/) holds
every run taken there, each under a name that says what ran and with which build (`attention_parts_native`,
`model_decode_x86-64-v3_torch-avx2`, `demo/printed.txt`); the docs read the runs from it by name
(docs/hooks/figures.py).

    FOCUS_HF_CPU_TARGET=x86-64-v3 python benchmarks/cpu/prefill_parts.py --json parts.json
    python benchmarks/machine_results.py benchmarks/results/machines/zen5-epyc.json \\
        attention_parts_x86-64-v3=parts.json

Each NAME=FILE adds FILE's JSON (a `.txt` file: its text) as run NAME, replacing a run of that name. A new machine
file needs `--machine`, the machine in words (processor, instruction sets, cores).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional


def add_runs(machine_file: Path, runs: dict[str, Path], machine: Optional[str] = None) -> dict:
    """`machine_file`'s content with each run of `runs` (name -> result file) added or replaced, written back."""
    data = json.loads(machine_file.read_text(encoding="utf-8")) if machine_file.exists() else None
    if data is None:
        if not machine:
            raise SystemExit(f"{machine_file} does not exist yet: describe the machine with --machine")
        data = {"machine": machine, "runs": {}}
    elif machine:
        data["machine"] = machine
    for name, path in runs.items():
        text = path.read_text(encoding="utf-8")
        data["runs"][name] = text if path.suffix == ".txt" else json.loads(text)
    data["runs"] = dict(sorted(data["runs"].items()))
    machine_file.parent.mkdir(parents=True, exist_ok=True)
    machine_file.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return data


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("machine_file", type=Path, help="benchmarks/results/machines/<machine>.json")
    parser.add_argument("runs", nargs="+", metavar="NAME=FILE", help="a run's name and the file it wrote")
    parser.add_argument("--machine", help="the machine in words (needed for a new file)")
    args = parser.parse_args(argv)
    runs = {}
    for item in args.runs:
        name, _, path = item.partition("=")
        if not name or not path or not Path(path).is_file():
            parser.error(f"expected NAME=FILE with an existing FILE, got {item!r}")
        runs[name] = Path(path)
    data = add_runs(args.machine_file, runs, args.machine)
    print(f"{args.machine_file}: {len(data['runs'])} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
