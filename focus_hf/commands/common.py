"""Options and helpers shared by the train / eval / demo commands."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Optional

from ..models import DEFAULT_MODEL, MODEL_ALIASES

DEFAULT_DATA = "python-docs"


def add_model_option(parser: argparse.ArgumentParser, default: Optional[str] = DEFAULT_MODEL) -> None:
    aliases = ", ".join(sorted(MODEL_ALIASES))
    parser.add_argument(
        "--model",
        default=default,
        help=f"base model: a Hub id, a local folder, or an alias ({aliases}); default: {default or 'the adapter base'}",
    )


def add_data_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        default=DEFAULT_DATA,
        help="corpus: a built-in name (python-docs, python-source), a text file, a .jsonl file with a 'text' "
        f"field, or a folder of .txt/.md/.py/.rst files (default: {DEFAULT_DATA})",
    )
    parser.add_argument(
        "--heldout-fraction", type=float, default=0.1, help="share of documents held out for evaluation (default: 0.1)"
    )
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the train/held-out split (default: 0)")


def split_corpus(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(train, held-out) documents of `args.data`, split as every command splits them."""
    from ..data import load_texts, split_texts

    return split_texts(load_texts(args.data), heldout_fraction=args.heldout_fraction, seed=args.split_seed)


def model_for_adapter(adapter: str | os.PathLike) -> Optional[str]:
    """The base model recorded in an adapter folder, mapped back to an alias when it is an embedded model's
    Hub id (so that the adapter loads on the very weights it was trained on, without network)."""
    config_path = Path(adapter) / "adapter_config.json"
    if not config_path.is_file():
        return None
    base = json.loads(config_path.read_text(encoding="utf-8")).get("base_model_name_or_path")
    for alias in MODEL_ALIASES.values():
        if base == alias.hub_id:
            return alias.name
    return base


def load_base(name: str) -> tuple[Any, Any]:
    from ..models import load_model_and_tokenizer

    return load_model_and_tokenizer(name)


def print_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*header))
    print(line.format(*("-" * w for w in widths)))
    for row in rows:
        print(line.format(*row))
