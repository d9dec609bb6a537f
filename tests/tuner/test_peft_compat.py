"""PEFT-compatibility battery: the workflows a PEFT user runs, on every tiny architecture. Each gives
the right result or refuses at the call with a clear error; none returns a wrong result silently."""

from __future__ import annotations

import pytest
import torch
from peft import AutoPeftModelForCausalLM, PeftModel, get_peft_model
from tiny_models import ARCHITECTURES, VOCAB, tiny_model
from transformers import AutoModelForCausalLM

from focus_hf import FocusConfig, FocusRuntimeError, set_routing
from focus_hf.errors import AdapterFileError, FocusMergeError
from focus_hf.tuner.layer import FocusLayer

assert len(ARCHITECTURES) >= 8


def perturb(model: torch.nn.Module, seed: int, adapter: str = "default") -> None:
    """Give the routers of `adapter` weights far from their initialisation, so that routing matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "focus_" in name and f".{adapter}" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 2)


def prompt(length: int = 32, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(7))


def config(**overrides) -> FocusConfig:
    return FocusConfig(**{"num_groups": 4, "window": 4, "sink_tokens": 1, "top_k": 1, **overrides})


@pytest.fixture(params=ARCHITECTURES)
def arch(request) -> str:
    return request.param


@pytest.fixture
def saved(arch, tmp_path):
    """A base checkpoint on disk and a perturbed adapter saved for it; the adapter's hard-mode logits."""
    tiny_model(arch).save_pretrained(tmp_path / "base")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), config())
    perturb(model, 1)
    model.eval()
    set_routing(model, "hard")
    model.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        logits = model(input_ids=prompt()).logits
    return tmp_path, logits


def base(root):
    return AutoModelForCausalLM.from_pretrained(root / "base").eval()


def hard_logits(model) -> torch.Tensor:
    set_routing(model, "hard")
    with torch.no_grad():
        return model(input_ids=prompt()).logits


def test_save_and_load_every_way(saved):
    root, expected = saved
    with torch.no_grad():
        dense = base(root)(input_ids=prompt()).logits
    assert not torch.allclose(dense, expected, atol=1e-4)  # the adapter does change the output
    loaded = {
        "PeftModel.from_pretrained": PeftModel.from_pretrained(base(root), root / "adapter").eval(),
        "AutoPeftModelForCausalLM": AutoPeftModelForCausalLM.from_pretrained(root / "adapter").eval(),
    }
    transformers_model = base(root)
    transformers_model.load_adapter(str(root / "adapter"))
    loaded["transformers load_adapter"] = transformers_model.eval()
    peft_second = PeftModel.from_pretrained(base(root), root / "adapter").eval()
    peft_second.load_adapter(root / "adapter", adapter_name="again")
    peft_second.set_adapter("again")
    loaded["PeftModel.load_adapter"] = peft_second
    for how, model in loaded.items():
        torch.testing.assert_close(hard_logits(model), expected, atol=1e-5, rtol=0, msg=how)


def test_add_set_delete_disable_adapters(saved):
    root, expected = saved
    model = PeftModel.from_pretrained(base(root), root / "adapter").eval()
    model.add_adapter("other", config())
    perturb(model, 2, adapter="other")
    model.eval()
    model.set_adapter("other")
    other = hard_logits(model)
    assert not torch.allclose(other, expected, atol=1e-4)
    model.set_adapter("default")
    torch.testing.assert_close(hard_logits(model), expected, atol=1e-5, rtol=0)
    with model.disable_adapter(), torch.no_grad():
        torch.testing.assert_close(model(input_ids=prompt()).logits, base(root)(input_ids=prompt()).logits)
    with pytest.raises(FocusRuntimeError, match="one adapter at a time"):
        model.base_model.set_adapter(["default", "other"])
    with pytest.raises(FocusRuntimeError, match="adapter_names"):
        model(input_ids=prompt(), adapter_names=["default", "other"])
    model.delete_adapter("other")
    assert not any("other" in name for name, _ in model.named_parameters())
    torch.testing.assert_close(hard_logits(model), expected, atol=1e-5, rtol=0)


def test_peft_model_set_adapter_with_two_names_is_refused_and_changes_nothing():
    # PeftModel.set_adapter looks the name up in peft_config first: a list used to fail there with PEFT's own
    # "unhashable type: 'list'" (a tuple with "not found"), before FocusModel's check.
    model = get_peft_model(tiny_model("llama"), config())
    model.add_adapter("other", config())
    model.set_adapter("other")
    layers = [module for module in model.modules() if isinstance(module, FocusLayer)]
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert trainable and all(".other" in name for name in trainable)
    refusal = r"one adapter at a time.*single name, e\.g\. set_adapter\('default'\)"
    for names in (["default", "other"], ("default", "other")):
        with pytest.raises(FocusRuntimeError, match=refusal):
            model.set_adapter(names)
        assert model.active_adapter == "other"
        assert model.base_model.active_adapter == "other"
        assert all(layer.active_adapters == ["other"] for layer in layers)
        assert {name for name, parameter in model.named_parameters() if parameter.requires_grad} == trainable
    model.set_adapter(["default"])  # a single name in a list is that name
    assert model.active_adapter == "default"
    assert all(layer.active_adapters == ["default"] for layer in layers)


