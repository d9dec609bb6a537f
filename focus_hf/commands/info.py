"""`focus-hf info`: an adapter's configuration, size and base model (without loading any model), or, with
`--config`, what an adapter for a base model would cost (the model built on the meta device, no weights)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from focus_hf.defaults import FOCUS_DEFAULTS
from focus_hf.files import adapter_summary


def _run_sizing(args: argparse.Namespace) -> int:
    from focus_hf.sizing import adapter_size

    options = {"num_groups": args.num_groups, "group_dim": args.group_dim}
    if args.query_projection:
        options["query_projection"] = True
    size = adapter_size(args.config, **options)
    if args.json:
        print(json.dumps(size, indent=2))
        return 0
    print(f"Focus adapter for {args.config} (K={args.num_groups}, d_g={args.group_dim})")
    print(f"  base model:           {size['model_type']}, {size['base_parameters']:,} parameters (not allocated)")
    print(f"  routed layers:        {size['routed_layers']} (hidden size {size['hidden_size']})")
    print(f"  adapter parameters:   {size['parameters']:,} in {size['tensors']} tensors")
    print(f"  adapter_model.safetensors: {size['file_bytes']:,} bytes ({size['file_bytes'] / 2**20:.2f} MiB)")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.config is not None:
        if args.adapter is not None:
            raise SystemExit("focus-hf info: give an ADAPTER folder or --config CONFIG, not both.")
        return _run_sizing(args)
    if args.adapter is None:
        raise SystemExit("focus-hf info: give an ADAPTER folder, or --config CONFIG.json to size a new adapter.")
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
    parser = subparsers.add_parser(
        "info",
        help="print an adapter's config, parameter count and base model, or (--config) size an adapter for a base",
    )
    parser.add_argument("adapter", nargs="?", help="adapter folder")
    parser.add_argument(
        "--config",
        help="size an adapter for this base model instead (config.json, model folder or Hub id); the model is "
        "built on the meta device, no weights are allocated",
    )
    parser.add_argument("--num-groups", type=int, default=FOCUS_DEFAULTS["num_groups"], help="K (with --config)")
    parser.add_argument("--group-dim", type=int, default=FOCUS_DEFAULTS["group_dim"], help="d_g (with --config)")
    parser.add_argument("--query-projection", action="store_true", help="size a separate query router too")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)
