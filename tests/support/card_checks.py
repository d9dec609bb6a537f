"""A model card read as the Hub shows it: rendered with a GitHub-flavoured Markdown renderer (markdown-it-py,
CommonMark with GFM tables), not searched as text.

`check_rendered_card` is what every card the tests generate must pass (tests/conftest.py applies it to each card
`focus_hf.card` renders in the test process; the CLI tests apply it to the cards their child processes write):

* the YAML metadata loads with `huggingface_hub.ModelCard` and round-trips through `ModelCardData`;
* every table of the source renders as a table, with its header, and every row has the header's number of cells
  (a renderer silently pads or cuts a row that has not);
* no code span shows an HTML entity (inside code a renderer shows `&#34;` as those five characters);
* no raw HTML reaches the page (the card writes none; a value from the folder must not add any);
* every link and image points somewhere real: the paper on arXiv, the base model or a dataset of its metadata on the
  Hub, or a file of the adapter folder (which is pushed with the card).

`hub_peft_snippet` writes out the code the Hub's "Use this model" button shows for a PEFT adapter, transcribed from
huggingface.js (`packages/tasks/src/model-libraries-snippets.ts`, functions `peftTask` and `peft`), independently of
focus_hf's own rendering of it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from huggingface_hub import ModelCard, ModelCardData
from markdown_it import MarkdownIt
from markdown_it.token import Token

PAPER = "https://arxiv.org/abs/2604.03260"
ENTITY = re.compile(r"&(#\d+|#x[0-9a-f]+|[a-z][a-z0-9]*);", re.IGNORECASE)
# A cell boundary as GFM tables split a row: a pipe not preceded by a backslash (also inside code spans).
CELL_BOUNDARY = re.compile(r"(?<!\\)\|")


def renderer() -> MarkdownIt:
    """CommonMark with GFM tables (raw HTML left enabled, as on the Hub, so that any would show up)."""
    return MarkdownIt("commonmark").enable("table")


def all_tokens(tokens: Iterable[Token]) -> Iterator[Token]:
    """Every token, inline children included."""
    for token in tokens:
        yield token
        if token.children:
            yield from all_tokens(token.children)


def _cells(line: str) -> int:
    parts = CELL_BOUNDARY.split(line.strip())
    if parts and parts[0].strip() == "":
        parts = parts[1:]
    if parts and parts[-1].strip() == "":
        parts = parts[:-1]
    return len(parts)


def source_tables(body: str) -> list[tuple[int, int]]:
    """(first line, end line) of each run of lines starting with '|' outside fenced code, 0-based."""
    runs, start, fenced = [], None, False
    lines = body.splitlines()
    for index, line in enumerate(lines + [""]):
        if line.startswith("```"):
            fenced = not fenced
        is_row = not fenced and line.startswith("|")
        if is_row and start is None:
            start = index
        elif not is_row and start is not None:
            runs.append((start, index))
            start = None
    return runs


def code_spans(body: str) -> list[str]:
    """The text of every inline code span, as the renderer shows it."""
    return [token.content for token in all_tokens(renderer().parse(body)) if token.type == "code_inline"]


def check_rendered_card(text: str, folder: Optional[Path] = None, literal_code: Iterable[str] = ()) -> ModelCard:
    """Fail (AssertionError) unless the card `text` reads right once rendered (see the module docstring).

    Args:
        text: the whole README.md, YAML header included.
        folder: the adapter folder the card sits in (relative links must name its files); None allows none.
        literal_code: code-span texts that hold entity-like text because the value itself does (a token `&amp;`).
    """
    card = ModelCard(text)
    ModelCardData(**card.data.to_dict())
    body = card.text
    tokens = renderer().parse(body)
    lines = body.splitlines()

    tables = [token for token in tokens if token.type == "table_open"]
    expected = source_tables(body)
    assert [tuple(token.map) for token in tables] == expected, f"tables that do not parse: {expected} vs {tables}"
    for start, end in expected:
        header = _cells(lines[start])
        assert header > 0 and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[start + 1].strip()), lines[start : start + 2]
        for line in lines[start + 2 : end]:
            assert _cells(line) == header, f"row with {_cells(line)} cells under a {header}-cell header: {line!r}"

    everything = list(all_tokens(tokens))
    allowed_literal = set(literal_code)
    for token in everything:
        if token.type == "code_inline" and token.content not in allowed_literal:
            assert not ENTITY.search(token.content), f"an HTML entity shows inside code: {token.content!r}"
        assert token.type not in ("html_inline", "html_block"), f"raw HTML in the card: {token.content!r}"

    hub_pages = {f"https://huggingface.co/{card.data.base_model}"} if card.data.base_model else set()
    hub_pages |= {f"https://huggingface.co/datasets/{dataset}" for dataset in card.data.datasets or []}
    for token in everything:
        if token.type not in ("link_open", "image"):
            continue
        target = token.attrGet("href") if token.type == "link_open" else token.attrGet("src")
        if target in hub_pages or target == PAPER:
            continue
        assert "://" not in target and not target.startswith(("/", "#", "mailto:")), f"link to {target!r}"
        assert folder is not None and (folder / target).is_file(), f"link to {target!r}, not a file of {folder}"
    return card


def shown(text: str) -> str:
    """How the card shows a string in a code span: spaces as ␣, tab / newline / carriage return as escapes."""
    return text.replace(" ", "\u2423").replace("\t", "\\t").replace("\r", "\\r").replace("\n", "\\n")


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def input_strings(folder: Path, *given: Any) -> set[str]:
    """Every string a card of `folder` may show, as it shows it: from `given` objects and the folder's JSON files."""
    found: set[str] = set()
    sources = list(given) + [json.loads(path.read_text()) for path in sorted(folder.glob("*.json")) if path.is_file()]
    for source in sources:
        for text in _strings(source):
            found.update({text, shown(text)})
    return found


# huggingface.js `peftTask`: the PEFT task types the snippet knows, and the auto class each names.
_PEFT_TASKS = {"CAUSAL_LM": "CausalLM", "SEQ_2_SEQ_LM": "Seq2SeqLM", "TOKEN_CLS": "TokenClassification",
               "SEQ_CLS": "SequenceClassification"}  # fmt: skip


def hub_peft_snippet(model_id: str, adapter_config: dict) -> str:
    """The Hub's PEFT snippet for `model_id` (huggingface.js `peft(model)`, with `model.config.peft` read from
    `adapter_config.json`): its error texts where it shows no code."""
    task = _PEFT_TASKS.get(adapter_config.get("task_type"))
    base = adapter_config.get("base_model_name_or_path")
    if not task:
        return "Task type is invalid."
    if not base:
        return "Base model is not found."
    return (
        f"from peft import PeftModel\nfrom transformers import AutoModelFor{task}\n\n"
        f'base_model = AutoModelFor{task}.from_pretrained("{base}")\n'
        f'model = PeftModel.from_pretrained(base_model, "{model_id}")'
    )
