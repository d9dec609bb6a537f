"""Options and helpers shared by the commands: the adapter argument, the base model, the corpus, the adapter's shape."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

from focus_hf.defaults import FOCUS_DEFAULTS

if TYPE_CHECKING:
    from focus_hf.tuner.config import FocusConfig
from pathlib import Path

from focus_hf.aliases import DEFAULT_MODEL, MODEL_ALIASES
from focus_hf.commands.options import DeprecatedAlias, add_option
from focus_hf.files import model_for_adapter

DEFAULT_DATA = "python-docs"
DEFAULT_HELDOUT_FRACTION = 0.1
DEFAULT_SPLIT_SEED = 0

_ArgumentContainer = Union[argparse.ArgumentParser, argparse._ArgumentGroup]


@dataclasses.dataclass(frozen=True)
class FocusOption:
    """A `FocusConfig` field exposed as a command-line option."""

    flag: str
    field: str
    type: type
    help: str
    old: tuple[str, ...] = ()  # former names, still accepted

    @property
    def dest(self) -> str:
        """The attribute argparse stores the option under."""
        return self.flag[2:].replace("-", "_")

    @property
    def default(self) -> Any:
        """The `FocusConfig` default, so that the CLI and the Python API start from the same adapter."""
        return _FOCUS_CONFIG_DEFAULTS[self.field]


_FOCUS_CONFIG_DEFAULTS = FOCUS_DEFAULTS

# In the order the options are listed in --help.
FOCUS_OPTIONS = (
    FocusOption("--num-groups", "num_groups", int, "groups K per layer", old=("--groups",)),
    FocusOption("--group-dim", "group_dim", int, "routing dimension d_g"),
    FocusOption("--window", "window", int, "local window w of full attention"),
    FocusOption("--top-k", "top_k", int, "groups each query probes in hard mode"),
    FocusOption(
        "--probe-mass", "probe_mass", float, "adaptive probing: stop once the probed groups hold this routing mass"
    ),
    FocusOption("--sink-tokens", "sink_tokens", int, "leading tokens always visible"),
    FocusOption("--temperature", "temperature", float, "routing temperature tau"),
    FocusOption("--sinkhorn-iterations", "sinkhorn_iterations", int, "Sinkhorn iterations"),
)
FOCUS_CONFIG_FIELDS = tuple(option.field for option in FOCUS_OPTIONS)


def add_focus_options(
    parser: _ArgumentContainer,
    fields: Optional[Sequence[str]] = None,
    help_texts: Optional[Mapping[str, str]] = None,
    defaults: Optional[Mapping[str, Any]] = None,
) -> None:
    """Add the adapter-shape options (`--groups`, `--window`, `--top-k`, ...) to `parser` (or an argument group).

    Args:
        parser: the parser or argument group to add to.
        fields: the `FocusConfig` fields to expose (default: all of `FOCUS_OPTIONS`), listed in that order.
        help_texts: help text per field, replacing the standard one; " (default: ...)" is appended either way.
        defaults: default per field, replacing the `FocusConfig` default.
    """
    help_texts, defaults = help_texts or {}, defaults or {}
    for option in FOCUS_OPTIONS:
        if fields is not None and option.field not in fields:
            continue
        text = help_texts.get(option.field, option.help)
        default = defaults.get(option.field, option.default)
        add_option(
            parser, option.flag, type=option.type, default=default, help=f"{text} (default: {default})", old=option.old
        )


def focus_config_from_args(args: argparse.Namespace) -> FocusConfig:
    """The `FocusConfig` the parsed options describe; fields without an option keep the `FocusConfig` default."""
    from focus_hf.tuner.config import FocusConfig

    return FocusConfig(
        **{option.field: getattr(args, option.dest) for option in FOCUS_OPTIONS if hasattr(args, option.dest)}
    )


def add_model_option(parser: argparse.ArgumentParser, default: Optional[str] = DEFAULT_MODEL) -> None:
    """Add `--model`; `default=None` means "the base model the adapter records"."""
    aliases = ", ".join(sorted(MODEL_ALIASES))
    add_option(
        parser,
        "--model",
        default=default,
        help=f"base model: a Hub id, a local folder, or an alias ({aliases}); default: "
        f"{default or 'the base model the adapter records'}",
    )


CORPUS_HELP = (
    "corpus: a built-in name (python-docs, python-source), a text file, a .jsonl file with a 'text' field, a folder "
    "of .txt/.md/.py/.rst files, or a Hub dataset, hf://datasets/ORG/NAME[@REVISION][/PATH]"
)


def add_data_options(
    parser: argparse.ArgumentParser, default: Optional[str] = DEFAULT_DATA, old: Sequence[str] = ()
) -> None:
    """Add `--data` and the options of its train/held-out split (read back by `split_corpus`)."""
    add_option(parser, "--data", default=default, help=f"{CORPUS_HELP} (default: {default or 'none'})", old=old)
    add_option(
        parser,
        "--heldout-fraction",
        type=float,
        default=DEFAULT_HELDOUT_FRACTION,
        help=f"share of documents held out for evaluation (default: {DEFAULT_HELDOUT_FRACTION})",
    )
    add_option(
        parser,
        "--split-seed",
        type=int,
        default=DEFAULT_SPLIT_SEED,
        help=f"seed of the train/held-out split (default: {DEFAULT_SPLIT_SEED})",
    )


def add_adapter_arguments(parser: argparse.ArgumentParser, *, what: str = "") -> None:
    """Add the adapter a command reads, as every command takes it: ADAPTER, a folder or a Hub id (its files are
    downloaded and checked against the Hub's checksums), and `--revision` (the former `--adapter` still works)."""
    # Optional for argparse even where the command needs it (`adapter_folder` says so): the former `--adapter`
    # gives it too, and a required positional would refuse a command line that names it that way. The positional has
    # no default of its own, which would overwrite what `--adapter` gave; the alias holds the default, None.
    positional = parser.add_argument(
        "adapter", metavar="ADAPTER", nargs="?", default=argparse.SUPPRESS,
        help=f"Focus adapter: a folder or a Hub id (namespace/name){what}",
    )  # fmt: skip
    alias = parser.add_argument(
        "--adapter", dest="adapter", action=DeprecatedAlias, target=positional, name="ADAPTER", nargs=None
    )
    alias.default = None
    add_option(parser, "--revision", help="branch, tag or commit of a Hub adapter (default: main)")


def adapter_folder(adapter: Optional[str | os.PathLike], revision: Optional[str] = None) -> Path:
    """The folder of the adapter a command reads: a local folder as it is, or a Hub id's files downloaded through
    the huggingface_hub cache and checked against the Hub's checksums (`focus_hf.hub.pull_adapter`).

    Raises:
        SystemExit: no adapter given, neither a folder nor a Hub id, or `revision` given for a local folder.
    """
    if adapter is None:
        raise SystemExit("focus-hf: give the ADAPTER, a folder or a Hub id (namespace/name).")
    if os.path.isdir(adapter):
        if revision is not None:
            raise SystemExit(f"focus-hf: --revision applies to an adapter on the Hub; {adapter} is a local folder.")
        return Path(adapter)
    from focus_hf.hub import InvalidRepoIdError, pull_adapter, validate_repo_id

    try:
        validate_repo_id(str(adapter))
    except InvalidRepoIdError:
        raise SystemExit(
            f"focus-hf: ADAPTER {str(adapter)!r} is neither a folder nor a Hub id (namespace/name)."
        ) from None
    return pull_adapter(str(adapter), revision=revision)


def split_documents(
    data: str | os.PathLike, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION, seed: int = DEFAULT_SPLIT_SEED
) -> tuple[list[str], list[str]]:
    """(train, held-out) documents of the corpus `data`, split as every command splits them."""
    from focus_hf.data import load_texts, split_texts

    return split_texts(load_texts(data), heldout_fraction=heldout_fraction, seed=seed)


def split_corpus(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(train, held-out) documents of `args.data`, split by the `add_data_options` options."""
    return split_documents(args.data, args.heldout_fraction, args.split_seed)


def split_metadata(data: str | os.PathLike, heldout_fraction: float, seed: int) -> dict[str, Any]:
    """The corpus and split a training log records, so that `focus-hf eval` can rebuild the same held-out set."""
    return {"data": str(data), "heldout_fraction": heldout_fraction, "split_seed": seed}


def base_model_name(model: Optional[str], adapter: Optional[str | os.PathLike]) -> str:
    """The base model to load: `model` when given, else the one the adapter folder `adapter` records (a Hub adapter's
    verified folder from `adapter_folder` records its base too), else the default model."""
    return model or (model_for_adapter(adapter) if adapter else None) or DEFAULT_MODEL


def load_base(name: str) -> tuple[Any, Any]:
    """(model, tokenizer) of the base model `name` (a Hub id, a local folder or an alias)."""
    from focus_hf.base_models import load_model_and_tokenizer

    return load_model_and_tokenizer(name)


def load_with_adapter(name: str, adapter: Optional[str | os.PathLike]) -> tuple[Any, Any]:
    """(model, tokenizer) of the base model `name`, wrapped in the Focus adapter `adapter` when one is given."""
    model, tokenizer = load_base(name)
    if adapter:
        from peft import PeftModel

        from focus_hf.tuner.patches import apply as apply_patches

        apply_patches()
        model = PeftModel.from_pretrained(model, adapter)
    return model, tokenizer


def print_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    """Print `rows` under `header` in left-aligned columns."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*header))
    print(line.format(*("-" * w for w in widths)))
    for row in rows:
        print(line.format(*row))
