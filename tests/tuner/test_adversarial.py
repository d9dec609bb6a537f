"""Untrusted input: an adapter folder or config from someone else gets a clear refusal that names what is
wrong, never a hang, a NaN, a silent cast, random routers, or injected code - and the model is left as it was."""

from __future__ import annotations

import ast
import json
import math
import re
import time
from pathlib import Path

import pytest
import torch
from card_checks import renderer
from huggingface_hub import ModelCard
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from tiny_models import assert_unmodified, make_adapter, snapshot, tiny_model

from focus_hf import AdapterFileError, FocusConfig, FocusConfigError
from focus_hf.card import write_model_card
from focus_hf.files import CONFIG_NAME, WEIGHTS_NAME
from focus_hf.tuner.config import FIELD_RANGES


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("good")
    make_adapter(folder)
    return folder


def copy_with(good: Path, folder: Path, *, config=None, tensors=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = json.loads((good / CONFIG_NAME).read_text())
    data.update(config or {})
    (folder / CONFIG_NAME).write_text(json.dumps(data))
    weights = load_file(str(good / WEIGHTS_NAME))
    if tensors is not None:
        weights = tensors(weights)
    save_file(weights, str(folder / WEIGHTS_NAME))
    return folder


def assert_refused(folder: Path, error, match: str) -> None:
    """Both loaders refuse the folder with `match` in the message and leave the base model untouched."""
    for load in ("peft", "transformers"):
        base = tiny_model("llama")
        before = snapshot(base)
        with pytest.raises(error, match=match):
            if load == "peft":
                PeftModel.from_pretrained(base, folder)
            else:
                base.load_adapter(str(folder))
        assert_unmodified(base, before)


# --- config ranges, at creation and at load ---------------------------------------------------------------------
BAD_VALUES = {
    "sinkhorn_iterations": [0, 100_000, True, 2.5],
    "num_groups": [0, 1_000_000],
    "group_dim": [0, 10**7],
    "window": [-1, 10**12],
    "sink_tokens": [-1, 10**9],
    "temperature": [0.0, 1e-40, float("nan"), float("inf"), -1.0, "0.1"],
    "gate_floor": [0.0, 1.0, 1e-300, float("nan")],
    "top_k": [0, 9],
}


@pytest.mark.parametrize("field,value", [(f, v) for f, values in BAD_VALUES.items() for v in values])
def test_out_of_range_options_are_refused_at_creation_naming_field_and_range(field, value):
    with pytest.raises(FocusConfigError, match=rf"FocusConfig\.{field} must be"):
        FocusConfig(**{field: value})


def test_every_numeric_option_has_a_range_in_its_message():
    for field, (low, high) in FIELD_RANGES.items():
        if field == "top_k":
            continue
        with pytest.raises(FocusConfigError) as raised:
            FocusConfig(**{field: high * 10 + 1})
        assert field in str(raised.value) and re.search(r"\[.+, .+\]", str(raised.value))


@pytest.mark.parametrize("field,value", [("sinkhorn_iterations", 100_000), ("temperature", 1e-40), ("window", -3)])
def test_out_of_range_options_are_refused_at_load(good, tmp_path, field, value):
    folder = copy_with(good, tmp_path / "bad", config={field: value})
    assert_refused(folder, FocusConfigError, rf"FocusConfig\.{field}")


# --- target_modules regex ------------------------------------------------------------------------------------
def test_catastrophic_target_modules_regex_is_bounded():
    model = tiny_model("llama")
    before = snapshot(model)
    start = time.monotonic()
    with pytest.raises(FocusConfigError, match="catastrophic backtracking"):
        get_peft_model(model, FocusConfig(target_modules=r"(.|\w|[a-z])+\d\d\d"))
    assert time.monotonic() - start < 10
    assert_unmodified(model, before)


@pytest.mark.parametrize("bad", ["(unclosed", "a" * 2000, 42, [1, 2]])
def test_malformed_target_modules_are_refused(bad):
    with pytest.raises(FocusConfigError, match="target_modules"):
        FocusConfig(target_modules=bad)


# --- weights: NaN/inf, dtypes, keys without the prefix ----------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_router_weights_are_refused_naming_the_tensor(good, tmp_path, value):
    def poison(weights):
        key = sorted(weights)[-1]
        weights[key] = weights[key].clone()
        weights[key][0, 0] = value
        return weights

    folder = copy_with(good, tmp_path / "nan", tensors=poison)
    key = sorted(load_file(str(folder / WEIGHTS_NAME)))[-1]
    assert_refused(folder, AdapterFileError, re.escape(repr(key)) + ".*NaN or infinite")


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int64, torch.bool, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_non_floating_router_tensors_are_refused_naming_the_tensor(good, tmp_path, dtype):
    def cast(weights):
        key = sorted(weights)[0]
        weights[key] = weights[key].to(dtype)
        return weights

    folder = copy_with(good, tmp_path / "dtype", tensors=cast)
    key = sorted(load_file(str(folder / WEIGHTS_NAME)))[0]
    assert_refused(folder, AdapterFileError, re.escape(repr(key)) + ".*has dtype")


def test_complex_state_dict_is_refused(good):
    base = tiny_model("llama")
    before = snapshot(base)
    weights = load_file(str(good / WEIGHTS_NAME))
    weights = {k: v.to(torch.complex64) for k, v in weights.items()}
    with pytest.raises(AdapterFileError, match="has dtype"):
        base.load_adapter(
            adapter_state_dict=weights, peft_config=FocusConfig.from_pretrained(str(good)), adapter_name="x"
        )
    assert_unmodified(base, before)


def test_keys_without_the_peft_prefix_are_refused_not_left_random(good, tmp_path):
    folder = copy_with(
        good, tmp_path / "noprefix", tensors=lambda w: {k.removeprefix("base_model.model."): v for k, v in w.items()}
    )
    assert_refused(folder, AdapterFileError, "lacks the 'base_model.model.' prefix")


# --- the model card --------------------------------------------------------------------------------------------
def test_card_escapes_html_and_quotes_the_usage_snippet(good, tmp_path):
    evil_base = 'x")\nimport os; os.system("echo pwned")\n#'
    folder = copy_with(
        good,
        tmp_path / "card",
        config={"base_model_name_or_path": evil_base, "base_model_type": "<script>alert(1)</script>"},
    )
    text = write_model_card(folder).read_text(encoding="utf-8")
    html = renderer().render(ModelCard(text).text)
    # The crafted type shows as the text it is (escaped for HTML by the renderer), never as an element.
    assert "<script>" not in html and "(&lt;script&gt;alert(1)&lt;/script&gt;)" in html
    snippet = text.split("```python\n", 1)[1].split("```", 1)[0]
    tree = ast.parse(snippet)  # still valid Python, and the crafted name stays one string argument
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    loaded = [c for c in calls if getattr(c.func, "attr", None) == "from_pretrained"][0]
    assert isinstance(loaded.args[0], ast.Constant) and loaded.args[0].value == evil_base
    assert not any(isinstance(node, ast.Import) and node.names[0].name == "os" for node in ast.walk(tree))
    assert not math.isnan(len(text))
