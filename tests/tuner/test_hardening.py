"""Results that could go wrong silently: packed-document masks, output_attentions, atomic loads, beam search."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file, save_file
from tiny_models import ARCHITECTURES, assert_unmodified, ids, make_adapter, snapshot, tiny_model

from focus_hf import AdapterFileError, FocusConfig, set_routing
from focus_hf.tuner.layer import FocusLayer


def routed(arch: str):
    model = get_peft_model(tiny_model(arch), FocusConfig(num_groups=4, window=4, sink_tokens=1, top_k=1)).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "focus_" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 2)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_block_diagonal_packing_mask_matches_the_reference(arch, backend):
    model = routed(arch)
    length, docs = 48, ((0, 20), (20, 48))
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for start, end in docs:
        allowed[start:end, start:end] = True
    allowed &= torch.tril(torch.ones(length, length, dtype=torch.bool))
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None].expand(2, 1, -1, -1).clone()
    positions = torch.cat([torch.arange(end - start) for start, end in docs])[None].expand(2, -1)
    inputs = dict(input_ids=ids()[:, :length].repeat(1, 2)[:, :length], attention_mask=mask, position_ids=positions)
    out = {}
    for name in ("reference", backend):
        set_routing(model, "hard", backend=name)
        with torch.no_grad():
            out[name] = model(**inputs).logits
    torch.testing.assert_close(out[backend], out["reference"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_output_attentions_returns_the_real_pattern(mode):
    model = routed("llama")
    set_routing(model, mode)
    with torch.no_grad():
        out = model(input_ids=ids(), output_attentions=True)
    assert len(out.attentions) == 2
    for weights in out.attentions:
        assert weights is not None and weights.shape == (2, 4, 40, 40)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 40))
        assert torch.all(weights.triu(1) == 0)
        if mode == "hard":
            far = weights[..., 10:, :5].flatten()
            assert (far == 0).any()  # distant keys of other groups are hidden, as in the pattern


def test_failed_second_load_adapter_leaves_nothing_behind(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    make_adapter(good)
    bad.mkdir()
    shutil.copy(good / "adapter_config.json", bad)
    weights = load_file(str(good / "adapter_model.safetensors"))
    weights = {k: v.clone() for k, v in weights.items()}
    next(iter(weights.values()))[0, 0] = float("nan")
    save_file(weights, str(bad / "adapter_model.safetensors"))
    model = tiny_model("llama")
    model.load_adapter(str(good), adapter_name="a")
    before = snapshot(model)
    with pytest.raises(AdapterFileError, match="NaN"):
        model.load_adapter(str(bad), adapter_name="b")
    assert list(model.peft_config) == ["a"]
    assert snapshot(model)[0] == before[0]
    assert all(list(layer.focus_proj) == ["a"] for layer in model.modules() if isinstance(layer, FocusLayer))
    model.load_adapter(str(good), adapter_name="b")  # the retry works
    assert list(model.peft_config) == ["a", "b"]


def test_load_adapter_state_dict_with_wrong_shapes_changes_nothing(tmp_path):
    make_adapter(tmp_path)
    weights = {k: v[:, :3].contiguous() for k, v in load_file(str(tmp_path / "adapter_model.safetensors")).items()}
    config = FocusConfig(**{
        k: v for k, v in json.loads((tmp_path / "adapter_config.json").read_text()).items()
        if k in FocusConfig.__dataclass_fields__
    })  # fmt: skip
    model = tiny_model("llama")
    before = snapshot(model)
    with pytest.raises(AdapterFileError, match="has shape"):
        model.load_adapter(adapter_state_dict=weights, peft_config=config, adapter_name="x")
    assert_unmodified(model, before)


def test_beam_search_reorders_the_routing_state_with_the_cache():
    model = routed("llama")
    set_routing(model, "hard")
    kwargs = dict(input_ids=ids()[:, :12], max_new_tokens=8, num_beams=3, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    cached = model.generate(use_cache=True, **kwargs)
    uncached = model.generate(use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, atol=1e-5, rtol=0)


def test_every_architecture_is_covered():
    assert len(ARCHITECTURES) >= 8
