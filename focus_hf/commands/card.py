"""`focus-hf card ADAPTER_DIR`: write the adapter's Hub model card (README.md) from the files in the folder."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def measure(args: argparse.Namespace) -> dict:
    """Perplexity of the base model (full attention) and of the adapter (soft, hard) on held-out `--eval-data`,
    merged into ADAPTER_DIR/eval_results.json (other keys there, e.g. "speed", are kept)."""
    from focus_hf.card import EVAL_RESULTS_NAME
    from focus_hf.commands.common import base_model_name, load_with_adapter
    from focus_hf.data import load_texts, split_texts
    from focus_hf.evaluation import perplexity

    folder = Path(args.adapter)
    _, heldout = split_texts(load_texts(args.eval_data), heldout_fraction=args.heldout_fraction, seed=args.split_seed)
    if not heldout:
        raise ValueError(
            f"--eval-data {args.eval_data} leaves no held-out document at --heldout-fraction {args.heldout_fraction}."
        )
    model_name = base_model_name(args.model, folder)
    model, tokenizer = load_with_adapter(model_name, folder)
    model.eval()
    path = folder / EVAL_RESULTS_NAME
    results = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    # The card's model-index names a built-in corpus; a local file or folder is no dataset the Hub knows (and its
    # path is nobody else's business): only its name is recorded, apart.
    local = Path(args.eval_data).expanduser().exists()
    data = {"data_file": Path(args.eval_data).name} if local else {"data": str(args.eval_data)}
    for mode in ("full", "soft", "hard"):
        result = perplexity(model, tokenizer, heldout, seq_len=args.seq_len, mode=mode, max_blocks=args.max_blocks)
        result.update({**data, "split": "heldout", "model": model_name})
        results[mode] = result
        print(f"{mode}: perplexity {result['ppl']:.3f} over {result['tokens']:,} tokens", file=sys.stderr)
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


def base_license(folder: Path) -> dict | None:
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

    try:
        if args.eval_data:
            measure(args)
        license_metadata = None if args.license else base_license(Path(args.adapter))
        path = write_model_card(args.adapter, repo_id=args.repo_id, license=args.license, base_license=license_metadata)
    except (AdapterFileError, ValueError) as error:
        print(f"focus-hf card: error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "card",
        help="write the model card (README.md) of a Focus adapter folder",
        description="Render README.md (YAML metadata for the Hub + a description) from adapter_config.json, the "
        "weights, and when present training_log.json, eval_results.json ({'full': {'ppl': ..}, 'soft': .., "
        "'hard': .., 'speed': ..}) and interpretability.json (`focus-hf inspect --json`). Overwrites an existing "
        "README.md. With --eval-data, first measures the perplexities on held-out documents of that corpus.",
    )
    parser.add_argument("adapter", metavar="ADAPTER_DIR", help="saved Focus adapter folder")
    parser.add_argument("--repo-id", help="Hub id shown in the loading snippet (default: a placeholder)")
    parser.add_argument("--license", help="license of the card (default: apache-2.0)")
    evaluation = parser.add_argument_group("measuring (--eval-data)")
    evaluation.add_argument(
        "--eval-data", metavar="D", help="corpus to measure perplexity on (built-in name, file or folder)"
    )
    evaluation.add_argument("--model", help="base model (default: the adapter's base)")
    evaluation.add_argument("--seq-len", type=int, default=512, help="tokens per window (default: 512)")
    evaluation.add_argument("--max-blocks", type=int, default=8, help="windows scored per mode (default: 8)")
    evaluation.add_argument(
        "--heldout-fraction", type=float, default=0.1, help="held-out share of documents (default: 0.1)"
    )
    evaluation.add_argument("--split-seed", type=int, default=0, help="seed of the train/held-out split (default: 0)")
    parser.set_defaults(func=run)
