"""The window band as sliding-window calls with group indicators (`gpu/window.py`) against a dense float64 oracle of
the window band, on the CPU stand-ins: the varlen stand-in's window bounds are flash attention's (stated in the stand-in
and checked against the CUDA kernel by test_cuda.py and `verify` on every device)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import focus_hf.attention.gpu.budget as budget
import focus_hf.attention.gpu.gpu_path as gpu_path
import focus_hf.attention.gpu.window as window_module
from focus_hf.attention.gpu.cpu_standins import varlen_attention_standin
from focus_hf.attention.gpu.kernels import NEG, GpuKernels, standin_kernels
from focus_hf.attention.gpu.window import window_attention, window_dtype


def window_band_oracle(query, key, value, valid, query_groups, key_groups, key_sink, window, scaling):
    """The window band in float64 from its definition: real keys not after the query, within the window or a sink, of a
    group the query does not probe (-1 probes the keys not routed yet). Returns output, lse (NEG where no key) and each
    row's largest sum(|q_i * k_i|) * scaling over its keys, the size float32 rounds a score at."""
    batch, heads, q_len, _ = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    query_position = torch.arange(kv_len - q_len, kv_len)[:, None]
    key_position = torch.arange(kv_len)[None, :]
    probed = (query_groups[:, :, None, :] == key_groups[:, None, :, None]).any(dim=-1)  # [batch, q, kv]
    near = (query_position - key_position <= window)[None] | key_sink[:, None, :]
    allowed = valid[:, None, :] & (key_position <= query_position)[None] & near & ~probed
    repeats = heads // kv_heads
    keys = key.double().repeat_interleave(repeats, dim=1)
    values = value.double().repeat_interleave(repeats, dim=1)
    scores = (query.double() @ keys.transpose(-1, -2)) * scaling
    magnitude = (query.double().abs() @ keys.abs().transpose(-1, -2)) * scaling
    row_magnitude = magnitude.masked_fill(~allowed[:, None], 0.0).amax(dim=-1)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    has_key = allowed.any(dim=-1)[:, None]
    weights = torch.where(has_key[..., None], torch.exp(scores - lse.clamp_min(-1e300)[..., None]), 0.0)
    return weights @ values, torch.where(has_key, lse, NEG), row_magnitude


