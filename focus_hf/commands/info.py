"""`focus-hf info`: an adapter's configuration, size and base model (without loading any model), or, with
`--config`, what an adapter for a base model would cost (the model built on the meta device, no weights)."""

from __future__ import annotations

import argparse

from focus_hf.commands.common import adapter_folder, add_adapter_arguments, add_focus_options
from focus_hf.commands.options import add_json_option, add_option, write_json


def _run_sizing(args: argparse.Namespace) -> int:
    from focus_hf.sizing import adapter_size

    options = {"num_groups": args.num_groups, "group_dim": args.group_dim}
    if args.query_projection:
        options["query_projection"] = True
    size = adapter_size(args.config, **options)
    if args.json is not None:
        write_json(size, args.json)
        return 0
    print(f"Focus adapter for {args.config} (K={args.num_groups}, d_g={args.group_dim})")
    print(f"  base model:           {size['model_type']}, {size['base_parameters']:,} parameters (not allocated)")
    print(f"  routed layers:        {size['routed_layers']} (hidden size {size['hidden_size']})")
    print(f"  adapter parameters:   {size['parameters']:,} in {size['tensors']} tensors")
    print(f"  adapter_model.safetensors: {size['file_bytes']:,} bytes ({size['file_bytes'] / 2**20:.2f} MiB)")
    return 0


def run(args: argparse.Namespace) -> int:
    from focus_hf.files import adapter_summary

    if args.config is not None:
        if args.adapter is not None:
            raise SystemExit("focus-hf info: give an ADAPTER or --config CONFIG, not both.")
        return _run_sizing(args)
    if args.adapter is None:
        raise SystemExit("focus-hf info: give an ADAPTER (folder or Hub id), or --config CONFIG to size a new adapter.")
    summary = adapter_summary(adapter_folder(args.adapter, args.revision))
    if args.json is not None:
        write_json(summary, args.json)
        return 0
    print(f"Focus adapter {args.adapter}" + (f" (revision {args.revision})" if args.revision else ""))
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
        description="Print a Focus adapter's configuration, its router parameters and the base model it records, "
        "without loading any model. With --config, size an adapter for a base model instead (built on the meta "
        "device: no weights are allocated).",
    )
    add_adapter_arguments(parser)
    add_option(
        parser,
        "--config",
        help="size an adapter for this base model instead (config.json, model folder or Hub id)",
    )
    sizing = parser.add_argument_group("sizing (--config)")
    add_focus_options(sizing, fields=("num_groups", "group_dim"))
    add_option(
        sizing,
        "--query-projection",
        action="store_true",
        old=("--query-router",),
        help="size a query-side router too (FocusConfig.query_projection)",
    )
    add_json_option(parser, "the configuration or the sizing")
    parser.set_defaults(func=run)
