"""Focus on bases dispatched by accelerate: device_map="auto" with layers offloaded to disk."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model
from tiny_models import ids, make_adapter, tiny_model
from transformers import AutoModelForCausalLM

import focus_hf
from focus_hf.tuner.layer import FocusLayer

# Tiny llama (fp32): embeddings 24.6 kB, each decoder layer 83 kB, lm_head 24.6 kB. "all-disk" sends everything to
# disk; "mixed" keeps the embeddings and layer 0 in memory and offloads layer 1, the norm and the lm_head.
MEMORY = {"all-disk": {"cpu": 60_000}, "mixed": {"cpu": 200_000}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dispatch")
    reference = make_adapter(folder / "adapter")
    tiny_model("llama").save_pretrained(folder / "base")
    return folder, reference


def dispatched(folder, memory, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        folder / "base", device_map="auto", max_memory=memory, offload_folder=str(tmp_path / "offload")
    )
    assert "disk" in model.hf_device_map.values()
    if memory == MEMORY["mixed"]:
        assert model.hf_device_map["model.layers.0"] == "cpu" and model.hf_device_map["model.layers.1"] == "disk"
    return model.eval()


def routers(model):
    return {name: p for name, p in model.named_parameters() if "focus_" in name}


def assert_routers_real(model):
    found = routers(model)
    assert found and all(p.device.type == "cpu" for p in found.values()), {n: p.device for n, p in found.items()}


@pytest.mark.parametrize("memory", sorted(MEMORY))
def test_load_adapter_on_offloaded_base(saved, memory, tmp_path):
    folder, reference = saved
    model = dispatched(folder, MEMORY[memory], tmp_path)
    model.load_adapter(folder / "adapter")
    assert_routers_real(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids()).logits, reference, rtol=0, atol=1e-5)
    undispatched = tiny_model("llama")
    undispatched.load_adapter(folder / "adapter")
    prompt = ids()[:, :12]
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kwargs), undispatched.generate(prompt, **kwargs))


@pytest.mark.parametrize("memory", sorted(MEMORY))
def test_peft_from_pretrained_on_offloaded_base(saved, memory, tmp_path):
    folder, reference = saved
    model = PeftModel.from_pretrained(dispatched(folder, MEMORY[memory], tmp_path), folder / "adapter")
    assert_routers_real(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids()).logits, reference, rtol=0, atol=1e-5)
    out = model.generate(ids()[:, :12], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 16)


def test_get_peft_model_on_offloaded_base_trains(saved, tmp_path):
    folder, _ = saved
    config = focus_hf.FocusConfig(num_groups=4, window=8, routing_mode="soft")
    model = get_peft_model(dispatched(folder, MEMORY["mixed"], tmp_path), config)
    assert_routers_real(model)
    plain = get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, window=8, routing_mode="soft"))
    plain.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items() if "focus_" in k}, strict=False)
    batch = ids()
    losses = []
    for peft_model in (model, plain):
        peft_model.train()
        loss = peft_model(input_ids=batch, labels=batch).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-5)
    grads = {n: p.grad for n, p in routers(model).items()}
    plain_grads = {n: p.grad for n, p in routers(plain).items()}
    assert grads.keys() == plain_grads.keys() and all(g is not None for g in grads.values())
    for name in grads:
        torch.testing.assert_close(grads[name], plain_grads[name], rtol=1e-4, atol=1e-6)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "focus_" not in n)
    # The routers are recorded in the device map, so a save/load round trip keeps them real.
    model.save_pretrained(tmp_path / "trained")
    reloaded = dispatched(folder, MEMORY["mixed"], tmp_path)
    reloaded.load_adapter(tmp_path / "trained")
    for name, parameter in routers(reloaded).items():
        assert torch.equal(parameter, routers(model)["base_model.model." + name])


def test_unload_removes_router_entries(saved, tmp_path):
    folder, _ = saved
    model = dispatched(folder, MEMORY["mixed"], tmp_path)
    before = dict(model.hf_device_map)
    model.load_adapter(folder / "adapter")
    assert any("focus_" in key for key in model.hf_device_map)
    peft_model = get_peft_model(dispatched(folder, MEMORY["mixed"], tmp_path), focus_hf.FocusConfig(num_groups=4))
    base = peft_model.unload()
    assert base.hf_device_map == before
    assert not any(isinstance(m, FocusLayer) for m in base.modules())
