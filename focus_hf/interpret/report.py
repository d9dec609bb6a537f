"""What the Focus groups learned: per layer and group, token share, routing confidence, frequent tokens and the
mix of token categories (closed word lists). `focus_hf.interpret.page` renders the report as an HTML page and
`focus_hf.interpret.chart` draws its group balance.

Used by `focus-hf inspect`; `inspect_groups(...)` returns the JSON report that `focus_hf.card` summarises when an
adapter folder holds it as `interpretability.json`.
"""

from __future__ import annotations

import builtins
import json
import keyword
import string
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn

from focus_hf.interpret.groups import routing_records
from focus_hf.tuner.controls import focus_layers

CATEGORIES = ("whitespace", "punctuation", "number", "python keyword", "function word", "python builtin",
              "word piece", "word", "other")  # fmt: skip
# Closed-class English words (articles, pronouns, prepositions, conjunctions, auxiliaries, determiners).
FUNCTION_WORDS = frozenset(
    """a an the this that these those some any each every no all both either neither such what which who whom whose
    i me my mine you your yours he him his she her hers it its we us our ours they them their theirs one
    of to in on at by for with from about into onto over under after before between through during without within
    along among around across behind beyond near off out up down upon than like via per
    and or but nor so yet if then else because although though while whereas unless until since as whether
    is are was were be been being am do does did done have has had having can could may might must shall should
    will would not also just only very too there here when where why how""".split()
)
PYTHON_KEYWORDS = frozenset(keyword.kwlist) | frozenset(getattr(keyword, "softkwlist", []))
PYTHON_BUILTINS = frozenset(name for name in dir(builtins) if not name.startswith("_"))
_PUNCTUATION = frozenset(string.punctuation) | frozenset("“”‘’–—…«»·•")


def token_category(text: str) -> str:
    """The category of a decoded token (leading space kept), from the closed lists above."""
    word = text.strip()
    if not word:
        return "whitespace"
    if all(ch in _PUNCTUATION for ch in word):
        return "punctuation"
    if word.replace(".", "", 1).replace("_", "").isdigit():
        return "number"
    if word in PYTHON_KEYWORDS:
        return "python keyword"
    if word.lower() in FUNCTION_WORDS:
        return "function word"
    if word in PYTHON_BUILTINS:
        return "python builtin"
    if word.isalpha():
        return "word" if text[:1].isspace() or text[:1].isupper() else "word piece"
    return "other"


def _decoder(tokenizer: Any) -> Callable[[int], str]:
    cache: dict[int, str] = {}

    def decode(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = tokenizer.decode([token_id])
        return cache[token_id]

    return decode


def inspect_groups(
    model: nn.Module, tokenizer: Any, blocks: torch.Tensor, *, top_tokens: int = 10, batch_size: int = 4
) -> dict:
    """Per layer and group statistics of the hard-mode routing of `blocks` ([n, seq_len] token ids).

    Returns a JSON-able report: {"tokens", "blocks", "seq_len", "categories", "summary", "layers": [{"layer",
    "num_groups", "mean_confidence", "groups": [{"group", "tokens", "share", "mean_confidence", "top_tokens":
    [[text, count]...], "categories": {category: share}, "dominant_category", "purity"}]}]}.
    `token_assignments` (layer -> group per token of the first block) is kept out of the JSON but returned under
    "_first_block" for the HTML page.
    """
    decode = _decoder(tokenizer)
    device = next(model.parameters()).device
    per_layer: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for start in range(0, blocks.shape[0], batch_size):
        for index, (groups, confidence) in routing_records(
            model, blocks[start : start + batch_size].to(device)
        ).items():
            per_layer.setdefault(index, ([], []))
            per_layer[index][0].append(groups)
            per_layer[index][1].append(confidence)
    ids = blocks.reshape(-1).tolist()
    categories = [token_category(decode(token)) for token in ids]
    num_groups = {
        layer.layer_index: layer.focus_centroids[layer._active_router()].shape[0]
        for layer in focus_layers(model)
        if layer._active_router()
    }
    layers = []
    first_block = {}
    for index in sorted(per_layer):
        groups = torch.cat(per_layer[index][0]).reshape(-1)
        confidence = torch.cat(per_layer[index][1]).reshape(-1)
        first_block[index] = torch.cat(per_layer[index][0])[0].tolist()
        entries = []
        for group in range(num_groups.get(index, int(groups.max()) + 1)):
            members = (groups == group).nonzero().reshape(-1).tolist()
            count = len(members)
            mix = Counter(categories[i] for i in members)
            dominant, dominant_count = mix.most_common(1)[0] if mix else (None, 0)
            frequent = Counter(decode(ids[i]) for i in members).most_common(top_tokens)
            entries.append({
                "group": group,
                "tokens": count,
                "share": count / max(len(ids), 1),
                "mean_confidence": float(confidence[members].mean()) if members else None,
                "top_tokens": [[text, n] for text, n in frequent],
                "categories": {name: mix[name] / count for name in CATEGORIES if mix[name]} if count else {},
                "dominant_category": dominant,
                "purity": dominant_count / count if count else None,
            })  # fmt: skip
        layers.append(
            {"layer": index, "num_groups": len(entries), "mean_confidence": float(confidence.mean()), "groups": entries}
        )
    report = {
        "tokens": len(ids),
        "blocks": int(blocks.shape[0]),
        "seq_len": int(blocks.shape[1]),
        "categories": list(CATEGORIES),
        "summary": _summary(layers, len(ids)),
        "layers": layers,
    }
    report["_first_block"] = {"tokens": [decode(t) for t in blocks[0].tolist()], "groups": first_block}
    return report


def _summary(layers: list[dict], tokens: int) -> str:
    candidates = [
        (g["purity"], layer["layer"], g)
        for layer in layers
        for g in layer["groups"]
        if g["tokens"] >= max(5, tokens // 100)
    ]
    text = f"Routing of {tokens:,} tokens over {len(layers)} layers"
    if layers:
        text += f"; mean assignment confidence {sum(layer['mean_confidence'] for layer in layers) / len(layers):.2f}"
    if candidates:
        purity, layer, group = max(candidates, key=lambda item: (item[0], item[2]["tokens"]))
        largest = max((g["share"], layer_["layer"], g["group"]) for layer_ in layers for g in layer_["groups"])
        text += (f". Purest group: layer {layer} group {group['group']} ({purity:.0%} {group['dominant_category']}, "
                 f"{group['share']:.1%} of tokens). Largest group: layer {largest[1]} group {largest[2]} "
                 f"({largest[0]:.1%} of tokens)")  # fmt: skip
    return text + "."


def report_json(report: dict) -> str:
    """The report of `inspect_groups` as indented JSON, without its private ("_"-prefixed) entries."""
    return json.dumps({k: v for k, v in report.items() if not k.startswith("_")}, indent=2, ensure_ascii=False)
