"""The `focus-hf` command line: one sub-command per module, each registering its own parser."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

# Sub-command modules; each exposes `register(subparsers)` that adds a parser with `func` set. Imported lazily
# per command so that `focus-hf --help` stays fast.
COMMAND_MODULES = {
    "info": "focus_hf.commands.info",
    "push": "focus_hf.commands.push",
    "pull": "focus_hf.commands.pull",
    "card": "focus_hf.commands.card",
    "inspect": "focus_hf.commands.inspect",
    "train": "focus_hf.commands.train",
    "eval": "focus_hf.commands.eval",
    "audit": "focus_hf.commands.audit",
    "demo": "focus_hf.commands.demo",
    "bench": "focus_hf.commands.bench",
    "search": "focus_hf.commands.search",
    "compare": "focus_hf.commands.compare",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="focus-hf",
        description="Focus learned sparse attention as a PEFT adapter type for Hugging Face transformers: distil or "
        "train the routers of an adapter, evaluate and audit it, see what its groups learned, and share it on the Hub "
        "(push, pull, card, search, compare). An ADAPTER is a folder or a Hub id, read at --revision.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES.values():
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
