"""The reference path in chunks of queries (`reference.chunked_attention`) against plain dense masked attention: the
same outputs, weights and gradients whatever the chunk, with memory for one chunk at a time."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from attention_cases import padding, random_routing, states
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import get_peft_model
from tiny_models import VOCAB, tiny_model

import focus_hf
import focus_hf.attention.reference as reference
from focus_hf.attention.pattern import allowed_pairs, soft_gate
from focus_hf.attention.reference import (
    chunked_attention,
    dense_attention,
    hard_bias,
    reference_hard_attention,
    soft_bias,
)

ATOL = 1e-5
SCALING = 0.3
FLOOR = 1e-4


def textbook(query, key, value, allowed, bias=None, softcap=None):
    """Masked softmax attention in float64 with the keys repeated for each query head: ([batch, q, heads, dim],
    weights); rows with no allowed key are NaN (compare only the others)."""
    repeats = query.shape[1] // key.shape[1]
    key, value = (states.double().repeat_interleave(repeats, dim=1) for states in (key, value))
    scores = query.double() @ key.transpose(-1, -2) * SCALING
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.double()
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (weights @ value).transpose(1, 2), weights


def budget_for(rows, batch, heads, kv_len):
    """The budget that makes chunks of `rows` query rows over `kv_len` keys."""
    return rows * batch * heads * kv_len * 4


@st.composite
def cases(draw):
    kv_len = draw(st.integers(1, 40))
    num_groups = draw(st.integers(1, 5))
    side = draw(st.sampled_from(["none", "left", "right"]))
    return dict(
        batch=draw(st.integers(1, 2)),
        kv_heads=draw(st.integers(1, 2)),
        gqa=draw(st.sampled_from([1, 2, 3])),
        kv_len=kv_len,
        q_len=draw(st.integers(1, kv_len)),
        num_groups=num_groups,
        top_k=draw(st.integers(1, num_groups)),
        separate=draw(st.booleans()),
        window=draw(st.integers(0, 10)),
        sinks=draw(st.integers(0, 3)),
        side=side,
        pad=draw(st.integers(1, max(1, kv_len - 1))) if side != "none" else 0,
        token_major=draw(st.booleans()),
        rows=draw(st.integers(1, 12)),
        softcap=draw(st.sampled_from([None, 2.0])),
        seed=draw(st.integers(0, 2**16)),
    )


def build(case):
    """States, routing, sinks and the model's mask (causal, padding) of a case."""
    generator = torch.Generator().manual_seed(case["seed"])
    batch, kv_len, q_len = case["batch"], case["kv_len"], case["q_len"]
    heads = case["kv_heads"] * case["gqa"]
    query = states(generator, batch, heads, q_len, 8, case["token_major"])
    key = states(generator, batch, case["kv_heads"], kv_len, 8, case["token_major"])
    value = states(generator, batch, case["kv_heads"], kv_len, 8, case["token_major"])
    query_groups, key_groups = random_routing(
        generator, batch, kv_len, case["num_groups"], case["top_k"], "some", separate=case["separate"]
    )
    valid = padding(batch, kv_len, case["side"], case["pad"])
    sink = valid & (valid.cumsum(dim=1) - 1 < case["sinks"])
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    mask = None if case["side"] == "none" else causal & valid[:, None, None, :]
    probs = torch.softmax(torch.randn(batch, kv_len, case["num_groups"], generator=generator) * 3, dim=-1)
    return dict(
        query=query,
        key=key,
        value=value,
        query_groups=query_groups[:, kv_len - q_len :],
        key_groups=key_groups,
        sink=sink,
        mask=mask,
        causal=causal,
        query_probs=probs[:, kv_len - q_len :],
        key_probs=probs,
    )


def compare(case, output, expected, allowed):
    """Outputs agree on every query that sees a key; the others (padding) are finite."""
    real = allowed.any(dim=-1).expand(output.shape[0], output.shape[2], -1).transpose(1, 2)  # [batch, q, heads]
    assert real.any() or case["side"] != "none"
    torch.testing.assert_close(output[real], expected[real].float(), atol=ATOL, rtol=0)
    assert torch.isfinite(output).all()


@settings(max_examples=150, deadline=None)
@given(cases())
def test_reference_hard_attention_in_chunks_equals_dense_masked_attention(case):
    """The fallback of the hard path (its name and signature kept) in chunks of 1 to 12 queries."""
    s = build(case)
    q_len, kv_len = case["q_len"], case["kv_len"]
    positions = torch.arange(kv_len)
    query_positions = positions[kv_len - q_len :]
    routing = (s["query_groups"], s["key_groups"], s["sink"])
    allowed = allowed_pairs(*routing, query_positions, positions, case["window"])[:, None]
    allowed = allowed if s["mask"] is None else allowed & s["mask"]
    expected, _ = textbook(s["query"], s["key"], s["value"], allowed)
    budget = budget_for(case["rows"], case["batch"], s["query"].shape[1], kv_len)
    with mock.patch.object(reference, "CPU_CHUNK_BYTES", budget):
        output = reference_hard_attention(
            s["query"], s["key"], s["value"], s["mask"], *routing, case["window"], SCALING
        )
    compare(case, output, expected, allowed)


