"""Quantized and half-precision bases (issue 15, part 2): torchao int8 weight-only through transformers'
TorchAoConfig on CPU, and bf16 / fp16 bases. The routers stay fp32 in every case, so routing is computed in fp32
(`routing_scores` casts the hidden states to the projection's dtype) and a saved adapter holds fp32 tensors
whichever base dtype trained it."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file
from tiny_models import ids, make_adapter, tiny_model
from transformers import AutoModelForCausalLM

import focus_hf

torchao = pytest.importorskip("torchao", reason="torchao (test extra) cannot be installed on this platform")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quantized")
    reference = make_adapter(folder / "adapter")
    tiny_model("llama").save_pretrained(folder / "base")
    return folder, reference


def int8_base(folder):
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    config = TorchAoConfig(Int8WeightOnlyConfig())
    return AutoModelForCausalLM.from_pretrained(folder / "base", quantization_config=config, device_map="cpu").eval()


def router_items(model):
    return {name: p for name, p in model.named_parameters() if "focus_" in name}


def test_int8_base_loads_adapter_and_runs_hard_mode(saved):
    folder, reference = saved
    model = int8_base(folder)
    assert "Int8" in type(model.model.layers[0].self_attn.q_proj.weight).__name__
    model.load_adapter(folder / "adapter")
    assert all(p.dtype == torch.float32 for p in router_items(model).values())
    focus_hf.set_routing(model, "hard", top_k=2)
    with torch.no_grad():
        logits = model(input_ids=ids()).logits
    # int8 weights change the logits a little, not the routing's structure.
    assert torch.isfinite(logits).all() and (logits - reference).abs().max() < 0.05
    out = model.generate(ids()[:, :12], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 16)


def test_soft_router_training_on_frozen_int8_base(saved, tmp_path):
    folder, _ = saved
    model = get_peft_model(int8_base(folder), focus_hf.FocusConfig(num_groups=4, window=8, routing_mode="soft"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    assert len(trainable) == len(router_items(model))
    before = {n: p.detach().clone() for n, p in router_items(model).items()}
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    batch = ids()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    assert all(not torch.equal(p, before[n]) for n, p in router_items(model).items())
    model.save_pretrained(tmp_path / "trained")
    tensors = load_file(tmp_path / "trained" / "adapter_model.safetensors")
    assert tensors and all(t.dtype == torch.float32 for t in tensors.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_base_keeps_fp32_routers(saved, dtype, tmp_path):
    folder, _ = saved
    base = AutoModelForCausalLM.from_pretrained(folder / "base", dtype=dtype).eval()
    base.load_adapter(folder / "adapter")
    assert all(p.dtype == torch.float32 for p in router_items(base).values())
    fp32 = AutoModelForCausalLM.from_pretrained(folder / "base").eval()
    fp32.load_adapter(folder / "adapter")
    # Routing runs in fp32 on the half-precision hidden states: the hard groups match the fp32 model's on nearly
    # every token (a token whose two best groups are within bf16 rounding may flip).
    groups = focus_hf.group_assignments(base, ids())
    groups32 = focus_hf.group_assignments(fp32, ids())
    agreement = torch.stack([(groups[i][..., 0] == groups32[i][..., 0]).float().mean() for i in groups]).mean()
    assert agreement > 0.9, agreement

    # A soft-mode step on the half-precision base trains fp32 routers; the saved adapter is fp32, like one trained
    # on an fp32 base, and loads on either.
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(folder / "base", dtype=dtype),
        focus_hf.FocusConfig(num_groups=4, window=8, routing_mode="soft"),
    )
    model.train()
    batch = ids()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in router_items(model).values())
    model.save_pretrained(tmp_path / "half")
    assert all(t.dtype == torch.float32 for t in load_file(tmp_path / "half" / "adapter_model.safetensors").values())
    fp32.delete_adapter("default")
    fp32.load_adapter(tmp_path / "half")
