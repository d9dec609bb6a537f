"""Behaviour of Focus adapters on tiny models of every supported architecture family."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from peft import get_peft_model
from tiny_models import ARCHITECTURES, CONFIGS, VOCAB, tiny_model
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import focus_hf
import focus_hf.attention.cpu.cpu_path as cpu_path
import focus_hf.attention.cpu.grouped_keys as grouped_keys
import focus_hf.attention.function as function
from focus_hf.attention.cpu import native_decode
from focus_hf.tuner.layer import FocusLayer

SEQ = 64
ATOL = 1e-5


def focus_model(architecture, **options):
    config = dict(num_groups=4, group_dim=8, window=8, top_k=1, sink_tokens=2)
    config.update(options)
    return get_peft_model(tiny_model(architecture), focus_hf.FocusConfig(**config)).eval()


def tokens(batch=2, seq=SEQ, seed=1):
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize(
    "options, mode",
    [
        (dict(window=SEQ), "hard"),
        (dict(window=SEQ), "soft"),
        (dict(top_k=4), "hard"),
        (dict(num_groups=1), "hard"),
        (dict(num_groups=1), "soft"),
    ],
    ids=["window>=seq-hard", "window>=seq-soft", "top_k=K", "K=1-hard", "K=1-soft"],
)
def test_no_restriction_equals_base(architecture, options, mode):
    ids = tokens()
    base = tiny_model(architecture)(ids).logits
    model = focus_model(architecture, **options)
    focus_hf.set_routing(model, mode)
    torch.testing.assert_close(model(input_ids=ids).logits, base, atol=ATOL, rtol=0)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_sparse_pattern_changes_logits(architecture, mode):
    # Guards the tests above: with a real restriction the output must differ from the base model.
    ids = tokens()
    base = tiny_model(architecture)(ids).logits
    model = focus_model(architecture)
    focus_hf.set_routing(model, mode)
    assert (model(input_ids=ids).logits - base).abs().max() > 1e-3


# --- an independent dense masked reference, wired through the model's own attention calls ---

REFERENCE_NAME = "focus_test_reference"
_reference_groups: dict = {}


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """Textbook masked attention: loops over query positions, builds each row's allowed keys from the groups."""
    settings = _reference_groups["settings"]
    groups = _reference_groups["groups"][module.layer_idx]  # [batch, seq, top_k]
    batch, heads, seq, dim = query.shape
    repeats = heads // key.shape[1]
    output = torch.empty(batch, seq, heads, dim)
    scaling = dim**-0.5 if scaling is None else scaling
    for b in range(batch):
        for i in range(seq):
            allowed = torch.zeros(seq, dtype=torch.bool)
            for j in range(i + 1):
                allowed[j] = (
                    i - j <= settings["window"]
                    or j < settings["sink_tokens"]
                    or bool((groups[b, i] == groups[b, j, 0]).any())
                )
            if attention_mask is not None:
                allowed &= attention_mask[b, 0, i]
            for h in range(heads):
                logits = (key[b, h // repeats] @ query[b, h, i]) * scaling
                if softcap is not None:
                    logits = torch.tanh(logits / softcap) * softcap
                weights = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=0)
                output[b, i, h] = weights @ value[b, h // repeats]
    return output, None


AttentionInterface.register(REFERENCE_NAME, _reference_attention)
AttentionMaskInterface.register(REFERENCE_NAME, sdpa_mask)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("top_k", [1, 2])
def test_hard_mode_equals_independent_reference(architecture, top_k):
    ids = tokens(seq=40)
    settings = dict(window=6, sink_tokens=2)
    model = focus_model(architecture, top_k=top_k, **settings)
    focus_hf.set_routing(model, "hard")
    focus_logits = model(input_ids=ids).logits
    _reference_groups.update(settings=settings, groups=focus_hf.group_assignments(model, ids))
    base = tiny_model(architecture)
    base.config._attn_implementation = REFERENCE_NAME
    torch.testing.assert_close(focus_logits, base(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_causal(architecture, mode):
    model = focus_model(architecture)
    focus_hf.set_routing(model, mode)
    ids = tokens(batch=1)
    changed = ids.clone()
    cut = 40
    changed[:, cut + 1 :] = torch.randint(3, VOCAB, (1, SEQ - cut - 1), generator=torch.Generator().manual_seed(7))
    first, second = model(input_ids=ids).logits, model(input_ids=changed).logits
    torch.testing.assert_close(first[:, : cut + 1], second[:, : cut + 1], atol=ATOL, rtol=0)
    assert (first[:, cut + 1 :] - second[:, cut + 1 :]).abs().max() > 1e-3


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_samples_alone(architecture, mode, side):
    model = focus_model(architecture)
    focus_hf.set_routing(model, mode)
    lengths = [SEQ, 37]
    samples = [tokens(batch=1, seq=n, seed=n)[0] for n in lengths]
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    mask = torch.zeros(2, SEQ, dtype=torch.long)
    for row, sample in enumerate(samples):
        span = slice(SEQ - len(sample), SEQ) if side == "left" else slice(0, len(sample))
        ids[row, span], mask[row, span] = sample, 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # absolute position embeddings (gpt2) need real positions
    batched = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    for row, sample in enumerate(samples):
        alone = model(input_ids=sample[None]).logits[0]
        real = mask[row].bool()
        torch.testing.assert_close(batched[row, real], alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_generate_with_cache_equals_recomputation(architecture):
    model = focus_model(architecture)
    focus_hf.set_routing(model, "hard")
    prompt = tokens(batch=1, seq=30)
    new_tokens = 16
    generated = model.generate(
        input_ids=prompt, max_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None
    )
    sequence = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            next_token = model(input_ids=sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_token], dim=1)
    assert torch.equal(generated, sequence)


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_static_cache_generates_as_dynamic(architecture, backend):
    # A StaticCache hands the attention every pre-allocated slot (the unwritten ones masked) and a mask as wide: the
    # routed tokens are its first slots. Padded batches and the sliding-window layers of gemma2 (24) and mistral
    # (40), whose static buffers fill up and roll within these 46 tokens, included. "auto" runs these short calls
    # as one masked call, "sdpa" the sparse paths, whose gathers read the cache's buffer (`partials.slot_buffer`).
    model = focus_model(architecture)
    focus_hf.set_routing(model, "hard", backend=backend)
    short, long = tokens(batch=1, seq=21, seed=3), tokens(batch=1, seq=30, seed=4)
    ids = torch.cat([torch.cat([torch.zeros(1, 9, dtype=torch.long), short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 9), torch.ones(1, 21)], 1), torch.ones(1, 30)]).long()
    options = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    for inputs in (dict(input_ids=long), dict(input_ids=ids, attention_mask=mask)):
        dynamic = model.generate(**inputs, **options)
        static = model.generate(**inputs, cache_implementation="static", **options)
        assert torch.equal(static, dynamic)


def test_unwritten_slots_must_be_masked():
    from focus_hf.attention.function import filled_slots
    from focus_hf.errors import FocusRuntimeError

    key = value = torch.zeros(1, 2, 12, 4)
    mask = torch.ones(1, 1, 1, 12, dtype=torch.bool)
    mask[..., 8:] = False
    sliced = filled_slots(key, value, mask, filled=8, q_len=1)
    assert sliced[0].shape[2] == 8 and sliced[2].shape[-1] == 8
    mask[..., 9] = True  # a slot past the routed tokens that a query may see: not a static cache's layout
    with pytest.raises(FocusRuntimeError, match="does not hide the slots after the first 8"):
        filled_slots(key, value, mask, filled=8, q_len=1)
    with pytest.raises(FocusRuntimeError, match="12 keys but only 8 tokens were routed"):
        filled_slots(key, value, None, filled=8, q_len=1)


@pytest.mark.parametrize("architecture", ["llama", "gpt2", "mistral"])
def test_padded_generate_matches_unpadded(architecture):
    model = focus_model(architecture)
    focus_hf.set_routing(model, "hard")
    short, long = tokens(batch=1, seq=21, seed=3), tokens(batch=1, seq=30, seed=4)
    ids = torch.cat([torch.cat([torch.zeros(1, 9, dtype=torch.long), short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 9), torch.ones(1, 21)], 1), torch.ones(1, 30)]).long()
    options = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    batched = model.generate(input_ids=ids, attention_mask=mask, **options)
    assert torch.equal(batched[0, 9:], model.generate(input_ids=short, **options)[0])
    assert torch.equal(batched[1], model.generate(input_ids=long, **options)[0])


# --- decoding steps that read the group-sorted copy of the distant keys (attention/cpu/grouped_keys.py) ---


@pytest.mark.parametrize("architecture", ["llama", "gpt2", "qwen3"])
@pytest.mark.parametrize(
    "options",
    [dict(), dict(top_k=2, query_projection=True), dict(dense_heads=[[0, 0], [1, 1]])],
    ids=["shared", "query-router-top-2", "dense-heads"],
)
def test_generate_reading_the_copy_equals_recomputation(architecture, options):
    model = focus_model(architecture, **options)
    focus_hf.set_routing(model, "hard", backend="sdpa")
    prompt = tokens(batch=1, seq=30)
    new_tokens = 12
    with mock.patch.object(cpu_path, "grouped_decode", wraps=cpu_path.grouped_decode) as grouped_decode:
        generated = model.generate(
            input_ids=prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    assert grouped_decode.call_count >= new_tokens - 1
    sequence = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=sequence, use_cache=False).logits[:, -1]
            sequence = torch.cat([sequence, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, sequence)


@pytest.mark.parametrize(
    "options",
    [dict(top_k=1), dict(top_k=2), dict(top_k=1, dense_heads=[[0, 0], [1, 1]])],
    ids=["top-1", "top-2", "dense-heads"],
)
def test_steps_in_the_c_decoding_kernel_equal_a_forward_without_cache(options):
    """head_dim 16 (the tiny models' 12 is not a size the kernel takes): the steps' attention runs in the C kernel
    (`attention/cpu/native_decode.py`) - routed heads over their groups and window, dense heads over the whole cache."""
    if not native_decode.serves(torch.float32, 4, 2, 16):
        pytest.skip("no C compiler to build the decoding kernel with")
    torch.manual_seed(0)
    config = CONFIGS["llama"]()
    config.head_dim = 16
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    focus = focus_hf.FocusConfig(num_groups=4, group_dim=8, window=8, sink_tokens=2, **options)
    model = get_peft_model(base, focus).eval()
    focus_hf.set_routing(model, "hard", backend="sdpa")
    sequence = tokens(batch=1, seq=44)
    served = []

    def recorded(query, runs, scale):
        served.append((len(runs), native_decode.attend_runs(query, runs, scale)))
        return served[-1][1]

    def recorded_step(*args):
        status = native_decode.grouped_step(*args)
        served.append(("step", status if isinstance(status, torch.Tensor) else None))
        return status

    with (
        torch.no_grad(),
        mock.patch.object(grouped_keys, "attend_runs", recorded),
        mock.patch.object(grouped_keys, "grouped_step", recorded_step),
        mock.patch.object(function, "attend_runs", recorded),
    ):
        whole = model(input_ids=sequence, use_cache=False).logits
        cache, steps = model(input_ids=sequence[:, :30], use_cache=True).past_key_values, []
        for position in range(30, 44):
            steps.append(model(input_ids=sequence[:, position : position + 1], past_key_values=cache).logits)
    # Every step of both layers: one call per run of routed heads (the append and the attention: `grouped_step`), and
    # per run of dense heads (one run: the cache).
    calls_per_step = 4 if "dense_heads" in options else 2
    assert len(served) == 14 * calls_per_step and all(output is not None for _, output in served)
    assert any(runs == 1 for runs, _ in served) == ("dense_heads" in options)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole[:, 30:], atol=1e-5, rtol=0)


def test_step_logits_equal_a_forward_without_cache():
    # Closer than the argmax: every decoding step's logits against a forward over the whole sequence.
    model = focus_model("llama", top_k=2)
    focus_hf.set_routing(model, "hard", backend="sdpa")
    sequence = tokens(batch=1, seq=44)
    with torch.no_grad():
        whole = model(input_ids=sequence, use_cache=False).logits
        output = model(input_ids=sequence[:, :30], use_cache=True)
        cache, steps = output.past_key_values, []
        for position in range(30, 44):
            steps.append(model(input_ids=sequence[:, position : position + 1], past_key_values=cache).logits)
    assert getattr(cache, "_focus_grouped_keys")  # the steps read the copies
    torch.testing.assert_close(torch.cat(steps, dim=1), whole[:, 30:], atol=1e-5, rtol=0)


def test_decode_copy_off_gathers_with_the_same_tokens():
    model = focus_model("llama")
    prompt = tokens(batch=1, seq=30)
    options = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    focus_hf.set_routing(model, "hard", backend="sdpa", decode_copy=False)
    with mock.patch.object(cpu_path, "grouped_decode", wraps=cpu_path.grouped_decode) as grouped_decode:
        gathered = model.generate(input_ids=prompt, **options)
    assert grouped_decode.call_count == 0
    focus_hf.set_routing(model, "hard", backend="sdpa")  # None keeps the choice
    assert all(not layer.decode_copy for layer in focus_hf.tuner.controls.focus_layers(model))
    focus_hf.set_routing(model, "hard", backend="sdpa", decode_copy=True)
    with mock.patch.object(cpu_path, "grouped_decode", wraps=cpu_path.grouped_decode) as grouped_decode:
        assert torch.equal(model.generate(input_ids=prompt, **options), gathered)
    assert grouped_decode.call_count > 0


def test_batched_generate_reads_a_copy_per_sample():
    # Left padding: each sample's sinks and distant keys are its own; the copies leave its padding out.
    model = focus_model("llama", top_k=2, query_projection=True)
    focus_hf.set_routing(model, "hard", backend="sdpa")
    short, long = tokens(batch=1, seq=21, seed=3), tokens(batch=1, seq=30, seed=4)
    ids = torch.cat([torch.cat([torch.zeros(1, 9, dtype=torch.long), short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 9), torch.ones(1, 21)], 1), torch.ones(1, 30)]).long()
    options = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    served = []
    original = cpu_path.grouped_decode

    def spy(query, *args):
        output = original(query, *args)
        served.append(query.shape[0] == 2 and output is not None)
        return output

    with mock.patch.object(cpu_path, "grouped_decode", spy):
        batched = model.generate(input_ids=ids, attention_mask=mask, **options)
    assert any(served)  # steps of both samples read their copies
    assert torch.equal(batched[0, 9:], model.generate(input_ids=short, **options)[0])
    assert torch.equal(batched[1], model.generate(input_ids=long, **options)[0])


def test_beam_search_stops_using_the_copies_once_the_cache_reorders():
    from transformers import DynamicCache

    model = focus_model("llama")
    focus_hf.set_routing(model, "hard", backend="sdpa")
    prompt = tokens(batch=1, seq=30)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    gathered = model.generate(input_ids=prompt, num_beams=3, **options)
    cache = DynamicCache(config=model.config)
    beams = model.generate(input_ids=prompt, num_beams=3, past_key_values=cache, **options)
    assert getattr(cache, "_focus_grouped_keys") == "reordered"
    focus_hf.set_routing(model, "hard", backend="sdpa", decode_copy=False)
    assert torch.equal(beams, model.generate(input_ids=prompt, num_beams=3, **options))
    assert torch.equal(beams, gathered)


def test_kept_centroid_directions_follow_the_centroids():
    # Inference keeps the centroids' normalised directions between calls (`FocusLayer._kept_directions`); an
    # in-place update (an optimizer step, loading weights) or a replaced parameter must be seen at the next call.
    model = focus_model("llama")
    layer = next(module for module in model.modules() if isinstance(module, FocusLayer))
    hidden = torch.randn(1, 5, layer.focus_proj["default"].shape[0], generator=torch.Generator().manual_seed(0))

    def fresh_scores():
        centroids = layer.focus_centroids["default"]
        directions = torch.nn.functional.normalize(centroids.detach().float(), dim=-1).T
        projected = hidden @ layer.focus_proj["default"].detach()
        return (
            (projected @ directions)
            / projected.norm(dim=-1, keepdim=True)
            / layer.focus_settings["default"].temperature
        )

    with torch.no_grad():
        torch.testing.assert_close(layer.router_scores("default", hidden, query_side=False), fresh_scores())
        layer.focus_centroids["default"].mul_(-1).add_(0.5)  # in place
        torch.testing.assert_close(layer.router_scores("default", hidden, query_side=False), fresh_scores())
        layer.focus_centroids["default"] = torch.nn.Parameter(torch.randn_like(layer.focus_centroids["default"]))
        torch.testing.assert_close(layer.router_scores("default", hidden, query_side=False), fresh_scores())
    # With gradients the directions are computed in the graph: the centroids get a gradient.
    layer.router_scores("default", hidden, query_side=False).sum().backward()
    assert layer.focus_centroids["default"].grad is not None
