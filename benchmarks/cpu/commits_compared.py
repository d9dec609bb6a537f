"""One `focus-hf` benchmark command run on two commits in turn, on one machine, in one run: are the figures unchanged?

    python benchmarks/cpu/commits_compared.py --base 72dbefa --rounds 3 --out benchmarks/results/commits/NAME.json \
        -- bench --seq-lens 1024 4096 16384 --top-k 1 2

The base commit is checked out into a temporary git worktree; the head is this checkout as it is. Each round runs the
command (`python -m focus_hf.cli ARGS --json FILE`) once per side, in the order base, head, then head, base in the
next round, so that a drift of the machine's speed over the run falls on both sides alike; each side imports its own
tree's focus_hf (PYTHONPATH), and its C kernels are built for its own sources before the first timed round (a
warm-up run of each side, not recorded). Options the two commits name differently must be given by a name both
accept (focus-hf keeps its former option names working).

Per row of the command's output (a row is matched by its fields that are not timings), the JSON holds each side's
median over the rounds of every timing field (`*_s`) and ratio (`speedup`, `cpu_speedup`), and head over base for
each: 1.0 means unchanged. Noise is the spread of the rounds, recorded as each side's minimum and maximum.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from focus_hf.benchmarking.records import log, provenance, repository_of, script_command, write_json

RATIOS = ("speedup", "cpu_speedup")
# Fields that vary from run to run without describing the row.
RUN_FIELDS = {"date", "git_commit", "command", "load_avg_1m", "other_cores_busy", "repeats", "cpu_kernels"}


def _is_measure(name: str) -> bool:
    return name.endswith("_s") or name in RATIOS


def _describing(row: dict[str, Any]) -> set[str]:
    return {name for name in row if not _is_measure(name) and name not in RUN_FIELDS}


def row_key(row: dict[str, Any], names: set[str]) -> tuple:
    """What identifies a row of the command's output: the values of its fields `names` (fields that are neither
    measured nor about the run, and that both commits write)."""
    return tuple((name, json.dumps(row.get(name), sort_keys=True)) for name in sorted(names))


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def compare(base_runs: list[list[dict]], head_runs: list[list[dict]]) -> list[dict[str, Any]]:
    """Rows present on both sides: each measured field's median (and spread) per side, and head / base of the medians.

    Raises:
        ValueError: when the two sides' commands gave rows that do not match (different options, a failed run).
    """
    all_rows = [row for runs in (base_runs, head_runs) for run in runs for row in run]
    names = set.intersection(*(_describing(row) for row in all_rows))
    keys = {row_key(row, names) for run in base_runs for row in run}
    head_keys = {row_key(row, names) for run in head_runs for row in run}
    if keys != head_keys:
        apart = keys ^ head_keys
        differing = sorted({name for key in apart for name, _ in key if len({dict(k)[name] for k in apart}) > 1})
        raise ValueError(
            f"the base's and the head's rows differ (in {', '.join(differing) or 'number'}): the command does not mean "
            "the same on both commits"
        )
    compared = []
    for key in sorted(keys):
        sides = {}
        for side, runs in (("base", base_runs), ("head", head_runs)):
            rows = [row for run in runs for row in run if row_key(row, names) == key]
            measures = sorted({name for row in rows for name in row if _is_measure(name)})
            sides[side] = {
                name: _summary([row[name] for row in rows if isinstance(row.get(name), (int, float))])
                for name in measures
                if all(isinstance(row.get(name), (int, float)) for row in rows)
            }
        shared = sorted(set(sides["base"]) & set(sides["head"]))
        medians = {side: {name: sides[side][name]["median"] for name in shared} for side in sides}
        compared.append(
            {
                "row": {name: json.loads(value) for name, value in key},
                "base": sides["base"],
                "head": sides["head"],
                "head_over_base": {name: medians["head"][name] / medians["base"][name] for name in shared},
            }
        )
    return compared


def _run(tree: Path, arguments: list[str], json_path: Path) -> list[dict]:
    environment = {**os.environ, "PYTHONPATH": str(tree), "FOCUS_HF_GIT_COMMIT": ""}
    command = [sys.executable, "-m", "focus_hf.cli", *arguments, "--json", str(json_path)]
    log(f"{tree.name}: {shlex.join(command[1:])}")
    subprocess.run(command, cwd=tree, env=environment, check=True, stdout=subprocess.DEVNULL)
    rows = json.loads(json_path.read_text())
    return rows if isinstance(rows, list) else rows["rows"]


def _commit(tree: Path, revision: str = "HEAD") -> str:
    return subprocess.run(
        ["git", "-C", str(tree), "rev-parse", revision], capture_output=True, text=True, check=True
    ).stdout.strip()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit (or any git revision) to compare against")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each side (default 3)")
    parser.add_argument("--out", type=Path, help="write the comparison as JSON here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the focus-hf command and its options")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or "--json" in command:
        parser.error("give the focus-hf command after `--`, without --json (each run writes its own)")
    head = repository_of(__file__)
    with tempfile.TemporaryDirectory(prefix="focus-hf-compare-") as scratch:
        base = Path(scratch) / "base"
        subprocess.run(["git", "-C", str(head), "worktree", "add", "--detach", str(base), args.base], check=True)
        try:
            trees = {"base": base, "head": head}
            for side, tree in trees.items():  # builds each side's C kernels; not recorded
                _run(tree, command, Path(scratch) / f"{side}-warm-up.json")
            runs: dict[str, list[list[dict]]] = {"base": [], "head": []}
            for round_index in range(args.rounds):
                order = ("base", "head") if round_index % 2 == 0 else ("head", "base")
                for side in order:
                    runs[side].append(_run(trees[side], command, Path(scratch) / f"{side}-{round_index}.json"))
            base_commit = _commit(base)
        finally:
            subprocess.run(["git", "-C", str(head), "worktree", "remove", "--force", str(base)], check=False)
    result = {
        **provenance(torch.device("cpu"), script_command(__file__, argv)),
        "what": "one focus-hf command on two commits in turn (base, head; then head, base), medians over the rounds",
        "focus_hf_command": shlex.join(["focus-hf", *command]),
        "base_commit": base_commit,
        "rounds": args.rounds,
        "rows": compare(runs["base"], runs["head"]),
    }
    for row in result["rows"]:
        described = ", ".join(f"{k} {v}" for k, v in row["row"].items() if k in ("seq_len", "cache_len", "top_k"))
        ratios = ", ".join(f"{name} {value:.3f}" for name, value in row["head_over_base"].items() if name in RATIOS)
        log(f"{described}: head / base {ratios}")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
