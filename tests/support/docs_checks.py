"""What the README and docs tests read in Markdown: code blocks, and the figures of the prose.

A *figure* is a measured-looking number: a ratio (`1.34x`), a share (`97.6%`), a quantity of time, memory or
throughput (`2.2 MB`, `30 s`, `9.06 tokens/s`), a decimal (`1.006`) or a count of a total (`40/40`). Code (fenced
blocks and `inline` spans), link targets, generated parts (`<!--fig:NAME-->...<!--/fig-->`, written from the
committed JSON by docs/hooks/generated.py) and the paper's arXiv id are not prose. The docs' pages may hold figures
only in generated parts; the README only there or as one of those values.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = REPO_ROOT / "docs"
DOCS_HOOKS = DOCS / "hooks"

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
NOT_PROSE = [
    FENCE,
    re.compile(r"`[^`\n]*`"),  # inline code
    re.compile(r"\]\([^)]*\)"),  # link targets
    re.compile(r"<!--fig:[^>]*-->.*?<!--/fig-->", re.S),  # generated parts
    re.compile(r"<!--.*?-->", re.S),
    re.compile(r"arXiv \d+\.\d+"),
]
_NUMBER = r"\d[\d,]*(?:\.\d+)?"
_SPACED_UNITS = r"(?:ms|us|µs|s|min|MiB|GiB|KiB|MB|GB|KB|kB|tokens/s|GFLOP/s)"
FIGURE = re.compile(
    rf"(?<![\w.,/-]){_NUMBER}(?:[x%]|\s?{_SPACED_UNITS})(?![\w/])"  # ratio, share, quantity with a unit
    r"|(?<![\w.,/-])\d+\.\d+(?![\w.])"  # a decimal
    r"|(?<![\w./-])\d+/\d+(?![\w/])"  # a count of a total
)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced code block, in order."""
    return [(match.group(1), match.group(2)) for match in FENCE.finditer(text)]


def prose(text: str) -> str:
    """`text` without code, link targets, generated parts and comments."""
    for pattern in NOT_PROSE:
        text = pattern.sub(" ", text)
    return text


def figure_tokens(text: str) -> set[str]:
    """The figures written out in the prose of `text`."""
    return {match.group(0) for match in FIGURE.finditer(prose(text))}
