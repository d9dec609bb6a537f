"""Pages generated from the code itself, so that they cannot drift from it: the CLI reference (walked from the
argparse parsers of `focus_hf.cli`), the package tree (one line per folder and root module, from their
docstrings) and the import paths of the modules the docs name.

Pure Python, no mkdocs: the hook (`focus_docs.py`) and the tests (`tests/test_docs.py`) both call it.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "focus_hf"

# The import path of every module the docs name by a short key (`{{ module:distill }}` in a page). The one place
# to update when modules move: pages, snippets and the API reference (docs/api/fitting.md) read it from here.
MODULES = {
    "capture": "focus_hf.fitting.capture",
    "distill": "focus_hf.fitting.distill",
    "layerwise": "focus_hf.fitting.layerwise",
    "dense_heads": "focus_hf.fitting.dense_heads",
    "retrieval_heads": "focus_hf.fitting.retrieval_heads",
    "recall_audit": "focus_hf.fitting.recall_audit",
    "trainer": "focus_hf.fitting.trainer",
    "metadata": "focus_hf.fitting.metadata",
    "parallel": "focus_hf.fitting.parallel",
    "evaluation": "focus_hf.evaluation",
    "data": "focus_hf.data",
    "card": "focus_hf.card",
    "files": "focus_hf.files",
    "sizing": "focus_hf.sizing",
    "base_models": "focus_hf.base_models",
    "aliases": "focus_hf.aliases",
}


def module(key: str) -> str:
    """The dotted import path of the module the docs call `key` (a `MODULES` key)."""
    try:
        return MODULES[key]
    except KeyError:
        raise KeyError(f"unknown module key {key!r}: add it to MODULES in {Path(__file__).name}") from None


def module_file(dotted: str) -> Path:
    """The source file of a `focus_hf` module or package (raises when there is none: a stale path)."""
    path = ROOT.joinpath(*dotted.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{dotted} has no source file under {ROOT}")


# --- the package tree ------------------------------------------------------------------------------------------


def first_paragraph(path: Path) -> str:
    """The first paragraph of a module's docstring, on one line ("" when it has none)."""
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return " ".join(docstring.strip().split("\n\n")[0].split())


def package_folders() -> list[str]:
    """The folders of focus_hf/ that are Python packages, sorted."""
    return sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file())


def root_modules() -> list[str]:
    """The modules at the root of focus_hf/ (without __init__.py), sorted."""
    return sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def architecture_table() -> str:
    """One row per folder of focus_hf/, then one per root module: its name and the first paragraph of its docstring."""
    lines = ["| folder / module | what it holds |", "|---|---|"]
    for folder in package_folders():
        lines.append(f"| `{folder}/` | {_cell(first_paragraph(PACKAGE / folder / '__init__.py'))} |")
    for name in root_modules():
        lines.append(f"| `{name}` | {_cell(first_paragraph(PACKAGE / name))} |")
    return "\n".join(lines)


def patches_table() -> str:
    """The changes focus_hf makes to peft and transformers objects (`focus_hf.tuner.patches.PATCHES`), as a table."""
    from focus_hf.tuner.patches import table

    return table()


# --- the CLI reference -----------------------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _option_names(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    takes_value = action.nargs != 0
    metavar = ""
    if takes_value:
        if action.metavar is not None:
            metavar = " " + (" ".join(action.metavar) if isinstance(action.metavar, tuple) else action.metavar)
        elif action.choices is not None:
            metavar = " {" + ",".join(str(c) for c in action.choices) + "}"
        else:
            metavar = " " + action.dest.upper()
        if action.nargs in ("+", "*"):
            metavar += " ..."
    return ", ".join(f"`{name}{metavar}`" for name in action.option_strings)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if action.help is None or action.help == argparse.SUPPRESS:
        return ""
    # argparse's own expansion of %(default)s and the like, without its line wrapping.
    text = parser._get_formatter()._expand_help(action)
    return _cell(" ".join(text.split()))


def _escape(text: str) -> str:
    """Markdown-safe prose: outside `code` spans, the characters Markdown would read as markup are literal."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part if part.startswith("`") else re.sub(r"([<>*_\[\]])", r"\\\1", part) for part in parts)


def cli_reference(parser: argparse.ArgumentParser | None = None) -> str:
    """Markdown for every `focus-hf` sub-command: description, usage and a table of options per option group."""
    if parser is None:
        from focus_hf.cli import build_parser

        parser = build_parser()
    parser.formatter_class = argparse.HelpFormatter
    sections = []
    for name, sub in _subcommands(parser).items():
        sub.prog = f"focus-hf {name}"
        sub.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
        lines = [f"## `focus-hf {name}`", ""]
        if sub.description:
            lines += [_escape(" ".join(sub.description.split())), ""]
        lines += ["```text", sub.format_usage().strip(), "```", ""]
        for group in sub._action_groups:
            actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS and a.dest != "help"]
            if not actions:
                continue
            lines += [f"**{group.title}**", "", "| option | meaning |", "|---|---|"]
            lines += [f"| {_option_names(a)} | {_escape(_help(sub, a))} |" for a in actions]
            lines.append("")
        sections.append("\n".join(lines))
    return "\n".join(sections)


def cli_commands(parser: argparse.ArgumentParser | None = None) -> list[str]:
    """The names of the `focus-hf` sub-commands, in the order `focus-hf --help` lists them."""
    if parser is None:
        from focus_hf.cli import build_parser

        parser = build_parser()
    return list(_subcommands(parser))
