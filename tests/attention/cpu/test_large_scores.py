"""Large but finite scores give every CPU kernel the float64 softmax's answer, never a NaN.

Scores near 1e13 are finite in float32 and torch's attention takes them, but they broke the prefill kernel: its power
of two was taken of `score * unit - max * unit`, an FMA off by up to half an ulp of `max * unit` - above 0 for such
scores, so 2^65536 = inf, then inf / inf. They come from activation outliers, and from vLLM's CPU rotary embedding at
positions past the model's table (it reads the table without a bound: SmolLM2's keys at position 8192 had norms near
5e16). Here the queries are scaled so that every score is that large: each row's softmax is one-hot on its best key,
far beyond float32's relative error of the scores (~1e-7 of them), so the float64 reference is the exact answer.
"""

from __future__ import annotations

import pytest
import torch

from focus_hf.attention.cpu import native, native_decode, native_prefill

needs_kernel = pytest.mark.skipif(native.native_kernels() is None, reason="no C compiler to build the kernel with")
FLOAT_MIN = torch.finfo(torch.float32).min
MAGNITUDES = [1e9, 1e12, 1e16]


def _reference(query, key, value, visible, scale):
    """float64 softmax attention [batch, heads, L, dim] and lse over `visible` [L, S] (GQA by repetition)."""
    sharing = query.shape[1] // key.shape[1]
    key, value = (tensor.double().repeat_interleave(sharing, 1) for tensor in (key, value))
    scores = (torch.einsum("bhld,bhsd->bhls", query.double(), key) * scale).masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ value, torch.logsumexp(scores, dim=-1)


def _inputs(magnitude, queries=200, keys=700, heads=6, kv_heads=2, dim=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, heads, queries, dim, generator=generator) * magnitude
    key = torch.randn(1, kv_heads, keys, dim, generator=generator)
    value = torch.randn(1, kv_heads, keys, dim, generator=generator)
    return query, key, value


@needs_kernel
@pytest.mark.parametrize("magnitude", MAGNITUDES)
@pytest.mark.parametrize("rule", ["causal", "pattern", "merge"])
def test_prefill_kernel_takes_large_scores(magnitude, rule):
    query, key, value = _inputs(magnitude)
    queries, keys = query.shape[2], key.shape[2]
    first = keys - queries
    visible = torch.arange(keys)[None, :] <= (first + torch.arange(queries))[:, None]
    query_bits = key_bits = None
    if rule == "pattern":  # a group bit per token: a query sees its window (16) and the keys that share its bit
        generator = torch.Generator().manual_seed(1)
        query_bits = 1 << torch.randint(0, 4, (1, queries), generator=generator, dtype=torch.int32)
        key_bits = 1 << torch.randint(0, 4, (1, keys), generator=generator, dtype=torch.int32)
        distance = (first + torch.arange(queries))[:, None] - torch.arange(keys)[None, :]
        visible &= ((query_bits[0, :, None] & key_bits[0, None, :]) != 0) | (distance <= 16)
    into = None
    if rule == "merge":  # folded into a partial result whose lse is far below the new one's
        into = (torch.zeros(1, query.shape[1], queries, query.shape[3]), torch.full((1, query.shape[1], queries), -5.0))
    result = native_prefill.prefill_attention(
        query, key, value, causal=True, scale=0.125, first=first, query_bits=query_bits, key_bits=key_bits,
        window=16, into=into,
    )  # fmt: skip
    assert result is not None
    output, lse = result
    expected, expected_lse = _reference(query, key, value, visible, 0.125)
    assert bool(torch.isfinite(output).all()), "NaN or inf in the prefill kernel's output"
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-3, rtol=1e-6)


@needs_kernel
@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_decoding_kernel_takes_large_scores(magnitude):
    query, key, value = _inputs(magnitude, queries=1, keys=5000)  # over PARALLEL_ROWS: pieces merged
    output = native_decode.attend_runs(
        query[0, :, 0], [(key[0], value[0], 0, 3000), (key[0], value[0], 4000, 1000)], 0.125
    )
    assert output is not None
    visible = torch.zeros(1, 5000, dtype=torch.bool)
    visible[:, :3000] = visible[:, 4000:] = True
    expected, _ = _reference(query, key, value, visible, 0.125)
    assert bool(torch.isfinite(output).all())
    torch.testing.assert_close(output.double(), expected[0, :, 0], atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_paged_decoding_kernel_takes_large_scores(magnitude):
    query, key, value = _inputs(magnitude, queries=1, keys=4096)
    block_size, kv_heads, dim = 128, key.shape[1], key.shape[3]
    blocks = key.shape[2] // block_size
    # vLLM's CPU layout: per block and kv head, the keys transposed [dim, block_size]
    key_cache = key[0].view(kv_heads, blocks, block_size, dim).transpose(0, 1).transpose(2, 3).contiguous()
    value_cache = value[0].view(kv_heads, blocks, block_size, dim).transpose(0, 1).contiguous()
    groups = torch.randint(0, 4, (blocks * block_size,), dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    output = native_decode.paged_decode(
        query[0, :, 0], key_cache.transpose(2, 3), value_cache, torch.arange(blocks, dtype=torch.int32), blocks *
        block_size, groups, 4, torch.tensor([1]), torch.tensor([1, 0], dtype=torch.uint8), 4, 64, 0.125,
    )  # fmt: skip
    assert output is not None
    positions = torch.arange(blocks * block_size)
    routed = (groups == 1) | (positions < 4) | (positions[-1] - positions <= 64)
    sharing = query.shape[1] // kv_heads
    visible = torch.stack([torch.ones_like(routed)] * sharing + [routed] * sharing)[None, :, None]
    expected, _ = _reference(query, key, value, visible, 0.125)
    assert bool(torch.isfinite(output).all())
    torch.testing.assert_close(output.double(), expected[0, :, 0], atol=1e-5, rtol=0)
