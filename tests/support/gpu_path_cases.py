"""Cases of the GPU path's tests, run on the CPU through the CUDA kernels' stand-ins: a sparse prefill call with
its dense oracle, and one-query decoding steps over the paged, group-sorted copy of the keys."""

from __future__ import annotations

import pytest
import torch
from attention_cases import ATOL, SCALING, random_routing

import focus_hf.attention.gpu.paged_keys as paged_keys
from focus_hf.attention.gpu.gpu_path import decode_from_paged_keys
from focus_hf.attention.gpu.paged_keys import PagedKeys
from focus_hf.attention.pattern import allowed_pairs
from focus_hf.attention.reference import dense_attention


def sparse_case(
    length=300, q_len=300, top_k=1, separate=False, groups=4, window=16, sinks=3, pad=20, seed=1, dtype=None
):
    """Inputs of `gpu_path.gpu_sparse_attention` and the dense oracle's output on them."""
    generator = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, dim = 2, 6, 2, 8
    query = torch.randn(batch, q_len, heads, dim, generator=generator).transpose(1, 2)
    key = torch.randn(batch, length, kv_heads, dim, generator=generator).transpose(1, 2)
    value = torch.randn(batch, length, kv_heads, dim, generator=generator).transpose(1, 2)
    query_groups, key_groups = random_routing(generator, batch, length, groups, top_k, "none", separate)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[0, :pad] = False
    sink = valid & (valid.cumsum(dim=1) - 1 < sinks)
    positions = torch.arange(length)
    query_groups = query_groups[:, length - q_len :]
    allowed = allowed_pairs(query_groups, key_groups, sink, positions[length - q_len :], positions, window)
    allowed = allowed & (positions[length - q_len :, None] >= positions)[None] & valid[:, None, :]
    expected = dense_attention(query, key, value, allowed[:, None], scaling=SCALING)
    arguments = (query, key, value, valid, query_groups, key_groups, sink, groups, window, SCALING)
    return arguments, expected, valid[:, length - q_len :]


def allowed_of(arguments):
    query, key, value, valid, query_groups, key_groups, sink, groups, window, _ = arguments
    q_len, length = query.shape[2], key.shape[2]
    positions = torch.arange(length)
    allowed = allowed_pairs(query_groups, key_groups, sink, positions[length - q_len :], positions, window)
    return (allowed & (positions[length - q_len :, None] >= positions)[None] & valid[:, None, :])[:, None]


def decoding_case(seed, batch, length, groups, top_k, pad, sinks, separate=False, skew="some"):
    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 4, 2, 8
    query = torch.randn(batch, length, heads, dim, generator=generator).transpose(1, 2)
    key = torch.randn(batch, kv_heads, length, dim, generator=generator)  # a KV cache is head-major
    value = torch.randn(batch, kv_heads, length, dim, generator=generator)
    query_groups, key_groups = random_routing(generator, batch, length, groups, top_k, skew, separate, adaptive=True)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[0, :pad] = False
    sink = valid & (valid.cumsum(dim=1) - 1 < sinks)
    return query, key, value, query_groups, key_groups, valid, sink


def decoding_steps(
    kernels,
    steps,
    rebuilt,
    length,
    seed=1,
    batch=2,
    groups=4,
    top_k=2,
    window=16,
    file_every=8,
    pad=30,
    sinks=3,
    separate=True,
):
    """One-query steps through the paged copy at the cache lengths `steps` (filing every `file_every` positions; the
    copy invalidated before the lengths in `rebuilt`, as after a multi-token call), each against the dense oracle."""
    query, key, value, query_groups, key_groups, valid, sink = decoding_case(
        seed, batch, length, groups, top_k, pad, sinks, separate
    )
    positions = torch.arange(length)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_keys, "FILE_EVERY", file_every)
        store = PagedKeys(groups, window)
        for n in steps:
            if n in rebuilt:
                store.invalidate()
            q = query[:, :, n - 1 : n]
            arguments = (key[:, :, :n], value[:, :, :n], valid[:, :n], query_groups[:, n - 1 : n])
            routing = (key_groups[:, :n], sink[:, :n], window, SCALING)
            output = decode_from_paged_keys(q, *arguments, *routing, store, kernels)
            allowed = allowed_pairs(
                query_groups[:, n - 1 : n], key_groups[:, :n], sink[:, :n], positions[n - 1 : n], positions[:n], window
            )
            allowed = allowed & valid[:, None, :n]
            expected = dense_attention(q, key[:, :, :n], value[:, :, :n], allowed[:, None], scaling=SCALING)
            real = valid[:, n - 1]
            torch.testing.assert_close(output[real], expected[real], atol=ATOL, rtol=0)
