"""`focus-hf info ADAPTER`: an adapter's configuration, size and base model, without loading any model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from focus_hf.files import adapter_summary


def run(args: argparse.Namespace) -> int:
    summary = adapter_summary(Path(args.adapter))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"Focus adapter {args.adapter}")
    print(f"  base model:           {summary['base_model']} ({summary['base_model_type']})")
    print(f"  parameters:           {summary['parameters']:,} in {summary['routed_layers']} routed attention layers")
    print(
        f"  weights file:         {summary['weights_bytes']:,} bytes"
        if summary["weights_bytes"]
        else "  weights file:         missing"
    )
    for key, value in summary["config"].items():
        print(f"  {key + ':':<22}{value}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("info", help="print an adapter's config, parameter count and base model")
    parser.add_argument("adapter", help="adapter folder")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)
