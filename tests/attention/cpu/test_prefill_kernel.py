"""The CPU prefill kernel (`native_prefill.prefill_attention`, csrc/prefill.c): many queries over many keys - causal,
on a staircase or unordered; with the Focus pattern or the fast path's local part evaluated from group bits - against a
float64 softmax over the pairs the rule allows (`pattern.allowed_pairs`, `pattern.probes`), in float32 and in
bfloat16 (float32 sums; exact within bfloat16's rounding of the softmax weights and of the output)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import focus_hf.attention.cpu.native as native
import focus_hf.attention.cpu.native_prefill as native_prefill
from focus_hf.attention.backends import cpu_kernel
from focus_hf.attention.pattern import LOCAL_BITS_MAX_GROUPS, allowed_pairs, local_bits, pattern_bits, probes

needs_kernel = pytest.mark.skipif(native.native_kernels() is None, reason="no C compiler to build the kernel with")
FLOAT_MIN = torch.finfo(torch.float32).min


def float64_attention(query, key, value, visible, scale):
    """Output [batch, heads, L, dim] and lse [batch, heads, L] of a float64 softmax over `visible` [batch, L, S];
    rows that see nothing: output 0, lse finfo.min (the kernel's convention)."""
    sharing = query.shape[1] // key.shape[1]
    key, value = (tensor.double().repeat_interleave(sharing, 1) for tensor in (key, value))
    scores = torch.einsum("bhld,bhsd->bhls", query.double(), key) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    seen = visible.any(dim=-1)[:, None]
    weights = torch.where(seen[..., None], torch.softmax(scores, dim=-1), 0.0)
    output = torch.einsum("bhls,bhsd->bhld", weights.nan_to_num(0.0), value)
    return output, torch.where(seen, lse, FLOAT_MIN)


@needs_kernel
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 3),
    sharing=st.sampled_from([1, 3, 4]),
    dim=st.sampled_from([16, 32, 48, 64, 128]),
    keys=st.sampled_from([1, 5, 63, 64, 65, 130, 257]),
    queries=st.sampled_from(["all", "one", "few", "some"]),
    order=st.sampled_from(["none", "causal", "staircase"]),
    rule=st.sampled_from(["none", "pattern", "local"]),
    num_groups=st.integers(1, 31),
    top_k=st.integers(1, 3),
    window=st.integers(0, 160),
    sinks=st.integers(0, 3),
    padding=st.sampled_from(["none", "left", "right"]),
    token_major=st.booleans(),
    magnitude=st.sampled_from([0.3, 1.0, 4.0]),
    merge=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_prefill_equals_a_float64_softmax_over_the_allowed_pairs(
    batch, kv_heads, sharing, dim, keys, queries, order, rule, num_groups, top_k, window, sinks, padding,
    token_major, magnitude, merge, dtype, seed,
):  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    length = {"all": keys, "one": 1, "few": min(keys, 5), "some": max(1, keys - 40)}[queries]
    first = keys - length
    heads = kv_heads * sharing
    if rule == "local":  # the local part of a prefill: causal, and bit 30 marks the sinks taken elsewhere
        order, num_groups = "causal", min(num_groups, LOCAL_BITS_MAX_GROUPS)

    def states(count, n):
        if token_major:  # fresh projections: [batch, n, heads, dim] viewed head-major
            return torch.randn(batch, n, count, dim, generator=generator).transpose(1, 2)
        return torch.randn(batch, count, n, dim, generator=generator)

    # Large query magnitudes give peaked softmaxes: the running maximum must rescale what came before it.
    query, key, value = states(heads, length) * magnitude, states(kv_heads, keys), states(kv_heads, keys)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)  # the reference takes the same values
    key_groups = torch.randint(num_groups, (batch, keys), generator=generator)
    query_groups = torch.randint(num_groups, (batch, length, min(top_k, num_groups)), generator=generator)
    key_sink = (torch.arange(keys) < sinks).expand(batch, -1)
    valid = torch.ones(batch, keys, dtype=torch.bool)
    if padding == "left":
        valid[0, : keys // 3] = False
    elif padding == "right":
        valid[-1, keys - keys // 3 :] = False
    query_positions, key_positions = torch.arange(first, keys), torch.arange(keys)
    visible = valid[:, None, :].expand(batch, length, keys)
    distance = query_positions[:, None] - key_positions
    row_end = None
    if order == "causal":
        visible = visible & (distance >= 0)
    elif order == "staircase":
        row_end = torch.randint(keys + 1, (batch, length), generator=generator).sort(dim=1).values
        visible = visible & (key_positions < row_end[..., None])
    query_bits = key_bits = None
    if rule == "pattern":
        # allowed_pairs is causal too: for other orders only its group-or-window rule is kept.
        allowed = allowed_pairs(query_groups, key_groups, key_sink, query_positions, key_positions, window)
        visible = visible & (allowed | (distance < 0))
        query_bits, key_bits = pattern_bits(query_groups, key_groups, key_sink)
    elif rule == "local":
        sinks_done = torch.rand(batch, length, generator=generator) < 0.5
        shared = probes(query_groups, key_groups) | (key_sink[:, None, :] & sinks_done[..., None])
        visible = visible & (distance <= window) & ~shared
        query_bits, key_bits = local_bits(query_groups, key_groups, key_sink, sinks_done)
    # A partial result over other keys (`into`), laid out [batch, L, heads] like the fast path's; some rows empty.
    held = torch.randn(batch, length, heads, dim, generator=generator).transpose(1, 2)
    held_lse = torch.randn(batch, length, heads, generator=generator).transpose(1, 2) * 3
    held_lse = held_lse.masked_fill(torch.rand(batch, heads, length, generator=generator) < 0.3, FLOAT_MIN)
    result = native_prefill.prefill_attention(
        query,
        key,
        value,
        causal=order == "causal",
        scale=dim**-0.5,
        first=first,
        row_end=row_end,
        query_bits=query_bits,
        key_bits=key_bits,
        key_valid=None if padding == "none" else valid,
        window=window,
        local=rule == "local",
        into=(held.clone(), held_lse.clone()) if merge else None,
    )
    assert result is not None
    output, lse = result
    expected, expected_lse = float64_attention(query, key, value, visible, dim**-0.5)
    if merge:  # folded into the partial result it was given, by log-sum-exp; rows without keys keep it
        total = torch.logaddexp(held_lse.double(), expected_lse)
        expected = held * (held_lse - total).exp()[..., None] + expected * (expected_lse - total).exp()[..., None]
        expected_lse = torch.where(expected_lse > FLOAT_MIN, total, held_lse.double())
    # float32 scores carry a relative error ~1e-7 of |q||k|, which the softmax turns into the output's error. In
    # bfloat16 the weights are rounded to 8 bits for the product with the values (a relative error of 2^-9 each,
    # at most 2^-9 of the largest value in their average), and an output that is not merged is rounded too (half a
    # unit in the last place: at most 2^-8 of it).
    atol = 5e-5 * magnitude
    if dtype == torch.bfloat16:
        atol += 2**-9 * float(value.abs().max()) + (0 if merge else 2**-8 * float(expected.abs().max()))
    assert output.dtype == (torch.float32 if merge else dtype)
    torch.testing.assert_close(output.double(), expected, atol=atol, rtol=0)
    torch.testing.assert_close(lse.double(), expected_lse, atol=5e-5 * magnitude, rtol=1e-6)


@needs_kernel
def test_causal_unmasked_cpu_calls_run_in_the_kernel_and_equal_torch(monkeypatch):
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, 6, 300, 64, generator=generator)
    key, value = (torch.randn(1, 2, 300, 64, generator=generator) for _ in range(2))
    calls = []
    real = native_prefill.prefill_attention
    monkeypatch.setattr(
        "focus_hf.attention.backends.prefill_attention", lambda *a, **k: calls.append(k) or real(*a, **k)
    )
    output, lse = cpu_kernel(query, key, value, causal=True, bias=None, scale=0.125)
    assert len(calls) == 1
    expected, expected_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, True, scale=0.125
    )
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, expected_lse, atol=2e-5, rtol=1e-5)
    cpu_kernel(query, key, value, causal=False, bias=None, scale=0.125)  # torch's kernel is faster there
    assert len(calls) == 1
    monkeypatch.setattr("focus_hf.attention.backends.NATIVE_CAUSAL_MAX_KEYS", 299)  # and on long causal calls
    cpu_kernel(query, key, value, causal=True, bias=None, scale=0.125)
    assert len(calls) == 1


@needs_kernel
@pytest.mark.parametrize(
    "change",
    [
        {"dim": 40},  # not a multiple of 16
        {"dim": 144},  # beyond 128
        {"dtype": torch.float16},  # float32 and bfloat16 only
        {"strided_rows": True},  # rows not contiguous
        {"grad": True},  # the kernel has no backward
        {"kv_heads": 4},  # 6 query heads do not share 4 kv heads evenly
    ],
    ids=lambda change: next(iter(change)),
)
def test_prefill_calls_it_does_not_take_return_none(change):
    dim, dtype = change.get("dim", 64), change.get("dtype", torch.float32)
    query = torch.randn(1, 6, 20, dim).to(dtype).requires_grad_(change.get("grad", False))
    key = torch.randn(1, change.get("kv_heads", 2), 20, dim).to(dtype)
    if change.get("strided_rows"):
        key = torch.randn(1, 2, 20, dim * 2)[..., ::2]
    assert native_prefill.prefill_attention(query, key, key, causal=True, scale=0.1) is None