@settings(max_examples=150, deadline=None)
@given(cases(), st.sampled_from(["hard", "soft"]))
def test_chunks_equal_dense_masked_attention_with_weights(case, mode):
    """Both patterns, soft-capped logits and the weights `output_attentions` asks for (0 where a pair is hidden)."""
    s = build(case)
    q_len, kv_len, window = case["q_len"], case["kv_len"], case["window"]
    positions = torch.arange(kv_len)
    query_positions = positions[kv_len - q_len :]
    if mode == "hard":
        bias, gate = hard_bias(s["query_groups"], s["key_groups"], s["sink"], window, s["mask"]), None
        allowed = allowed_pairs(s["query_groups"], s["key_groups"], s["sink"], query_positions, positions, window)
        allowed = allowed[:, None]
    else:
        bias = soft_bias(s["query_probs"], s["key_probs"], s["sink"], window, FLOOR, s["mask"])
        gate = soft_gate(s["query_probs"], s["key_probs"], s["sink"], query_positions, positions, window, FLOOR)
        gate, allowed = gate[:, None], s["causal"][None, None]
    allowed = allowed if s["mask"] is None else allowed & s["mask"]
    expected, expected_weights = textbook(s["query"], s["key"], s["value"], allowed, gate, case["softcap"])
    budget = budget_for(case["rows"], case["batch"], s["query"].shape[1], kv_len)
    output, weights = chunked_attention(
        s["query"],
        s["key"],
        s["value"],
        bias,
        scaling=SCALING,
        softcap=case["softcap"],
        return_weights=True,
        budget=budget,
    )
    compare(case, output, expected, allowed)
    assert weights.shape == (case["batch"], s["query"].shape[1], q_len, kv_len)
    real = allowed.any(dim=-1).expand(*weights.shape[:3])
    torch.testing.assert_close(weights[real], expected_weights[real].float(), atol=ATOL, rtol=0)


def soft_case(seed=0, batch=2, heads=4, kv_heads=2, q_len=24, kv_len=30, groups=4):
    generator = torch.Generator().manual_seed(seed)
    tensors = dict(
        query=torch.randn(batch, heads, q_len, 8, generator=generator),
        key=torch.randn(batch, kv_heads, kv_len, 8, generator=generator),
        value=torch.randn(batch, kv_heads, kv_len, 8, generator=generator),
        query_logits=torch.randn(batch, q_len, groups, generator=generator),
        key_logits=torch.randn(batch, kv_len, groups, generator=generator),
    )
    for tensor in tensors.values():
        tensor.requires_grad_(True)
    sink = torch.zeros(batch, kv_len, dtype=torch.bool)
    sink[:, :2] = True
    mask = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    mask[1:, ..., :5] = False  # left padding of the second sample
    return tensors, sink, mask


def soft_output(tensors, sink, mask, budget, dropout=0.0, return_weights=False):
    bias = soft_bias(tensors["query_logits"].softmax(-1), tensors["key_logits"].softmax(-1), sink, 3, FLOOR, mask)
    return chunked_attention(
        tensors["query"],
        tensors["key"],
        tensors["value"],
        bias,
        scaling=SCALING,
        dropout=dropout,
        return_weights=return_weights,
        budget=budget,
    )


def test_soft_mode_gradients_in_chunks_equal_the_whole_call():
    """Soft-mode training: the gradients of the states and of the routing (through the gate) with chunks recomputed in
    the backward pass equal those of one dense call over every pair (today's unchunked reference)."""
    tensors, sink, mask = soft_case()
    upstream = torch.randn(2, 24, 4, 8, generator=torch.Generator().manual_seed(5))
    real = mask[:, 0].any(-1)[:, :, None, None]  # padding queries' outputs are meaningless, their gradients too

    def gradients(output):
        return torch.autograd.grad((output * upstream * real).sum(), list(tensors.values()))

    query_probs, key_probs = tensors["query_logits"].softmax(-1), tensors["key_logits"].softmax(-1)
    positions = torch.arange(30)
    gate = soft_gate(query_probs, key_probs, sink, positions[6:], positions, 3, FLOOR)[:, None]
    whole = dense_attention(tensors["query"], tensors["key"], tensors["value"], mask, scaling=SCALING, bias=gate)
    expected = gradients(whole)
    for rows in (1, 5, 24):
        chunked, _ = soft_output(tensors, sink, mask, budget_for(rows, 2, 4, 30))
        torch.testing.assert_close(chunked * real, whole * real, atol=ATOL, rtol=0)
        for got, wanted in zip(gradients(chunked), expected):
            torch.testing.assert_close(got, wanted, atol=ATOL, rtol=0)


