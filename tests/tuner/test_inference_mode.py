"""torch.inference_mode: a Focus model loaded, adapted and run inside it gives the results it gives under no_grad, and
a model moves in and out of it freely (inference tensors have no version counter, and refuse to be saved for a
backward pass: neither may reach what the layers keep)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model, set_peft_model_state_dict
from tiny_models import VOCAB, tiny_model
from transformers import AutoModelForCausalLM, DynamicCache

import focus_hf

# Long enough to route beyond the window and dense_below, short enough for a quick test.
PROMPT = torch.randint(3, VOCAB, (1, 120), generator=torch.Generator().manual_seed(3))
CONFIG = dict(num_groups=4, window=16, dense_below=32, sink_tokens=2, query_projection=True)


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "focus_" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator))
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny llama base and a Focus adapter for it on disk; the adapter's greedy tokens after PROMPT, under no_grad."""
    root = tmp_path_factory.mktemp("inference-mode")
    tiny_model("llama").save_pretrained(root / "base")
    model = perturbed(get_peft_model(base(root), focus_hf.FocusConfig(**CONFIG)), seed=1)
    model.save_pretrained(root / "adapter")
    want = greedy(model)
    with model.disable_adapter():
        assert not torch.allclose(greedy(model), want)  # the adapter's routing shows in the logits
    return root, want


def base(root):
    return AutoModelForCausalLM.from_pretrained(root / "base").eval()


def greedy(model: torch.nn.Module, new_tokens: int = 12) -> torch.Tensor:
    """The logits of `new_tokens` greedy decoding steps after PROMPT [new_tokens, VOCAB] (routed: hard, sparse path;
    under no_grad unless a mode is set already)."""
    focus_hf.set_routing(model, "hard", backend="sdpa")
    with torch.no_grad():
        output = model.generate(
            PROMPT,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return torch.cat(output.logits)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got, want), f"largest difference {(got - want).abs().max():.3g}"


@pytest.mark.parametrize("loader", ["peft", "auto", "load_adapter"])
def test_loaded_and_run_inside_inference_mode(saved, loader):
    root, want = saved
    with torch.inference_mode():
        if loader == "peft":
            model = PeftModel.from_pretrained(base(root), root / "adapter")
        elif loader == "auto":
            model = AutoModelForCausalLM.from_pretrained(root / "adapter")
        else:
            model = base(root)
            model.load_adapter(str(root / "adapter"))
        model.eval()
        assert all(layer.focus_proj["default"].is_inference() for layer in focus_hf.focus_layers(model))
        assert_same(greedy(model), want)
    # and outside it again: the routers stay inference tensors, which no_grad reads as well
    assert_same(greedy(model), want)


def test_adapted_inside_inference_mode(saved):
    root, _ = saved
    with torch.no_grad():
        model = perturbed(get_peft_model(base(root), focus_hf.FocusConfig(**CONFIG)), seed=2)
        want = greedy(model)
    with torch.inference_mode():
        adapted = get_peft_model(base(root), focus_hf.FocusConfig(**CONFIG))
        set_peft_model_state_dict(adapted, {k: v for k, v in model.state_dict().items() if "focus_" in k})
        assert_same(greedy(adapted.eval()), want)


def test_switched_in_and_out_of_inference_mode(saved):
    root, want = saved
    model = PeftModel.from_pretrained(base(root), root / "adapter").eval()
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode, torch.no_grad):
        with mode():
            assert_same(greedy(model), want)


def test_one_generation_across_inference_mode(saved):
    """A prompt read under inference_mode and decoded outside it (and back): the routing state on the cache, made of
    inference tensors, keeps working."""
    root, want = saved
    model = PeftModel.from_pretrained(base(root), root / "adapter").eval()
    focus_hf.set_routing(model, "hard", backend="sdpa")
    cache = DynamicCache()
    with torch.inference_mode():
        logits = [model(input_ids=PROMPT, past_key_values=cache, use_cache=True).logits[0, -1:]]
    for step in range(len(want) - 1):
        with torch.inference_mode() if step % 3 == 2 else torch.no_grad():
            token = logits[-1].argmax(-1, keepdim=True)
            logits.append(model(input_ids=token, past_key_values=cache, use_cache=True).logits[0, -1:])
    torch.testing.assert_close(torch.cat(logits), want, atol=1e-5, rtol=1e-5)


def test_frozen_routers_after_inference_mode_let_the_rest_train(saved):
    """Router weights worked out under inference_mode are kept as ordinary tensors: a later forward pass that autograd
    records (the routers frozen, something else training) can save them for its backward pass."""
    root, _ = saved
    model = PeftModel.from_pretrained(base(root), root / "adapter").eval()
    focus_hf.set_routing(model, "hard", backend="sdpa")
    with torch.inference_mode():
        model(input_ids=PROMPT)  # works the routers' derived weights out, under inference_mode
    embeddings = model.get_input_embeddings()
    embeddings.weight.requires_grad_(True)
    logits = model(input_ids=PROMPT).logits
    logits.float().pow(2).mean().backward()
    assert embeddings.weight.grad is not None and embeddings.weight.grad.abs().sum() > 0


def test_weights_loaded_under_inference_mode_replace_the_kept_ones(saved):
    """Loading writes inference-tensor routers in place, which no version counter records: what the layers worked out
    from the old weights is dropped all the same."""
    root, want = saved
    other = perturbed(get_peft_model(base(root), focus_hf.FocusConfig(**CONFIG)), seed=7)
    other_logits = greedy(other)
    assert not torch.allclose(other_logits, want)  # else the test could not tell the two adapters apart
    with torch.inference_mode():
        model = PeftModel.from_pretrained(base(root), root / "adapter").eval()
        assert_same(greedy(model), want)
        set_peft_model_state_dict(model, {k: v for k, v in other.state_dict().items() if "focus_" in k})
        assert_same(greedy(model), other_logits)
