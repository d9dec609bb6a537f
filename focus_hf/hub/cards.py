"""A model card (README.md) as two kinds of content: what focus_hf generates and what a person wrote.

The card focus_hf renders marks each generated section with two Markdown link reference definitions, which no
renderer shows (and which are no raw HTML)::

    [//]: # (focus-hf:begin usage)

    ...

    [//]: # (focus-hf:end usage)

and owns the metadata keys of `GENERATED_METADATA` (the tags and datasets it adds are merged with a person's own).
Everything else - text outside the markers, other metadata keys - is hand-written and is kept: `update_card` applies a
newly rendered card to an existing one (what `focus-hf card` does to a README already in the folder, and what
`push_adapter` does to a README edited on the Hub), and `hand_written_parts` tells whether two cards differ in what a
person wrote.
"""

from __future__ import annotations

import re
from typing import Any

# Metadata keys whose values focus_hf sets (or removes when it has none); `MERGED_METADATA` lists are unions.
GENERATED_METADATA = (
    "base_model", "base_model_relation", "library_name", "license", "license_name", "license_link", "pipeline_tag",
    "model-index", "focus_hf",
)  # fmt: skip
MERGED_METADATA = ("tags", "datasets")
_FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n(.*?\r?\n)?---[ \t]*(?:\r?\n|\Z)", re.S)
_SECTION = re.compile(
    r"^\[//\]: # \(focus-hf:begin (?P<name>[\w-]+)\)[ \t]*\n"
    r"(?P<body>.*?)"
    r"^\[//\]: # \(focus-hf:end (?P=name)\)[ \t]*\n?",
    re.S | re.M,
)


def section(name: str, text: str) -> str:
    """`text` wrapped in the markers of the generated section `name` (blank lines around it, so that a marker never
    joins a paragraph)."""
    return f"[//]: # (focus-hf:begin {name})\n\n{text.strip(chr(10))}\n\n[//]: # (focus-hf:end {name})\n"


def split_card(text: str) -> tuple[dict[str, Any], str]:
    """(metadata, body) of a card; a card without front matter has empty metadata.

    Raises:
        ValueError: the front matter is not a YAML mapping.
    """
    import yaml

    match = _FRONT_MATTER.match(text)
    if not match:
        return {}, text
    try:
        metadata = yaml.safe_load(match.group(1) or "") or {}
    except yaml.YAMLError as error:
        raise ValueError(f"the card's YAML metadata is not valid YAML: {error}") from None
    if not isinstance(metadata, dict):
        raise ValueError("the card's YAML metadata is not a mapping of keys to values")
    return metadata, text[match.end() :]


def join_card(metadata: dict[str, Any], body: str) -> str:
    """A card from its metadata (serialised as huggingface_hub's `CardData` does) and its body."""
    from huggingface_hub import CardData

    if not metadata:
        return body
    return f"---\n{CardData(**metadata).to_yaml()}\n---\n\n{body.lstrip(chr(10))}"


def _parts(body: str) -> list[tuple[str | None, str]]:
    """The body as (section name, text) parts in order; hand-written text has the name None."""
    parts: list[tuple[str | None, str]] = []
    position = 0
    for match in _SECTION.finditer(body):
        parts.append((None, body[position : match.start()]))
        parts.append((match["name"], match.group(0)))
        position = match.end()
    parts.append((None, body[position:]))
    return [(name, text) for name, text in parts if name is not None or text]


def generated_sections(body: str) -> dict[str, str]:
    """Section name -> its text, markers included, in the order of the body."""
    return {name: text for name, text in _parts(body) if name is not None}


def _merge_metadata(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    merged = dict(old)
    for key in GENERATED_METADATA:
        if key in new:
            merged[key] = new[key]
        else:
            merged.pop(key, None)
    for key in MERGED_METADATA:
        values = [*_listed(old.get(key)), *_listed(new.get(key))]
        if values:
            merged[key] = list(dict.fromkeys(values))
    for key, value in new.items():  # keys neither list names (none today) are set as rendered
        merged.setdefault(key, value)
    return merged


def _listed(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value] if value else []


def is_unedited_template(text: str) -> bool:
    """Whether a card is the blank template nobody filled in: huggingface_hub's default model card, as PEFT's
    `save_pretrained` writes it into every adapter folder (with its "Framework versions" lines)."""
    from huggingface_hub import ModelCard, ModelCardData

    try:
        _, body = split_card(text)
    except ValueError:
        return False
    template = {line.strip() for line in ModelCard.from_template(ModelCardData()).text.splitlines()}
    lines = [line.strip() for line in body.splitlines() if line.strip()]
    peft_lines = re.compile(r"### Framework versions|## Training procedure|- PEFT \S+")
    return bool(lines) and all(line in template or peft_lines.fullmatch(line) for line in lines)


def update_card(existing: str, rendered: str) -> str:
    """`existing` with the metadata and generated sections of `rendered`; what a person wrote is kept.

    Generated sections are replaced in place; a section `rendered` no longer has is removed; a new one goes after the
    section that precedes it in `rendered` (at the start of the body when none does). A card without any generated
    section (written by hand) gets them all at the start of its body, its own text after them. A blank template
    (`is_unedited_template`) holds nothing anybody wrote: `rendered` replaces it.
    """
    if is_unedited_template(existing):
        return rendered
    old_metadata, old_body = split_card(existing)
    new_metadata, new_body = split_card(rendered)
    new_sections = generated_sections(new_body)
    parts = _parts(old_body)
    if not any(name for name, _ in parts):
        body = "\n".join(new_sections.values()) + ("\n" + old_body.lstrip("\n") if old_body.strip() else "")
        return join_card(_merge_metadata(old_metadata, new_metadata), body)
    parts = [(name, new_sections[name] if name else text) for name, text in parts if not name or name in new_sections]
    order = list(new_sections)
    for index, name in enumerate(order):
        if any(part_name == name for part_name, _ in parts):
            continue
        earlier = set(order[:index])
        at = max((i + 1 for i, (part_name, _) in enumerate(parts) if part_name in earlier), default=0)
        parts.insert(at, (name, "\n" + new_sections[name]))
    return join_card(_merge_metadata(old_metadata, new_metadata), "".join(text for _, text in parts))


def hand_written_parts(text: str) -> tuple[dict[str, Any], str]:
    """What a person may have written in a card: the metadata focus_hf does not generate (with the tags and datasets),
    and the body outside the generated sections with blank lines normalised (two cards with equal parts differ only
    in what focus_hf writes)."""
    if is_unedited_template(text):
        return {}, ""
    metadata, body = split_card(text)
    own = {key: value for key, value in metadata.items() if key not in GENERATED_METADATA + MERGED_METADATA}
    own.update({key: sorted(map(str, _listed(metadata[key]))) for key in MERGED_METADATA if metadata.get(key)})
    outside = "".join(part for name, part in _parts(body) if name is None)
    return own, "\n".join(line.rstrip() for line in outside.strip().splitlines() if line.strip())