def test_recomputed_chunks_reuse_their_dropout():
    """Attention dropout with chunks recomputed in the backward pass: the gradient of the values is the dropped
    weights of the forward pass (returned with the output) times the upstream gradient - the recomputation drew the
    same dropout."""
    tensors, sink, mask = soft_case(q_len=30)
    output, weights = soft_output(tensors, sink, mask, budget_for(4, 2, 4, 30), dropout=0.5, return_weights=True)
    assert (weights == 0).float().mean() > 0.3  # dropout ran
    upstream = torch.randn(output.shape, generator=torch.Generator().manual_seed(3))
    (grad_value,) = torch.autograd.grad((output * upstream).sum(), [tensors["value"]])
    # value head k is read by query heads 2k and 2k + 1: d/dvalue = sum over those heads of weights^T @ upstream
    per_head = weights.transpose(-1, -2).detach() @ upstream.transpose(1, 2)
    torch.testing.assert_close(grad_value, per_head.unflatten(1, (2, 2)).sum(2), atol=ATOL, rtol=0)


def test_training_keeps_one_chunk_of_scores_for_the_backward_pass():
    """What autograd keeps for the backward pass: the whole call's scores and weights in one chunk, nothing of them
    in several (each chunk is recomputed)."""
    tensors, sink, mask = soft_case(batch=1, q_len=128, kv_len=128)
    scores_bytes = 4 * 128 * 128 * 4  # one float32 q x kv per head

    def kept_bytes(budget):
        kept = []

        def pack(tensor):
            kept.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output, _ = soft_output(tensors, sink, mask, budget)
        output.sum().backward()  # the chunks recompute and their gradients flow
        assert tensors["query_logits"].grad.abs().sum() > 0
        return sum(kept)

    assert kept_bytes(budget_for(128, 1, 4, 128)) > 2 * scores_bytes
    assert kept_bytes(budget_for(8, 1, 4, 128)) < scores_bytes / 8


def test_chunks_follow_the_byte_budget():
    """The chunk size comes from the budget, in bytes of one chunk's float32 scores over every head and sample: the
    largest score tensor formed stays within it, whatever the length."""
    largest = []
    original = reference.dense_attention

    def recording(query, key, *args, **kwargs):
        largest.append(query.shape[0] * query.shape[1] * query.shape[2] * key.shape[2] * 4)
        return original(query, key, *args, **kwargs)

    tensors, sink, mask = soft_case(batch=2, q_len=30, kv_len=30)
    with mock.patch.object(reference, "dense_attention", recording), torch.no_grad():
        for budget in (1, 2000, 20_000):
            largest.clear()
            soft_output(tensors, sink, mask, budget)
            rows = max(1, budget // (2 * 4 * 30 * 4))
            assert len(largest) == -(-30 // rows)
            assert max(largest) <= max(budget, 2 * 4 * 30 * 4)


def focus_model(architecture, **options):
    config = dict(num_groups=4, group_dim=8, window=6, top_k=1, sink_tokens=2)
    config.update(options)
    return get_peft_model(tiny_model(architecture), focus_hf.FocusConfig(**config)).eval()


def padded_batch(seq=40):
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, seq), generator=generator)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, :11] = 0  # left padding
    return dict(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("architecture", ["llama", "gemma2"])
@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_model_in_chunks_equals_the_model_in_one_call(architecture, mode):
    """A model through the reference path (gemma2: soft-capped logits, sliding-window layers and their base
    attention) in chunks of one query equals the same model in one chunk: logits of the real tokens, attention
    weights, and in soft mode the routers' gradients."""
    model = focus_model(architecture)
    focus_hf.set_routing(model, mode, backend="reference")
    inputs = padded_batch()
    real = inputs["attention_mask"].bool()

    def run():
        model.zero_grad()
        out = model(**inputs, output_attentions=True)
        if mode == "soft":
            out.logits[real].logsumexp(-1).sum().backward()
        routers = {name: p.grad for name, p in model.named_parameters() if "focus_" in name and p.grad is not None}
        return out.logits.detach(), [weights.detach() for weights in out.attentions], routers

    logits, weights, routers = run()
    with mock.patch.object(reference, "CPU_CHUNK_BYTES", 1):
        chunked_logits, chunked_weights, chunked_routers = run()
    torch.testing.assert_close(chunked_logits[real], logits[real], atol=ATOL, rtol=0)
    for got, expected in zip(chunked_weights, weights):
        torch.testing.assert_close(got[0], expected[0], atol=ATOL, rtol=0)  # the unpadded sample: every row real
    assert routers.keys() == chunked_routers.keys() and (mode == "hard" or routers)
    for name, grad in routers.items():
        torch.testing.assert_close(chunked_routers[name], grad, atol=ATOL, rtol=0)
