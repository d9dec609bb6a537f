"""`focus-hf audit`: how much of the base model's attention mass an adapter's hard pattern keeps, per head."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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


def audit(args: argparse.Namespace, model, tokenizer):
    """`focus_hf.fitting.recall_audit.audit_recall` on held-out blocks of the corpus the parsed `args` name."""
    from focus_hf.data import token_blocks
    from focus_hf.fitting.recall_audit import audit_recall

    _, heldout_texts = split_corpus(args)
    blocks = token_blocks(tokenizer, heldout_texts, args.seq_len, max_blocks=args.max_blocks)
    return audit_recall(
        model, blocks, top_k=args.top_k, queries_per_sequence=args.queries_per_sequence, progress=not args.no_progress
    )


def run(args: argparse.Namespace) -> int:
    """`focus-hf audit`: audit, print the table, write JSON / PNG when asked."""
    folder = adapter_folder(args.adapter, args.revision)
    model, tokenizer = load_with_adapter(base_model_name(args.model, folder), folder)
    model.eval()
    result = audit(args, model, tokenizer)
    print(result.table())
    if args.json is not None:
        write_json(result.to_dict(), args.json)
    if args.png:
        result.save_png(args.png)
        print(f"heatmap written to {args.png}")
    if args.dense_heads:
        from focus_hf.fitting.recall_audit import calibrate_dense_heads

        pairs = calibrate_dense_heads(result, args.dense_heads)
        print(f"\nkv heads losing the most mass (for FocusConfig.dense_heads): {json.dumps(pairs)}")
    if args.retrieval_heads:
        retrieval = audit_retrieval_heads(args, model, tokenizer)
        print(f"\nRetrieval audit ({retrieval.events} distant copy events in synthetic retrieval documents):")
        print(retrieval.table(args.retrieval_heads))
        pairs = sorted([row.layer, row.kv_head] for row in retrieval.ranked()[: args.retrieval_heads])
        print(f"retrieval heads dropping the most copy mass (for FocusConfig.dense_heads): {json.dumps(pairs)}")
    return 0


def audit_retrieval_heads(args: argparse.Namespace, model, tokenizer):
    """`focus_hf.fitting.retrieval_heads.audit_retrieval` on two synthetic retrieval documents of training text."""
    from focus_hf.data import retrieval_documents
    from focus_hf.fitting.retrieval_heads import audit_retrieval

    train_texts, _ = split_corpus(args)
    documents = retrieval_documents(tokenizer, train_texts, args.seq_len, 2, seed=1)
    return audit_retrieval(model, documents, top_k=args.top_k, progress=not args.no_progress)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `audit` sub-command."""
    parser = subparsers.add_parser(
        "audit",
        help="measure the attention mass an adapter keeps, per layer and kv head",
        description="Run the base model on held-out text and report, per layer and kv head, the share of its "
        "attention mass (queries beyond the window) that the adapter's hard pattern keeps: window + sinks alone, "
        "the adapter's top-k groups, and an oracle choosing the best k groups given the same key groups.",
    )
    add_adapter_arguments(parser)
    add_model_option(parser, default=None)
    add_data_options(parser)
    add_option(parser, "--seq-len", type=int, default=4096, help="tokens per audited block (default: 4096)")
    add_option(parser, "--max-blocks", type=int, default=1, help="held-out blocks to audit (default: 1)")
    add_option(parser, "--top-k", type=int, default=None, help="groups probed (default: the adapter's)")
    add_option(parser, "--queries-per-sequence", type=int, default=1024, old=("--queries",),
               help="random queries beyond the window per block (default: 1024)")  # fmt: skip
    add_json_option(parser, "the audit")
    add_option(parser, "--png", type=Path, default=None, help="write a layer x kv-head heatmap PNG")
    add_option(parser, "--dense-heads", type=int, default=0,
               help="also print the N kv heads that lose the most mass (default: 0)")  # fmt: skip
    add_option(
        parser,
        "--retrieval-heads",
        type=int,
        default=0,
        help="also run the retrieval audit and print the N kv heads dropping the most attention on distant copied "
        "tokens (default: 0)",
    )
    add_option(parser, "--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)
