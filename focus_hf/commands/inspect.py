"""`focus-hf inspect`: what each Focus group routes, per layer (token share, confidence, token categories)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def save_report(report: dict, folder: Path, *, title: str) -> list[Path]:
    """Write `report` as `folder/interpretability.json` and its chart as `folder/group_balance.png` (when
    matplotlib is installed; otherwise a note on stderr says how to get it). Returns the files written."""
    from focus_hf.card import INTERPRETABILITY_NAME
    from focus_hf.interpret.chart import BALANCE_CHART_NAME, MATPLOTLIB_HINT, write_balance_chart
    from focus_hf.interpret.report import report_json

    folder.mkdir(parents=True, exist_ok=True)
    report_path = folder / INTERPRETABILITY_NAME
    report_path.write_text(report_json(report) + "\n", encoding="utf-8")
    written = [report_path]
    chart = write_balance_chart(report, folder / BALANCE_CHART_NAME, title=title)
    if chart is not None:
        written.append(chart)
    else:
        print(f"no {BALANCE_CHART_NAME}: matplotlib is not installed ({MATPLOTLIB_HINT})", file=sys.stderr)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return written


def run(args: argparse.Namespace) -> int:
    from focus_hf.commands.common import adapter_folder, base_model_name, load_with_adapter
    from focus_hf.data import load_texts, token_blocks
    from focus_hf.interpret.page import render_html
    from focus_hf.interpret.report import inspect_groups, report_json

    folder = adapter_folder(args.adapter, args.revision)
    model, tokenizer = load_with_adapter(base_model_name(args.model, folder), folder)
    model.eval()
    blocks = token_blocks(tokenizer, load_texts(args.data), args.seq_len, max_blocks=args.max_blocks)
    print(f"routing {blocks.shape[0]} blocks of {args.seq_len} tokens", file=sys.stderr)
    report = inspect_groups(model, tokenizer, blocks, top_tokens=args.top_tokens)
    if args.html:
        Path(args.html).write_text(render_html(report, title=f"Focus groups of {args.adapter}"), encoding="utf-8")
        print(f"wrote {args.html}", file=sys.stderr)
    if args.report_dir:
        save_report(report, Path(args.report_dir), title=f"Focus group balance of {args.adapter}")
    if args.json is not None:
        text = report_json(report)
        if args.json == "-":
            print(text)
            return 0
        Path(args.json).write_text(text + "\n", encoding="utf-8")
        print(f"wrote {args.json}", file=sys.stderr)
    print(report["summary"])
    for layer in report["layers"]:
        print(f"layer {layer['layer']} (mean confidence {layer['mean_confidence']:.2f})")
        for group in layer["groups"]:
            if not group["tokens"]:
                print(f"  group {group['group']:>2}: empty")
                continue
            tokens = " ".join(repr(text) for text, _ in group["top_tokens"][:6])
            print(
                f"  group {group['group']:>2}: {group['share']:6.1%} of tokens, "
                f"confidence {group['mean_confidence']:.2f}, "
                  f"{group['purity']:.0%} {group['dominant_category']}; {tokens}")  # fmt: skip
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from focus_hf.commands.common import CORPUS_HELP, add_adapter_arguments, add_model_option
    from focus_hf.commands.options import add_json_option, add_option

    parser = subparsers.add_parser(
        "inspect",
        help="show what each Focus group routes, per layer",
        description="Run the adapter in hard mode over text and report, per layer and group: token share, mean "
        "assignment confidence, most frequent tokens, token-category mix (closed word lists), dominant category "
        "and purity. --json writes the report; --report-dir DIR saves it as DIR/interpretability.json with the "
        "group-balance chart DIR/group_balance.png (matplotlib), which `focus-hf card` puts in the model card when DIR "
        "is the adapter folder; --html writes a page with the tokens coloured by group and a layer switcher.",
    )
    add_adapter_arguments(parser)
    add_model_option(parser, default=None)
    add_option(parser, "--data", default="python-docs", help=f"{CORPUS_HELP} (default: python-docs)")
    add_option(parser, "--seq-len", type=int, default=512, help="tokens per block (default: 512)")
    add_option(parser, "--max-blocks", type=int, default=4, help="blocks to route (default: 4)")
    add_option(parser, "--top-tokens", type=int, default=10, help="frequent tokens listed per group (default: 10)")
    add_json_option(parser, "the report")
    add_option(parser, "--html", metavar="PAGE", help="write an HTML page with tokens coloured by group")
    add_option(parser, "--report-dir", metavar="DIR", old=("--out",),
               help="write DIR/interpretability.json and DIR/group_balance.png (e.g. the adapter folder, for "
               "`focus-hf card`)")  # fmt: skip
    parser.set_defaults(func=run)
