"""`focus-hf search BASE`: the Focus adapters shared on the Hub for a base model, with each card's headline figures."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from focus_hf.commands.options import add_json_option, add_option, write_json


def _shown(value, text: str = "{}") -> str:
    return "n/a" if value is None else text.format(value)


def run(args: argparse.Namespace) -> int:
    from focus_hf.commands.common import print_table
    from focus_hf.hub import FocusHubError
    from focus_hf.hub.discovery import search_adapters
    from focus_hf.hub.integrity import transport_errors

    try:
        found = search_adapters(args.base, limit=args.limit)
    except (FocusHubError, ValueError, *transport_errors()) as error:
        print(f"focus-hf search: error: {error}", file=sys.stderr)
        return 1
    if args.json is not None:
        write_json([dataclasses.asdict(adapter) for adapter in found], args.json)
        if args.json == "-":
            return 0
    if not found:
        print(f"No Focus adapter on the Hub names {args.base} as its base model.")
        return 0
    rows = [
        (
            adapter.repo_id,
            _shown(adapter.num_groups),
            _shown(adapter.top_k),
            _shown(adapter.window),
            _shown(adapter.perplexity_ratio, "{:.3f}x"),
            _shown(adapter.speedup, "{:.2f}x"),
            _shown(adapter.context_length, "{:,}"),
        )
        for adapter in found
    ]
    print(f"Focus adapters of {args.base} on the Hub (figures from each model card):")
    print_table(rows, ("adapter", "groups", "top-k", "window", "perplexity vs base", "speed-up", "measured at tokens"))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "search",
        help="list the Focus adapters shared on the Hub for a base model, with their headline figures",
        description="List the Focus adapters on the Hugging Face Hub whose model card names BASE as the base model "
        "they adapt (the Hub's focus-hf tag and base_model filters), newest first, with the figures each card "
        "gives: groups, top-k, window, hard-routing perplexity against the base model's on the same text, prefill "
        "speed-up, and the length they were measured at.",
    )
    parser.add_argument("base", metavar="BASE", help="the base model's Hub id, namespace/name")
    add_option(parser, "--limit", type=int, default=50, help="list at most this many adapters (default: 50)")
    add_json_option(parser, "the list")
    parser.set_defaults(func=run)
