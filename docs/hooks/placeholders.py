"""`{{ name }}` in a page: what each placeholder becomes (pure Python, no mkdocs: the hook and the tests use it).

* `{{ module:key }}`: the import path of a module (`reference.MODULES`);
* `{{ cli.reference }}`: the CLI reference, walked from the argparse parsers (`reference.cli_reference`);
* `{{ architecture }}`: the package tree, from the docstrings (`reference.architecture_table`);
* any other name: a figure or a table from the committed JSON (`figures.value`). An unknown name raises.
"""

from __future__ import annotations

import re

import figures
import reference

PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z0-9_.:-]+)\s*\}\}")


def expand(name: str) -> str:
    """The text that replaces `{{ name }}`."""
    if name.startswith("module:"):
        return reference.module(name.removeprefix("module:"))
    if name == "cli.reference":
        return reference.cli_reference()
    if name == "architecture":
        return reference.architecture_table()
    return figures.value(name)


def render(markdown: str) -> str:
    """`markdown` with every placeholder expanded."""
    return PLACEHOLDER.sub(lambda match: expand(match.group(1)), markdown)


def names(markdown: str) -> list[str]:
    """The placeholder names of `markdown`, in order."""
    return PLACEHOLDER.findall(markdown)
