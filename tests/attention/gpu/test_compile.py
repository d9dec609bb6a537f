"""torch.compile and the GPU path: Focus's attention function traces without a graph break in prefill and in
decoding steps (counted by torch._dynamo.explain on the path's CPU twin, whose kernels are opaque operators as the
CUDA ones are), and a compiled model gives the eager model's results."""

from __future__ import annotations

import pytest
import torch
from attention_cases import focus_llama
from tiny_models import VOCAB
from transformers import AttentionInterface, DynamicCache

import focus_hf
import focus_hf.attention.function as function
import focus_hf.attention.gpu.verify as verify
from focus_hf.attention.function import ATTENTION_NAME


def recorded_calls(model, ids, mask, new_tokens):
    """The attention function's calls during generate(): (module, routing, query, key, value, mask, kwargs)."""
    calls = []

    def recorder(module, query, key, value, attention_mask, **kwargs):
        routing = kwargs.get(function.ROUTING_ARGUMENT)
        if routing is not None:
            others = {name: value for name, value in kwargs.items() if name != function.ROUTING_ARGUMENT}
            calls.append((module, routing, query, key, value, attention_mask, others))
        return function.focus_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface._global_mapping[ATTENTION_NAME] = recorder
    try:
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    finally:
        AttentionInterface._global_mapping[ATTENTION_NAME] = function.focus_attention_forward
    return calls


def graph_breaks(call) -> int:
    module, routing, query, key, value, mask, kwargs = call

    def attention(module, query, key, value, mask):
        return function.focus_attention_forward(module, query, key, value, mask, focus_routing=routing, **kwargs)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(attention)(module, query, key, value, mask)
    return explained.graph_break_count


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("padded", [False, True], ids=["one-sample", "padded-batch"])
def test_attention_function_has_no_graph_break_on_the_gpu_path(top_k, padded):
    verify.forget_verdicts()
    model = focus_llama(top_k)
    focus_hf.set_routing(model, "hard", backend="gpu-path")
    ids = torch.randint(3, VOCAB, (2 if padded else 1, 300), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :20] = 0
    calls = recorded_calls(model, ids, mask, new_tokens=3)
    prefill, step = calls[0], calls[-1]
    assert prefill[2].shape[2] == 300 and step[2].shape[2] == 1
    assert graph_breaks(prefill) == 0
    assert graph_breaks(step) == 0


def test_compiled_model_gives_the_eager_results():
    verify.forget_verdicts()
    model = focus_llama(2)
    focus_hf.set_routing(model, "hard", backend="gpu-path")
    ids = torch.randint(3, VOCAB, (1, 200), generator=torch.Generator().manual_seed(3))
    next_ids = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(4))

    def run(forward):
        cache = DynamicCache()
        with torch.no_grad():
            logits = [forward(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]]
            for position in range(next_ids.shape[1]):
                step = forward(input_ids=next_ids[:, position : position + 1], past_key_values=cache, use_cache=True)
                logits.append(step.logits[:, -1])
        return torch.cat(logits)

    eager = run(model)
    torch._dynamo.reset()
    compiled = run(torch.compile(model, backend="eager"))
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=0)


def test_padded_decoding_step_under_compile_reads_the_paged_copy(monkeypatch):
    import focus_hf.attention.paths as paths

    verify.forget_verdicts()
    model = focus_llama(1)
    focus_hf.set_routing(model, "hard", backend="gpu-path")
    ids = torch.randint(3, VOCAB, (2, 300), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, :20] = 0
    step = recorded_calls(model, ids, mask, new_tokens=2)[-1]
    taken = []
    monkeypatch.setattr(paths, "decode_from_paged_keys", lambda *a, **k: taken.append(1) or torch.zeros(2, 1, 4, 12))
    monkeypatch.setattr(paths, "pattern_attention", lambda *a, **k: pytest.fail("a padded step read every block"))
    assert graph_breaks(step) == 0
    assert taken


def test_a_model_compiled_before_any_eager_call_verifies_outside_the_attention():
    verify.forget_verdicts()
    model = focus_llama(1)
    focus_hf.set_routing(model, "hard", backend="gpu-path")
    ids = torch.randint(3, VOCAB, (1, 200), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, backend="eager")(input_ids=ids).logits  # the first call of all
        focus_hf.set_routing(model, "hard", backend="reference")
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(compiled, expected, atol=1e-4, rtol=0)
    # The layer reached the verdict for the model's attention shape (4 query heads on 2 kv heads of 12).
    assert verify.is_verified(torch.device("cpu"), torch.float32, 2, 12, "gpu-path")
