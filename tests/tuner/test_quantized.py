"""Quantized and half-precision bases: torchao int8 weight-only through transformers'
TorchAoConfig and bitsandbytes 8-bit / 4-bit NF4 through BitsAndBytesConfig, both on CPU, and bf16 / fp16 bases.
The routers stay fp32 in every case, so routing is computed in fp32 (`routing_scores` casts the hidden states to
the projection's dtype) and a saved adapter holds fp32 tensors whichever base dtype trained it."""

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
    assert_soft_step_trains_only_routers(model, tmp_path / "trained")


def unchanged(weight: torch.Tensor, before: torch.Tensor) -> bool:
    """Equality of two snapshots of a (possibly quantized) weight; torchao's tensors compare dequantized."""
    if hasattr(weight, "dequantize") and "torchao" in type(weight).__module__:
        return torch.equal(weight.dequantize(), before.dequantize())
    return torch.equal(weight, before)


def assert_soft_step_trains_only_routers(model, out) -> dict[str, torch.Tensor]:
    """One soft-mode AdamW step on a frozen (quantized) base: only the fp32 routers move, and the saved adapter holds
    fp32 tensors. Returns them."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and len(trainable) == len(router_items(model))
    assert all(p.dtype == torch.float32 for p in trainable)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in router_items(model).items()}
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    batch = ids()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    assert all(not torch.equal(p, before[n]) for n, p in router_items(model).items())
    assert all(unchanged(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    model.save_pretrained(out)
    tensors = load_file(out / "adapter_model.safetensors")
    assert tensors and all(t.dtype == torch.float32 for t in tensors.values())
    return tensors


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


# --- bitsandbytes (8-bit LLM.int8 and 4-bit NF4) on its CPU backend ------------------------------------------------
# Its CPU 4-bit kernel packs weights in blocks of 32 output rows, so this base has projections of 32 rows or more
# (the shared tiny Llama's kv projections have 24).
def bnb_config(bits: int):
    from transformers import BitsAndBytesConfig

    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)


@pytest.fixture(scope="module")
def bnb_folder(tmp_path_factory):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes (test extra) cannot be installed on this platform")
    from tiny_models import COMMON
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("bnb")
    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, "hidden_size": 64, "intermediate_size": 128}, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder / "base")
    model = get_peft_model(AutoModelForCausalLM.from_config(config), focus_hf.FocusConfig(num_groups=4, window=8))
    with torch.no_grad():
        for name, parameter in router_items(model).items():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(len(name))))
    model.save_pretrained(folder / "adapter")
    return folder


def bnb_base(folder, bits: int):
    return AutoModelForCausalLM.from_pretrained(
        folder / "base", quantization_config=bnb_config(bits), device_map="cpu"
    ).eval()


@pytest.mark.parametrize("bits", [8, 4])
def test_bitsandbytes_base_loads_adapter_and_runs_hard_mode_exactly(bnb_folder, bits):
    # The base's logits come from a second instance: with bitsandbytes 0.50.2, loading any PEFT adapter (LoRA
    # too) into a 4-bit CPU base that has already run a forward shifts the base's outputs (its CPU weight packing).
    with torch.no_grad():
        base_logits = bnb_base(bnb_folder, bits)(input_ids=ids()).logits
    model = bnb_base(bnb_folder, bits)
    weight = type(model.model.layers[0].mlp.up_proj.weight).__name__
    assert weight == ("Int8Params" if bits == 8 else "Params4bit")
    model.load_adapter(bnb_folder / "adapter")
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in router_items(model).values())
    # The first layer's attention output (what its o_proj reads): its inputs are the same in every run.
    attention_outputs = []
    model.model.layers[0].self_attn.base_layer.o_proj.register_forward_pre_hook(
        lambda module, args: attention_outputs.append(args[0].clone())
    )
    with torch.no_grad():
        # Every group probed: the hard pattern is plain causal attention, so the quantized base is unchanged.
        focus_hf.set_routing(model, "hard", top_k=4)
        unrestricted = model(input_ids=ids()).logits
        focus_hf.set_routing(model, "hard", top_k=1)
        fast = model(input_ids=ids()).logits
        focus_hf.set_routing(model, "hard", top_k=1, backend="reference")
        reference = model(input_ids=ids()).logits
    torch.testing.assert_close(unrestricted, base_logits, atol=1e-4, rtol=0)
    # The fast path on quantized projections equals the dense masked reference of the same pattern.
    torch.testing.assert_close(attention_outputs[1], attention_outputs[2], atol=1e-6, rtol=0)
    # LLM.int8 also rounds every projection's input to int8 per row, so a difference in the last float32 bit of
    # an attention output can move one input by a rounding step (~1e-2 relative): 8-bit logits agree to ~1e-3.
    torch.testing.assert_close(fast, reference, atol=1e-4 if bits == 4 else 5e-3, rtol=0)
    assert (fast - base_logits).abs().max() > 1e-3  # and top-1 routing does restrict attention
    out = model.generate(ids()[:, :12], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 16)


@pytest.mark.parametrize("bits", [8, 4])
def test_soft_router_training_on_frozen_bitsandbytes_base(bnb_folder, bits, tmp_path):
    model = get_peft_model(
        bnb_base(bnb_folder, bits), focus_hf.FocusConfig(num_groups=4, window=8, routing_mode="soft")
    )
    tensors = assert_soft_step_trains_only_routers(model, tmp_path / "trained")
    # The adapter trained on the quantized base loads on the full-precision one.
    full = AutoModelForCausalLM.from_pretrained(bnb_folder / "base").eval()
    full.load_adapter(tmp_path / "trained")
    assert len(router_items(full)) == len(tensors)
