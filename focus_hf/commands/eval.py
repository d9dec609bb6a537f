"""`focus-hf eval`: perplexity of a base model, with or without a Focus adapter, on held-out text."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from focus_hf.commands.common import (
    add_data_options,
    add_model_option,
    base_model_name,
    load_with_adapter,
    split_corpus,
)


def evaluate(args: argparse.Namespace) -> dict:
    """Load the model (and adapter) the parsed `args` name and return `evaluation.perplexity`'s dict."""
    from focus_hf.evaluation import perplexity

    if args.mode != "full" and not args.adapter:
        raise SystemExit(f"focus-hf eval: --mode {args.mode} needs --adapter (only --mode full runs without one)")
    model_name = base_model_name(args.model, args.adapter)
    model, tokenizer = load_with_adapter(model_name, args.adapter)
    train_texts, heldout_texts = split_corpus(args)
    texts = {"heldout": heldout_texts, "train": train_texts, "all": train_texts + heldout_texts}[args.split]
    result = perplexity(
        model,
        tokenizer,
        texts,
        seq_len=args.seq_len,
        stride=args.stride,
        mode=args.mode,
        top_k=args.top_k,
        max_blocks=args.max_blocks,
        batch_size=args.batch_size,
        backend=args.backend,
        progress=not args.no_progress,
    )
    result.update(
        {
            "model": model_name,
            "adapter": args.adapter,
            "data": str(args.data),
            "split": args.split,
            "heldout_fraction": args.heldout_fraction,
            "split_seed": args.split_seed,
        }
    )
    return result


def run(args: argparse.Namespace) -> int:
    """`focus-hf eval`: evaluate, then print the result (or write it as JSON)."""
    result = evaluate(args)
    if args.json is not None:
        text = json.dumps(result, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n", encoding="utf-8")
            print(f"wrote {args.json}", file=sys.stderr)
    if args.json != "-":
        top_k = f" top-{result['top_k']}" if result["mode"] != "full" and result["top_k"] else ""
        print(
            f"{result['mode']}{top_k}: perplexity {result['ppl']:.3f} over {result['tokens']:,} tokens "
            f"({result['windows']} windows of {result['seq_len']}, stride {result['stride']}) "
            f"in {result['seconds']:.1f} s"
        )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `eval` sub-command."""
    parser = subparsers.add_parser(
        "eval",
        help="perplexity with full attention or a Focus adapter (soft / hard routing)",
        description="Perplexity over strided windows of held-out text. --mode full runs the base model (adapter "
        "disabled); soft runs the differentiable training-time routing; hard the sparse inference pattern.",
    )
    add_model_option(parser, default=None)
    parser.add_argument("--adapter", default=None, help="Focus adapter folder (required unless --mode full)")
    add_data_options(parser)
    parser.add_argument(
        "--split", choices=("heldout", "train", "all"), default="heldout", help="documents to score (default: heldout)"
    )
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per window (default: 1024)")
    parser.add_argument("--stride", type=int, default=None, help="distance between windows (default: seq-len)")
    parser.add_argument("--mode", choices=("full", "soft", "hard"), default="hard", help="default: hard")
    parser.add_argument(
        "--top-k", type=int, default=None, help="groups per query in hard mode (default: the adapter's)"
    )
    parser.add_argument("--max-blocks", type=int, default=None, help="score at most this many windows")
    parser.add_argument("--batch-size", type=int, default=1, help="windows per forward pass (default: 1)")
    parser.add_argument("--backend", default=None, help="hard-mode attention backend (default: auto)")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="print the result as JSON (or write it to PATH)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)
