"""`focus-hf card ADAPTER`: write the adapter's Hub model card (README.md) from the files in the folder."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from focus_hf.commands.common import add_data_options, add_model_option
from focus_hf.commands.options import add_option


def corpus_record(data: str) -> dict:
    """How eval_results.json records the corpus `data`: a Hub dataset pinned to the commit it was read at (with the
    task ids of a Hub benchmark), a built-in corpus by name, a local file or folder by its name only (its path is
    nobody else's business and no dataset the Hub knows)."""
    from focus_hf.hub.datasets import fetch_hub_corpus, parse_hub_dataset

    hub = parse_hub_dataset(data)
    if hub is not None:
        corpus = fetch_hub_corpus(hub)
        record = {"data": corpus.dataset.spec}
        return {**record, "benchmark_tasks": corpus.benchmark_tasks} if corpus.benchmark_tasks else record
    if Path(data).expanduser().exists():
        return {"data_file": Path(data).name}
    return {"data": str(data)}


def measure(args: argparse.Namespace, folder: Path) -> dict:
    """Perplexity of the base model (full attention) and of the adapter (soft, hard) on held-out documents of
    `--data`, merged into ADAPTER/eval_results.json (other keys there, e.g. "speed", are kept)."""
    from focus_hf.card import EVAL_RESULTS_NAME
    from focus_hf.commands.common import base_model_name, load_with_adapter, split_corpus
    from focus_hf.evaluation import perplexity

    record = corpus_record(args.data)
    _, heldout = split_corpus(args)
    if not heldout:
        raise ValueError(
            f"--data {args.data} leaves no held-out document at --heldout-fraction {args.heldout_fraction}."
        )
    model_name = base_model_name(args.model, folder)
    model, tokenizer = load_with_adapter(model_name, folder)
    model.eval()
    path = folder / EVAL_RESULTS_NAME
    results = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    for mode in ("full", "soft", "hard"):
        print(f"perplexity, {mode} attention:", file=sys.stderr)
        result = perplexity(
            model, tokenizer, heldout, seq_len=args.seq_len, mode=mode, max_blocks=args.max_blocks,
            progress=not args.no_progress,
        )  # fmt: skip
        result.update({**record, "split": "heldout", "model": model_name})
        results[mode] = result
        print(f"{mode}: perplexity {result['ppl']:.3f} over {result['tokens']:,} tokens", file=sys.stderr)
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


def base_license(folder: Path) -> Optional[dict]:
    """The license of the adapter's base model, read from its card on the Hub (None, with a note on stderr, when
    the base is no Hub model or its card cannot be read)."""
    from huggingface_hub import constants

    from focus_hf.card import hub_base_model
    from focus_hf.files import model_for_adapter
    from focus_hf.hub.eval_results import base_model_license
    from focus_hf.hub.integrity import transport_errors

    base = hub_base_model(model_for_adapter(folder))
    if base is None or constants.is_offline_mode():
        return None
    try:
        return base_model_license(base)
    except transport_errors() as error:
        print(f"focus-hf card: the license of {base} could not be read ({type(error).__name__}); "
              "pass --license to set one.", file=sys.stderr)  # fmt: skip
        return None


def run(args: argparse.Namespace) -> int:
    from focus_hf.card import write_model_card
    from focus_hf.files import AdapterFileError

    folder = Path(args.adapter)
    if not folder.is_dir():
        print(
            f"focus-hf card: error: {args.adapter} is no adapter folder. The card is written into the folder: for "
            "an adapter on the Hub, pull it first (focus-hf pull REPO_ID --local-dir DIR).",
            file=sys.stderr,
        )
        return 1
    try:
        if args.data:
            measure(args, folder)
        license_metadata = None if args.license else base_license(folder)
        path = write_model_card(folder, repo_id=args.repo_id, license=args.license, base_license=license_metadata)
    except (AdapterFileError, ValueError) as error:
        print(f"focus-hf card: error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "card",
        help="write the model card (README.md) of a Focus adapter folder",
        description="Write README.md (YAML metadata for the Hub + a description) from adapter_config.json, the "
        "weights, and when present training_log.json, eval_results.json ({'full': {'ppl': ..}, 'soft': .., "
        "'hard': .., 'speed': ..}) and interpretability.json (`focus-hf inspect --report-dir`). An existing README.md "
        "keeps everything but its metadata and the sections focus-hf generates. The license is the base model's "
        "(read from its card on the Hub) unless --license. With --data, first measures the perplexities on held-out "
        "documents of that corpus.",
    )
    parser.add_argument("adapter", metavar="ADAPTER", help="the adapter folder the card is written into")
    add_option(parser, "--repo-id", help="Hub id shown in the loading lines (default: a placeholder)")
    add_option(parser, "--license", help="the card's license, a Hub license id (default: the base model's)")
    evaluation = parser.add_argument_group("measuring (--data)")
    add_data_options(evaluation, default=None, old=("--eval-data",))
    add_model_option(evaluation, default=None)
    add_option(evaluation, "--seq-len", type=int, default=512, help="tokens per window (default: 512)")
    add_option(evaluation, "--max-blocks", type=int, default=8, help="windows scored per mode (default: 8)")
    add_option(evaluation, "--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)
