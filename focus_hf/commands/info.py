"""`focus-hf info ADAPTER`: an adapter's configuration, size and base model, without loading any model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..adapter_files import CONFIG_NAME, WEIGHTS_NAME, AdapterFileError, read_safetensors_header


def adapter_summary(folder: Path) -> dict:
    """Config, parameter count, file size and base model of a local adapter folder."""
    config_path = folder / CONFIG_NAME
    if not config_path.is_file():
        raise AdapterFileError(f"{folder} has no {CONFIG_NAME}: not an adapter folder.")
    config = json.loads(config_path.read_text())
    if config.get("peft_type") != "FOCUS":
        raise AdapterFileError(f"{folder} holds a {config.get('peft_type')!r} adapter, not a Focus adapter.")
    weights = folder / WEIGHTS_NAME
    tensors = read_safetensors_header(weights) if weights.is_file() else {}
    parameters = 0
    for _, shape in tensors.values():
        count = 1
        for dim in shape:
            count *= dim
        parameters += count
    return {
        "base_model": config.get("base_model_name_or_path"),
        "base_model_type": config.get("base_model_type"),
        "parameters": parameters,
        "routed_layers": config.get("num_routed_layers"),
        "weights_bytes": weights.stat().st_size if weights.is_file() else None,
        "config": {k: config[k] for k in ("num_groups", "group_dim", "window", "top_k", "sink_tokens", "temperature", "sinkhorn_iterations", "routing_mode") if k in config},
    }


def run(args: argparse.Namespace) -> int:
    summary = adapter_summary(Path(args.adapter))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"Focus adapter {args.adapter}")
    print(f"  base model:           {summary['base_model']} ({summary['base_model_type']})")
    print(f"  parameters:           {summary['parameters']:,} in {summary['routed_layers']} routed attention layers")
    print(f"  weights file:         {summary['weights_bytes']:,} bytes" if summary["weights_bytes"] else "  weights file:         missing")
    for key, value in summary["config"].items():
        print(f"  {key + ':':<22}{value}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("info", help="print an adapter's config, parameter count and base model")
    parser.add_argument("adapter", help="adapter folder")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)
