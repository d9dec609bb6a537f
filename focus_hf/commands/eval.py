"""`focus-hf eval`: perplexity of a base model, with or without a Focus adapter, on held-out text."""

from __future__ import annotations

import argparse

from focus_hf.commands.common import (
    adapter_folder,
    add_adapter_arguments,
    add_data_options,
    add_model_option,
    base_model_name,
    load_with_adapter,
    split_corpus,
)
from focus_hf.commands.options import add_json_option, add_option, write_json


def evaluate(args: argparse.Namespace) -> dict:
    """Load the model (and adapter) the parsed `args` name and return `evaluation.perplexity`'s dict."""
    from focus_hf.evaluation import perplexity

    if args.mode != "full" and not args.adapter:
        raise SystemExit(
            f"focus-hf eval: --mode {args.mode} needs an ADAPTER, a folder or a Hub id (the former --adapter still "
            "works); only --mode full runs without one."
        )
    folder = adapter_folder(args.adapter, args.revision) if args.adapter else None
    model_name = base_model_name(args.model, folder)
    model, tokenizer = load_with_adapter(model_name, folder)
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
            "revision": args.revision,
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
        write_json(result, args.json)
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
    add_adapter_arguments(parser, what=" (needed unless --mode full)")
    add_model_option(parser, default=None)
    add_data_options(parser)
    add_option(parser, "--split", choices=("heldout", "train", "all"), default="heldout",
               help="documents to score (default: heldout)")  # fmt: skip
    add_option(parser, "--seq-len", type=int, default=1024, help="tokens per window (default: 1024)")
    add_option(parser, "--stride", type=int, default=None, help="distance between windows (default: seq-len)")
    add_option(parser, "--mode", choices=("full", "soft", "hard"), default="hard",
               help="full: the base model; soft: the training-time routing; hard: the sparse pattern (default)",
               )  # fmt: skip
    add_option(parser, "--top-k", type=int, default=None, help="groups per query in hard mode (default: the adapter's)")
    add_option(parser, "--max-blocks", type=int, default=None, help="score at most this many windows")
    add_option(parser, "--batch-size", type=int, default=1, help="windows per forward pass (default: 1)")
    add_option(parser, "--backend", default=None, help="hard-mode attention backend (default: auto)")
    add_json_option(parser, "the result")
    add_option(parser, "--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)
