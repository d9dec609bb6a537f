"""A decoding step read straight from the paged cache (`focus_hf.vllm.decode`) equals the attention function of the
transformers adapter over the same keys. Needs no vLLM: it runs in the default suite."""

from __future__ import annotations

import pytest
import torch

from focus_hf.attention.function import LayerRouting, focus_attention_forward
from focus_hf.attention.routing import RoutingState, TokenRouting
from focus_hf.vllm.decode import decode_step, visible_positions


class _Module(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("length", [40, 300, 1000])
@pytest.mark.parametrize("dense_heads", [(), (1,)])
@pytest.mark.parametrize("top_k", [1, 2])
def test_decode_step_matches_the_attention_function(length, dense_heads, top_k):
    torch.manual_seed(length + top_k)
    heads, kv_heads, dim, block_size, groups, window, sinks = 6, 3, 32, 16, 4, 64, 3
    blocks = -(-length // block_size)
    num_blocks = blocks + 5
    # vLLM's CPU layout: per block and kv head, keys as [dim, block_size], then values as [block_size, dim]
    cache = torch.randn(num_blocks, kv_heads, 2, dim * block_size)
    key_cache = cache[:, :, 0].view(num_blocks, kv_heads, dim, block_size).transpose(2, 3)
    value_cache = cache[:, :, 1].view(num_blocks, kv_heads, block_size, dim)
    block_row = torch.randperm(num_blocks)[:blocks].int()
    positions = torch.arange(length)
    keys = key_cache[block_row[positions // block_size].long(), :, positions % block_size].transpose(0, 1)[None]
    values = value_cache[block_row[positions // block_size].long(), :, positions % block_size].transpose(0, 1)[None]
    query = torch.randn(heads, dim)
    key_groups = torch.randint(0, groups, (length,))
    query_groups = torch.randperm(groups)[:top_k]

    visible = visible_positions(query_groups, key_groups, sinks, window, dense_below=0)
    got = decode_step(query, key_cache, value_cache, block_row, visible, length, dense_heads, dim**-0.5)

    module = _Module(heads // kv_heads)
    module._focus_routing = LayerRouting(
        mode="hard",
        backend="auto",
        window=window,
        num_groups=groups,
        top_k=top_k,
        gate_floor=1e-6,
        queries=TokenRouting(log_probs=None, top_groups=query_groups[None, None], sink=torch.zeros(1, 1, dtype=bool)),
        keys=RoutingState(
            seen=length,
            valid_count=torch.tensor([length]),
            column_lse=torch.zeros(1, 10, groups),
            key_probs=torch.zeros(1, 0, groups),
            key_groups=key_groups[None],
            key_sink=(positions < sinks)[None],
        ),
        dense_kv_heads=dense_heads,
    )
    module._focus_routing.queries.own_groups = key_groups[None, -1:]
    want, _ = focus_attention_forward(module, query[None, :, None], keys, values, None, scaling=dim**-0.5)
    torch.testing.assert_close(got, want[0, 0], atol=1e-5, rtol=1e-5)
    if length > window + 1:
        assert visible is not None and len(visible) < length  # the step reads fewer keys than the cache holds
