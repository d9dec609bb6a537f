"""One command-line grammar for every `focus-hf` command: one name per option, the same name for the same thing.

`OPTIONS` lists every option a command may take, with what it means; no two names mean the same thing (a test walks
every command's options against it). `add_option` adds one to a parser, with the names it had before accepted as
hidden aliases that print a one-line notice naming the new one.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

_Container = Any  # an argparse parser or argument group

# option -> what it is. A command that needs a new option adds it here, with a meaning no other option has.
OPTIONS: dict[str, str] = {
    # what is read and where from
    "--model": "the base model to load (a Hub id, a local folder or an alias)",
    "--revision": "the Hub revision of the adapter read (push: the branch committed to)",
    "--offline": "use the local huggingface_hub cache only",
    "--data": "the corpus: a built-in name, a file, a folder, or a Hub dataset",
    "--split": "which documents of the corpus are scored",
    "--heldout-fraction": "the share of documents held out for evaluation",
    "--split-seed": "the seed of the train / held-out split",
    "--seq-len": "tokens per sequence (bench: each of several lengths)",
    "--max-blocks": "the number of sequences scored or routed",
    "--sequences": "the number of corpus sequences trained or calibrated on",
    "--config": "a base model's config to size an adapter for",
    # the adapter's shape (FocusConfig fields)
    "--num-groups": "FocusConfig.num_groups",
    "--group-dim": "FocusConfig.group_dim",
    "--window": "FocusConfig.window",
    "--top-k": "FocusConfig.top_k: groups each query probes",
    "--probe-mass": "FocusConfig.probe_mass",
    "--sink-tokens": "FocusConfig.sink_tokens",
    "--temperature": "FocusConfig.temperature",
    "--sinkhorn-iterations": "FocusConfig.sinkhorn_iterations",
    "--query-projection": "FocusConfig.query_projection: queries get their own router",
    "--dense-below": "FocusConfig.dense_below",
    "--dense-heads": "the number of kv heads losing the most attention mass (kept dense, or listed)",
    "--retrieval-heads": "the number of retrieval kv heads (kept dense, or listed)",
    # training
    "--objective": "the training objective",
    "--steps": "optimizer steps",
    "--lr": "the learning rate",
    "--batch-size": "sequences per step or forward pass",
    "--seed": "the random seed",
    "--logging-steps": "the loss logging interval",
    "--dominance-threshold": "the largest group share that warns",
    "--retrieval-documents": "synthetic retrieval documents mixed into distillation",
    "--device": "the torch device",
    "--dtype": "the dtype of the weights or tensors",
    "--layerwise": "distil one decoder layer at a time",
    "--top-m": "distant keys per query kept as the distillation target",
    "--queries-per-sequence": "queries sampled per sequence",
    "--balance-weight": "the weight of the group-balance penalty",
    "--save-steps": "the checkpoint interval",
    "--resume": "continue from the last checkpoint",
    "--clean-checkpoints": "delete the checkpoints after training",
    "--no-balance-check": "skip the final group-dominance check",
    # evaluation, inspection and timing
    "--stride": "the distance between scored windows",
    "--mode": "the attention scored: full, soft or hard",
    "--backend": "the hard-mode attention backend",
    "--top-tokens": "frequent tokens listed per group",
    "--passkeys": "passkey prompts asked",
    "--repeats": "timed repetitions (the best is kept)",
    "--decode-repeats": "timed repetitions per decoding length",
    "--decode-steps": "decoding steps per timing",
    "--heads": "query heads of the timed attention",
    "--kv-heads": "key/value heads of the timed attention",
    "--head-dim": "the head dimension of the timed attention",
    "--dense-max-seq-len": "the longest sequence dense attention is timed at",
    "--threads": "CPU threads",
    "--peak-memory": "measure peak memory instead of time",
    "--decode": "time decoding steps instead of prefill",
    "--compile": "also time under torch.compile",
    "--calibrate": "measure where auto switches from dense to sparse",
    "--limit": "the most results listed",
    # what is written
    "--out": "the adapter folder written",
    "--local-dir": "the folder a pull copies the adapter into",
    "--report-dir": "the folder the interpretability report and chart are written into",
    "--json": "JSON output: a file, or standard output when '-' or no path is given",
    "--html": "an HTML page of the routing",
    "--png": "a PNG heatmap",
    "--no-progress": "no progress bars",
    # the Hub
    "--repo-id": "the Hub id the model card's snippet names",
    "--license": "the model card's license",
    "--private": "create the repo private",
    "--public": "create the repo public",
    "--commit-message": "the commit message",
    "--create-pr": "open a pull request instead of committing",
    "--delete": "also delete the repo's adapter files the folder lacks",
    "--overwrite-readme": "replace a README.md edited on the Hub by the local one",
}


class DeprecatedAlias(argparse.Action):
    """A former name of an option: prints a one-line notice, then acts as the option under its new name."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, target: argparse.Action, name: str, **kwargs):
        kwargs.pop("default", None)  # argparse passes the parser's default for `dest`: the option's own counts
        kwargs.pop("help", None)
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)
        self.target = target
        self.name = name

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            f"{parser.prog}: {option_string} is now {self.name}; the old name still works but will be removed.",
            file=sys.stderr,
        )
        self.target(parser, namespace, values, self.name)


def add_option(container: _Container, name: str, *flags: str, old: Sequence[str] = (), **kwargs) -> argparse.Action:
    """Add the option `name` (a key of `OPTIONS`; `flags` are further short forms, rarely wanted) and its former
    names `old`, accepted with a notice.

    An old name of a negated boolean (``--no-query-router``) is given as ``"--no-query-router=--no-query-projection"``:
    the new name it stands for follows the ``=``.
    """
    if name not in OPTIONS:
        raise ValueError(f"{name} is not in focus_hf.commands.options.OPTIONS: add it there with its meaning.")
    action = container.add_argument(name, *flags, **kwargs)
    for entry in old:
        old_name, _, new_name = entry.partition("=")
        nargs = 0 if action.nargs == 0 or isinstance(action, _NO_VALUE_ACTIONS) else action.nargs
        alias_kwargs: dict[str, Any] = {"nargs": nargs}
        if nargs != 0:
            alias_kwargs.update(type=action.type, choices=action.choices, metavar=action.metavar)
        if action.const is not None and nargs == "?":
            alias_kwargs["const"] = action.const
        container.add_argument(
            old_name, dest=action.dest, action=DeprecatedAlias, target=action, name=new_name or name, **alias_kwargs
        )
    return action


_NO_VALUE_ACTIONS = (
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse._StoreConstAction,
    argparse.BooleanOptionalAction,
)


def add_json_option(container: _Container, what: str) -> argparse.Action:
    """``--json [PATH]``: `what` as JSON, into PATH, or onto standard output when no path or ``-`` is given."""
    return add_option(
        container, "--json", nargs="?", const="-", default=None, metavar="PATH",
        help=f"write {what} as JSON to PATH (standard output with no PATH or '-')",
    )  # fmt: skip


def write_json(data: Any, destination: str) -> None:
    """Write `data` as JSON where ``--json`` asked: a file, or standard output for ``-``."""
    import json
    from pathlib import Path

    text = json.dumps(data, indent=2)
    if destination == "-":
        print(text)
    else:
        Path(destination).write_text(text + "\n", encoding="utf-8")
        print(f"wrote {destination}", file=sys.stderr)
