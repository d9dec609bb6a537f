"""`focus-hf compare A B`: two Focus adapters of one base model side by side - their configs, their figures, and how
their groups overlap, layer by layer, on a given text."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from focus_hf.commands.common import CORPUS_HELP, adapter_folder, add_model_option
from focus_hf.commands.options import add_json_option, add_option, write_json


def _config(folder: Path) -> dict[str, Any]:
    from focus_hf.files import CONFIG_NAME

    return json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))


def _figures(folder: Path) -> dict[str, Any]:
    """The adapter's headline figures from its eval_results.json (as its card shows them)."""
    from focus_hf.card import EVAL_RESULTS_NAME
    from focus_hf.hub.eval_results import headline

    path = folder / EVAL_RESULTS_NAME
    results = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    figures = headline(results if isinstance(results, dict) else {}, _config(folder), "")
    return {key: value for key, value in figures.items() if key in ("perplexity_ratio", "speedup", "context_length")}


def key_groups(model, blocks, label: str, progress: bool) -> dict[int, Any]:
    """Layer index -> the group every token of `blocks` is filed under as a key, in hard mode."""
    import torch
    from tqdm.auto import tqdm

    from focus_hf.interpret.groups import record_routing

    collected: dict[int, list] = {}
    with torch.no_grad(), record_routing(model) as recorder:
        for block in tqdm(blocks, desc=label, unit="block", disable=not progress, leave=False):
            model(input_ids=block[None], use_cache=False)
            for index, groups in recorder.key_groups().items():
                collected.setdefault(index, []).append(groups.reshape(-1))
            recorder.take()
    return {index: torch.cat(parts) for index, parts in collected.items()}


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Load both adapters on their base model, route the same text with each, and compare."""
    from focus_hf.commands.common import base_model_name, load_base
    from focus_hf.data import load_texts, token_blocks
    from focus_hf.evaluation import routing_mode
    from focus_hf.files import model_for_adapter
    from focus_hf.interpret.overlap import adjusted_rand_index, matched_share
    from focus_hf.tuner.patches import apply as apply_patches

    folders = [adapter_folder(spec, args.revision) for spec in (args.adapter, args.other)]
    bases = [model_for_adapter(folder) for folder in folders]
    if bases[0] != bases[1] and args.model is None:
        raise SystemExit(
            f"focus-hf compare: {args.adapter} records the base model {bases[0]!r} and {args.other} {bases[1]!r}; "
            "compare adapters of one base (or name it with --model, if they are)."
        )
    model_name = base_model_name(args.model, folders[0])
    print(f"loading {model_name} with {args.adapter} and {args.other}", file=sys.stderr)
    model, tokenizer = load_base(model_name)
    apply_patches()
    from peft import PeftModel

    model = PeftModel.from_pretrained(model, str(folders[0]), adapter_name="a").eval()
    model.load_adapter(str(folders[1]), adapter_name="b")
    blocks = token_blocks(tokenizer, load_texts(args.data), args.seq_len, max_blocks=args.max_blocks)
    groups = {}
    for name, label in (("a", args.adapter), ("b", args.other)):
        model.set_adapter(name)
        with routing_mode(model, "hard", None):
            groups[name] = key_groups(model, blocks, f"routing with {label}", not args.no_progress)
    layers = sorted(set(groups["a"]) & set(groups["b"]))
    configs = [_config(folder) for folder in folders]
    keys = sorted((set(configs[0]) | set(configs[1])) - {"auto_mapping", "peft_type", "inference_mode"})
    return {
        "adapters": [args.adapter, args.other],
        "base_model": model_name,
        "config": {key: [configs[0].get(key), configs[1].get(key)] for key in keys},
        "figures": [_figures(folder) for folder in folders],
        "text": {"data": str(args.data), "blocks": int(blocks.shape[0]), "seq_len": args.seq_len},
        "layers": [
            {
                "layer": layer,
                "adjusted_rand_index": round(adjusted_rand_index(groups["a"][layer], groups["b"][layer]), 4),
                "matched_share": round(matched_share(groups["a"][layer], groups["b"][layer]), 4),
            }
            for layer in layers
        ],
    }


def run(args: argparse.Namespace) -> int:
    from focus_hf.commands.common import print_table

    result = compare(args)
    if args.json is not None:
        write_json(result, args.json)
        if args.json == "-":
            return 0
    a, b = result["adapters"]
    print(f"Configs ({a} | {b}; * differs):")
    print_table(
        [(("* " if x != y else "  ") + key, json.dumps(x), json.dumps(y)) for key, (x, y) in result["config"].items()],
        ("option", "A", "B"),
    )
    print("\nFigures (from each adapter's eval_results.json):")
    names = ("perplexity_ratio", "speedup", "context_length")
    print_table([(name, *(str(f.get(name, "n/a")) for f in result["figures"])) for name in names], ("", "A", "B"))
    text = result["text"]
    print(f"\nGroups on {text['blocks']} blocks of {text['seq_len']} tokens of {text['data']} (1: the same grouping):")
    rows = [(str(r["layer"]), f"{r['adjusted_rand_index']:.3f}", f"{r['matched_share']:.1%}") for r in result["layers"]]
    print_table(rows, ("layer", "adjusted Rand index", "tokens in the matching group"))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="set two Focus adapters of one base side by side: configs, figures, group overlap per layer",
        description="Compare two Focus adapters of one base model: their configurations option by option, the "
        "figures of their eval_results.json, and, on the same text routed in hard mode by each, how their groups "
        "overlap in every layer (adjusted Rand index: 1 when both group the tokens alike, about 0 when as by chance; "
        "and the share of tokens that B puts in the group holding most of their A group).",
    )
    parser.add_argument("adapter", metavar="A", help="a Focus adapter: a folder or a Hub id (namespace/name)")
    parser.add_argument("other", metavar="B", help="another Focus adapter of the same base model")
    add_option(parser, "--revision", help="branch, tag or commit of the Hub adapters (default: main)")
    add_model_option(parser, default=None)
    add_option(parser, "--data", default="python-docs", help=f"{CORPUS_HELP} (default: python-docs)")
    add_option(parser, "--seq-len", type=int, default=512, help="tokens per block (default: 512)")
    add_option(parser, "--max-blocks", type=int, default=2, help="blocks routed (default: 2)")
    add_json_option(parser, "the comparison")
    add_option(parser, "--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)
