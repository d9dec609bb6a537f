"""Saving, loading (three paths), adapter management and refusal of bad adapters."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors import safe_open
from tiny_models import VOCAB, assert_unmodified, snapshot, tiny_model
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import focus_hf
from focus_hf.files import AdapterFileError
from focus_hf.tuner.layer import FocusLayer

SEQ = 48


def ids(seed=0):
    return torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def trained_like(model):
    """Give routers non-default values so that a load which silently kept the init would be caught."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "focus_" in name:
                parameter.add_(torch.randn_like(parameter))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny llama base saved to disk and a Focus adapter trained on it."""
    root = tmp_path_factory.mktemp("adapter")
    base = tiny_model("llama")
    base.save_pretrained(root / "base")
    model = trained_like(
        get_peft_model(
            AutoModelForCausalLM.from_pretrained(root / "base"), focus_hf.FocusConfig(num_groups=4, window=8, top_k=2)
        )
    )
    model.eval()
    model.save_pretrained(root / "adapter")
    with torch.no_grad():
        logits = model(input_ids=ids()).logits
    return root, logits


def fresh_base(root):
    return AutoModelForCausalLM.from_pretrained(root / "base").eval()


def test_gpt2_small_parameter_count():
    with torch.device("meta"):
        model = get_peft_model(GPT2LMHeadModel(GPT2Config()), focus_hf.FocusConfig(num_groups=4, group_dim=16))
    trainable, _ = model.get_nb_trainable_parameters()
    assert trainable == 12 * (768 * 16 + 4 * 16) == 148_224


def test_only_routers_are_trainable_and_get_gradients():
    model = get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, window=8))
    model.train()
    loss = model(input_ids=ids(), labels=ids()).loss
    loss.backward()
    for name, parameter in model.named_parameters():
        if "focus_" in name:
            assert parameter.requires_grad and parameter.grad is not None and parameter.grad.abs().sum() > 0, name
        else:
            assert not parameter.requires_grad and parameter.grad is None, name


def test_safetensors_holds_router_tensors_only(saved):
    root, _ = saved
    files = sorted(p.name for p in (root / "adapter").iterdir())
    assert "adapter_model.safetensors" in files and not any(f.endswith(".bin") for f in files)
    with safe_open(root / "adapter" / "adapter_model.safetensors", "pt") as handle:
        keys = list(handle.keys())
    assert len(keys) == 4 and all(k.rsplit(".", 1)[1] in ("focus_proj", "focus_centroids") for k in keys)


def test_peft_from_pretrained_is_bit_exact(saved):
    root, logits = saved
    model = PeftModel.from_pretrained(fresh_base(root), root / "adapter").eval()
    assert torch.equal(model(input_ids=ids()).logits, logits)


def test_transformers_load_adapter_is_bit_exact(saved):
    root, logits = saved
    model = fresh_base(root)
    model.load_adapter(str(root / "adapter"))
    assert torch.equal(model(input_ids=ids()).logits, logits)


def test_auto_model_from_adapter_folder_is_bit_exact(saved):
    root, logits = saved
    model = AutoModelForCausalLM.from_pretrained(root / "adapter").eval()
    assert torch.equal(model(input_ids=ids()).logits, logits)


def test_disabled_adapter_equals_base(saved):
    root, _ = saved
    base_logits = fresh_base(root)(input_ids=ids()).logits
    peft_model = PeftModel.from_pretrained(fresh_base(root), root / "adapter").eval()
    with peft_model.disable_adapter():
        torch.testing.assert_close(peft_model(input_ids=ids()).logits, base_logits, atol=1e-6, rtol=0)
    model = fresh_base(root)
    model.load_adapter(str(root / "adapter"))
    model.disable_adapters()
    torch.testing.assert_close(model(input_ids=ids()).logits, base_logits, atol=1e-6, rtol=0)
    model.enable_adapters()
    assert (model(input_ids=ids()).logits - base_logits).abs().max() > 1e-3


def test_several_adapters_side_by_side(saved, tmp_path):
    root, logits = saved
    other = trained_like(
        get_peft_model(fresh_base(root), focus_hf.FocusConfig(num_groups=8, group_dim=4, window=4, top_k=1))
    )
    other.eval()
    other_logits = other(input_ids=ids()).logits.detach()
    other.save_pretrained(tmp_path / "other")

    model = PeftModel.from_pretrained(fresh_base(root), root / "adapter").eval()
    model.load_adapter(tmp_path / "other", adapter_name="other")
    assert torch.equal(model(input_ids=ids()).logits, logits)
    model.set_adapter("other")
    assert torch.equal(model(input_ids=ids()).logits, other_logits)
    model.set_adapter("default")
    model.delete_adapter("other")
    assert torch.equal(model(input_ids=ids()).logits, logits)
    assert all("other" not in name for name, _ in model.named_parameters())

    hf_model = fresh_base(root)
    hf_model.load_adapter(str(root / "adapter"), adapter_name="a")
    hf_model.load_adapter(str(tmp_path / "other"), adapter_name="b")
    hf_model.set_adapter("b")
    assert torch.equal(hf_model(input_ids=ids()).logits, other_logits)
    hf_model.set_adapter("a")
    assert torch.equal(hf_model(input_ids=ids()).logits, logits)


def test_set_routing_and_group_assignments(saved):
    root, _ = saved
    model = PeftModel.from_pretrained(fresh_base(root), root / "adapter").eval()
    groups = focus_hf.group_assignments(model, ids())
    assert sorted(groups) == [0, 1] and groups[0].shape == (2, SEQ, 2)
    focus_hf.set_routing(model, "hard", top_k=1)
    assert focus_hf.group_assignments(model, ids())[0].shape == (2, SEQ, 1)
    assert torch.equal(focus_hf.group_assignments(model, ids())[0][..., 0], groups[0][..., 0])
    with pytest.raises(ValueError, match="top_k"):
        focus_hf.set_routing(model, "hard", top_k=5)
    with pytest.raises(ValueError, match="mode"):
        focus_hf.set_routing(model, "sparse")
    with pytest.raises(ValueError, match="backend"):
        focus_hf.set_routing(model, "hard", backend="triton")
    with pytest.raises(ValueError, match="no Focus adapter"):
        focus_hf.set_routing(fresh_base(root), "hard")


# --- bad input: a clear error, and the model left exactly as it was ---


def broken_copy(root, tmp_path, damage):
    folder = tmp_path / "broken"
    shutil.copytree(root / "adapter", folder)
    damage(folder)
    return folder


def truncate(folder):
    path = folder / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def corrupt(folder):
    path = folder / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[10:30] = b"\x00garbage-garbage-gar"
    path.write_bytes(bytes(data))


def pickle_only(folder):
    path = folder / "adapter_model.safetensors"
    torch.save({"x": torch.zeros(1)}, folder / "adapter_model.bin")
    path.unlink()


def missing_weights(folder):
    (folder / "adapter_model.safetensors").unlink()


def unknown_key(folder):
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config["num_grups"] = 8
    path.write_text(json.dumps(config))


def missing_config(folder):
    (folder / "adapter_config.json").unlink()


BAD_ADAPTERS = {
    "truncated": (truncate, "truncated"),
    "corrupt": (corrupt, "corrupt"),
    "pickle": (pickle_only, "pickle"),
    "missing-weights": (missing_weights, "Missing adapter_model.safetensors"),
    "unknown-config-key": (unknown_key, "num_grups"),
    "missing-config": (missing_config, "adapter_config.json|adapter model file not found"),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
@pytest.mark.parametrize("path", ["peft", "transformers"])
def test_bad_adapter_is_refused_and_model_untouched(saved, tmp_path, case, path):
    root, _ = saved
    damage, message = BAD_ADAPTERS[case]
    folder = broken_copy(root, tmp_path, damage)
    model = fresh_base(root)
    before = snapshot(model)
    with pytest.raises((ValueError, OSError), match=message):
        if path == "peft":
            PeftModel.from_pretrained(model, folder)
        else:
            model.load_adapter(str(folder))
    assert_unmodified(model, before)


@pytest.mark.parametrize("change", ["hidden_size", "num_hidden_layers"])
@pytest.mark.parametrize("path", ["peft", "transformers"])
def test_adapter_for_another_base_is_refused(saved, change, path):
    root, _ = saved
    config = fresh_base(root).config
    setattr(config, change, getattr(config, change) * 2)
    model = AutoModelForCausalLM.from_config(config).eval()
    before = snapshot(model)
    expected = {
        "hidden_size": "hidden_size: adapter has 48, model has 96",
        "num_hidden_layers": "num_routed_layers: adapter has 2, model has 4",
    }
    with pytest.raises(ValueError, match=expected[change]):
        if path == "peft":
            PeftModel.from_pretrained(model, root / "adapter")
        else:
            model.load_adapter(str(root / "adapter"))
    assert_unmodified(model, before)


def test_weights_for_another_shape_are_refused(saved, tmp_path):
    # The config claims the right base, but the tensors were made with another group count.
    root, _ = saved
    folder = broken_copy(root, tmp_path, lambda f: None)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["num_groups"] = 6
    (folder / "adapter_config.json").write_text(json.dumps(config))
    model = fresh_base(root)
    before = snapshot(model)
    with pytest.raises(AdapterFileError, match=r"focus_centroids has shape \[4, 16\], this model expects \[6, 16\]"):
        model.load_adapter(str(folder))
    assert_unmodified(model, before)


def test_invalid_config_values_are_refused():
    with pytest.raises(ValueError, match="top_k must be between 1 and num_groups=4"):
        focus_hf.FocusConfig(num_groups=4, top_k=5)
    with pytest.raises(ValueError, match="window"):
        focus_hf.FocusConfig(window=-1)
    with pytest.raises(ValueError, match="FocusConfig does not take the option"):
        focus_hf.FocusConfig(groups=4)


def test_unsupported_architecture_is_refused():
    from transformers import FalconConfig, FalconForCausalLM

    model = FalconForCausalLM(
        FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    )
    before = snapshot(model)
    with pytest.raises(ValueError, match="Focus cannot route 'falcon'"):
        get_peft_model(model, focus_hf.FocusConfig())
    assert_unmodified(model, before)


def test_unload_restores_base(saved):
    root, _ = saved
    base_logits = fresh_base(root)(input_ids=ids()).logits
    model = PeftModel.from_pretrained(fresh_base(root), root / "adapter").eval()
    with pytest.raises(NotImplementedError, match="nothing to fold into the base weights"):
        model.merge_and_unload()
    restored = model.unload()
    assert not any(isinstance(m, FocusLayer) for m in restored.modules())
    assert restored.config._attn_implementation == "sdpa"
    torch.testing.assert_close(restored(input_ids=ids()).logits, base_logits, atol=1e-6, rtol=0)