@st.composite
def window_cases(draw):
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 3]))
    kv_len = draw(st.integers(1, 90))
    q_len = draw(st.integers(1, kv_len))
    groups = draw(st.integers(1, 5))
    top_k = draw(st.integers(1, min(2, groups)))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    magnitude = draw(st.sampled_from([1.0, 30.0, 3000.0]))  # scores up to ~1e7 at the largest
    dim = draw(st.sampled_from([4, 8]))
    query = torch.randn(batch, heads, q_len, dim, generator=generator) * magnitude
    key = torch.randn(batch, kv_heads, kv_len, dim, generator=generator)
    value = torch.randn(batch, kv_heads, kv_len, dim, generator=generator)
    key_groups = torch.randint(-1, groups, (batch, kv_len), generator=generator)
    # Few groups with a long window leave whole windows probed: rows of the window band without a key.
    query_groups = torch.randint(-1, groups, (batch, q_len, top_k), generator=generator)
    pad = draw(st.integers(0, kv_len - 1))
    valid = torch.ones(batch, kv_len, dtype=torch.bool)
    valid[0, :pad] = False
    sinks = draw(st.integers(0, 3))
    key_sink = valid & (valid.cumsum(dim=1) - 1 < sinks)
    window = draw(st.integers(0, 40))
    return (query, key, value, valid, query_groups, key_groups, key_sink), groups, window, dim**-0.5, sinks


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window_cases(), st.booleans(), st.sampled_from([1, 7, 1 << 30]))
def test_window_band_equals_its_dense_oracle(case, varlen_gqa, chunk_rows):
    states, groups, window, scaling, sinks = case
    query, key, value, valid, query_groups, key_groups, key_sink = states
    output, lse = torch.empty_like(query), torch.empty(query.shape[:3])
    with pytest.MonkeyPatch.context() as patch:
        # Chunks of one row (the sinks too), of 7, or every row at once.
        patch.setattr(budget, "temporary_bytes", lambda query: 1 if chunk_rows < 1 << 30 else chunk_rows)
        patch.setattr(window_module, "MIN_CHUNK_ROWS", chunk_rows)
        window_attention(
            output, lse, query, key, value, valid, query_groups, key_groups, key_sink, groups, window, scaling,
            standin_kernels(varlen_gqa), sink_slots=sinks,
        )  # fmt: skip
    expected, expected_lse, magnitude = window_band_oracle(
        query, key, value, valid, query_groups, key_groups, key_sink, window, scaling
    )
    empty = expected_lse == NEG
    assert bool((lse[empty] == NEG).all()) and bool((output[empty[..., None].expand_as(output)] == 0).all())
    # A float32 score is off by a few units in the last place of sum(|q_i * k_i|) (scores reach ~1e4 here), and a
    # softmax moves by about twice its scores' error: the tolerance follows each row's magnitude, not a fixed 1e-4.
    score_error = 8 * 2.0**-24 * magnitude
    scale = float(value.abs().max())
    output_error = (output.double() - expected).abs().amax(dim=-1)
    assert bool((output_error <= scale * (1e-4 + 2 * score_error)).all()), float((output_error / scale).max())
    lse_error = (lse.double() - expected_lse).abs()[~empty]
    assert bool((lse_error <= 1e-3 + score_error[~empty]).all()), float(lse_error.max())


def test_the_varlen_double_takes_flash_attentions_window_bounds():
    # One sequence of 3 queries over 6 keys: query r sits at key r + 3 and, with window 1, sees keys r + 2 and r + 3.
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32)
    query = torch.zeros(3, 1, 2)  # equal scores: the output is the mean of the visible values
    key = torch.zeros(6, 1, 2)
    value = torch.arange(6.0)[:, None, None].expand(6, 1, 2)
    output, lse = varlen_attention_standin(query, key, value, cu_q, cu_k, 3, 6, scale=1.0, window=1)
    assert output[:, 0, 0].tolist() == [2.5, 3.5, 4.5]
    torch.testing.assert_close(lse, torch.full((1, 3), torch.tensor(2.0).log().item()))
    output, _ = varlen_attention_standin(query, key, value, cu_q, cu_k, 3, 6, scale=1.0, window=0)
    assert output[:, 0, 0].tolist() == [3.0, 4.0, 5.0]


def test_the_window_band_takes_the_window_call_where_the_dtype_holds_the_indicator(monkeypatch):
    calls = []
    twin = standin_kernels()

    def recording(query, key, value, *rest):
        calls.append((query.dtype, rest[-1]))
        return twin.raw_varlen(query, key, value, *rest)

    kernels = GpuKernels("recording", twin.raw_flex, recording, False, twin.varlen_dtypes, twin.head_dims)
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        query = torch.randn(1, 2, 40, 8, generator=generator).to(dtype)
        key, value = (torch.randn(1, 2, 40, 8, generator=generator).to(dtype) for _ in range(2))
        groups = torch.randint(0, 3, (1, 40), generator=generator)
        valid = torch.ones(1, 40, dtype=torch.bool)
        sink = torch.zeros(1, 40, dtype=torch.bool)
        gpu_path.gpu_sparse_attention(query, key, value, valid, groups[..., None], groups, sink, 3, 5, 0.3, kernels)
    windowed = {dtype for dtype, window in calls if window == 5}
    assert windowed == {torch.float32, torch.bfloat16}  # float16 keeps the bands (see window_dtype)
    assert not window_dtype(torch.float16) and window_dtype(torch.bfloat16)
