"""Queries that are slices of a fused q/k/v projection (Phi-3's qkv_proj in transformers, vLLM's qkv buffer): each
token's row is longer than its heads, so neither layout the kernels expect fits. Every path must read them as torch
does - a kernel that assumed a token's stride from its head count would read other tokens' keys as this one's query."""

from __future__ import annotations

import pytest
import torch

from focus_hf.attention.hard import hard_attention
from focus_hf.attention.pattern import FocusPattern

HEADS, KV_HEADS, DIM, GROUPS, WINDOW = 4, 2, 32, 4, 16


@pytest.mark.parametrize("path", ["sparse", "cpu-masked"])
@pytest.mark.parametrize(
    ("n", "q_len", "fused_keys"), [(300, 300, True), (300, 300, False), (300, 97, False), (300, 1, False)]
)
def test_fused_projection_slices_equal_contiguous_inputs(path, n, q_len, fused_keys):
    generator = torch.Generator().manual_seed(n + q_len)
    width = (HEADS + 2 * KV_HEADS) * DIM
    fused = torch.randn(1, n, width, generator=generator)
    q_all, k_all, v_all = fused.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    query = q_all.view(1, n, HEADS, DIM)[:, n - q_len :].transpose(1, 2)
    if fused_keys:  # a prefill: keys and values are slices of the same buffer
        key, value = (t.view(1, n, KV_HEADS, DIM).transpose(1, 2) for t in (k_all, v_all))
    else:  # a later chunk or a decoding step: keys from a cache
        key, value = (torch.randn(1, KV_HEADS, n, DIM, generator=generator) for _ in range(2))
    assert query.stride(2) == width  # the case under test: a token's row is longer than its query heads
    key_groups = torch.randint(0, GROUPS, (1, n), generator=generator)
    query_groups = torch.cat(
        [key_groups[:, n - q_len :, None], torch.randint(0, GROUPS, (1, q_len, 1), generator=generator)], -1
    )
    mask = None
    if 1 < q_len < n:
        mask = (torch.arange(n)[None, :] <= (n - q_len + torch.arange(q_len))[:, None])[None, None]
    sinks = (torch.arange(n) < 2)[None]
    pattern = FocusPattern(query_groups, key_groups, sinks, GROUPS, WINDOW, model_mask=mask, own_group=True)
    if path == "sparse":  # the CPU path's entry for this kind of call
        path = "cpu-decode" if q_len == 1 else "cpu-sparse"
    routing = dict(scaling=DIM**-0.5, backend="auto", path=path)
    strided = hard_attention(query, key, value, pattern, **routing)
    contiguous = hard_attention(query.contiguous(), key.contiguous(), value.contiguous(), pattern, **routing)
    torch.testing.assert_close(strided, contiguous, rtol=0, atol=0)