def test_merge_apis_are_refused_and_unload_restores_the_base(saved):
    root, _ = saved
    model = PeftModel.from_pretrained(base(root), root / "adapter").eval()
    for merge in (model.merge_adapter, model.merge_and_unload, model.base_model.merge_and_unload):
        with pytest.raises(FocusMergeError, match="nothing to fold into the base weights"):
            merge()
    assert any(isinstance(m, FocusLayer) for m in model.modules())  # the refusal changed nothing
    restored = model.unload()
    assert not any(isinstance(m, FocusLayer) for m in restored.modules())
    with torch.no_grad():
        torch.testing.assert_close(restored(input_ids=prompt()).logits, base(root)(input_ids=prompt()).logits)


def test_pickle_save_is_refused_at_save(saved, tmp_path):
    root, _ = saved
    model = PeftModel.from_pretrained(base(root), root / "adapter")
    with pytest.raises(AdapterFileError, match="safe_serialization=False"):
        model.save_pretrained(tmp_path / "pickled", safe_serialization=False)
    assert not (tmp_path / "pickled").exists()  # refused before anything is written


def test_pickle_save_with_a_state_dict_is_refused_too(tmp_path):
    # With state_dict=... PEFT never calls the model's state_dict(): the refusal must not depend on it.
    model = get_peft_model(tiny_model("llama"), config())
    with pytest.raises(AdapterFileError, match=r"safe_serialization=False.*pickle.*safe_serialization=True"):
        model.save_pretrained(tmp_path / "pickled", safe_serialization=False, state_dict=model.state_dict())
    with pytest.raises(AdapterFileError, match="safe_serialization=False"):
        model.save_pretrained(tmp_path / "pickled", False, state_dict=model.state_dict())  # positional
    assert not (tmp_path / "pickled").exists()
    model.save_pretrained(tmp_path / "safe", state_dict=model.state_dict())
    assert sorted(path.name for path in (tmp_path / "safe").glob("adapter_model.*")) == ["adapter_model.safetensors"]


def test_save_does_not_ask_the_hub_about_the_base(tmp_path, monkeypatch):
    """PEFT's save_embedding_layers="auto" looks a Hub-id base up online; Focus has no embeddings to save."""
    import peft.utils.save_and_load

    asked = []
    monkeypatch.setattr(peft.utils.save_and_load, "check_file_exists_on_hf_hub", lambda *a, **k: asked.append(a))
    model = get_peft_model(tiny_model("llama"), config())
    model.peft_config["default"].base_model_name_or_path = "some-org/some-model"
    model.save_pretrained(tmp_path / "adapter")
    assert asked == [] and (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    "strategy",
    [
        dict(do_sample=False),
        dict(do_sample=True, top_k=1),  # sampling, deterministic: must equal the greedy answer
        dict(do_sample=False, num_beams=3),
    ],
    ids=["greedy", "sampling", "beam"],
)
def test_generation_with_and_without_cache_agree(saved, strategy):
    root, _ = saved
    model = PeftModel.from_pretrained(base(root), root / "adapter").eval()
    set_routing(model, "hard")
    common = dict(input_ids=prompt(12), max_new_tokens=6, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True, **strategy)  # fmt: skip
    torch.manual_seed(0)
    cached = model.generate(use_cache=True, **common)
    torch.manual_seed(0)
    uncached = model.generate(use_cache=False, **common)
    assert torch.equal(cached.sequences, uncached.sequences)
    if "num_beams" in strategy:
        torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, atol=1e-4, rtol=0)
    else:
        greedy = model.generate(input_ids=prompt(12), max_new_tokens=6, pad_token_id=0, do_sample=False)
        assert torch.equal(cached.sequences, greedy)


def test_soft_training_step_with_gradient_checkpointing(arch):
    model = get_peft_model(tiny_model(arch), config())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    routers = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert routers and all("focus_" in n for n in routers)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    loss = model(input_ids=prompt(), labels=prompt()).loss  # auto = soft in train mode
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    optimizer.step()
    assert any(not torch.equal(p, routers[n]) for n, p in model.named_parameters() if p.requires_grad)


def test_training_in_hard_mode_is_refused_with_the_reason(arch):
    model = get_peft_model(tiny_model(arch), config())
    model.train()
    set_routing(model, "hard")
    with pytest.raises(FocusRuntimeError, match="not differentiable.*soft mode"):
        model(input_ids=prompt(), labels=prompt())
