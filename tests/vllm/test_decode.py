"""A decoding step read straight from the paged cache (`focus_hf.vllm.decode`) equals the attention function of the
transformers adapter over the same keys. Needs no vLLM: it runs in the default suite."""

from __future__ import annotations

import pytest
import torch

from focus_hf.attention.cpu import native
from focus_hf.attention.function import LayerRouting, focus_attention_forward
from focus_hf.attention.routing import RoutingState, TokenRouting
from focus_hf.vllm import decode


class _Module(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _paged_cache(num_blocks, kv_heads, block_size, dim, layout):
    """Key and value views [num_blocks, kv_heads, block_size, dim] of a paged cache: vLLM's CPU layout (per block and
    kv head, keys as [dim, block_size], then values as [block_size, dim]) or plain rows."""
    cache = torch.randn(num_blocks, kv_heads, 2, dim * block_size)
    if layout == "transposed":
        key_cache = cache[:, :, 0].view(num_blocks, kv_heads, dim, block_size).transpose(2, 3)
    else:
        key_cache = cache[:, :, 0].view(num_blocks, kv_heads, block_size, dim)
    return key_cache, cache[:, :, 1].view(num_blocks, kv_heads, block_size, dim)


@pytest.mark.parametrize(
    "length, block_size, layout",
    [(40, 16, "transposed"), (300, 16, "rows"), (1000, 128, "transposed"), (3000, 128, "transposed"),
     (3000, 32, "rows"), (700, 24, "transposed")],
)  # fmt: skip
@pytest.mark.parametrize("dense_heads", [(), (1,)])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_decode_step_matches_the_attention_function(
    length, block_size, layout, dense_heads, top_k, kernel, monkeypatch
):
    torch.manual_seed(length + top_k)
    heads, kv_heads, dim, groups, window, sinks = 6, 3, 32, 4, 64, 3
    if kernel == "torch":
        monkeypatch.setattr(decode, "paged_decode", lambda *args: None)
    blocks = -(-length // block_size)
    num_blocks = blocks + 5
    key_cache, value_cache = _paged_cache(num_blocks, kv_heads, block_size, dim, layout)
    block_row = torch.randperm(num_blocks)[:blocks].int()
    positions = torch.arange(length)
    slots = block_row[positions // block_size].long() * block_size + positions % block_size
    keys = key_cache[block_row[positions // block_size].long(), :, positions % block_size].transpose(0, 1)[None]
    values = value_cache[block_row[positions // block_size].long(), :, positions % block_size].transpose(0, 1)[None]
    query = torch.randn(heads, dim)
    key_groups = torch.randint(0, groups, (length,))
    slot_groups = torch.randint(0, groups, (num_blocks * block_size,), dtype=torch.int32)  # other requests' slots
    slot_groups[slots] = key_groups.int()
    query_groups = torch.randperm(groups)[:top_k]

    got = decode.decode_step(
        query, key_cache, value_cache, block_row, length, slot_groups, query_groups, num_groups=groups,
        sink_tokens=sinks, window=window, dense_below=0, dense_kv_heads=dense_heads, scale=dim**-0.5,
    )  # fmt: skip
    if kernel == "native":
        assert native.native_kernels() is not None, "the C kernels must build on this machine (cc on the PATH)"
        assert decode.paged_decode(
            query, key_cache, value_cache, block_row, length, slot_groups, groups, query_groups,
            torch.zeros(kv_heads, dtype=torch.bool), sinks, window, dim**-0.5,
        ) is not None  # fmt: skip

    module = _Module(heads // kv_heads)
    routing = LayerRouting(
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
    routing.queries.own_groups = key_groups[None, -1:]
    want, _ = focus_attention_forward(
        module, query[None, :, None], keys, values, None, scaling=dim**-0.5, focus_routing=routing
    )
    torch.testing.assert_close(got, want[0, 0], atol=1e-5, rtol=1e-5)
    if length > window + 1:
        visible = decode.visible_positions(query_groups, key_groups, sinks, window)
        assert len(visible) < length  # the step reads fewer keys than the cache holds


@pytest.mark.parametrize("length, dense_below", [(50, 0), (900, 1000), (1000, 1000)])
def test_decode_step_sees_every_key_where_the_pattern_hides_none(length, dense_below):
    """Within the window, or below `dense_below`, a step is dense attention over the request's keys."""
    torch.manual_seed(length)
    heads, kv_heads, dim, block_size, window = 4, 2, 32, 16, 64
    blocks = -(-length // block_size)
    key_cache, value_cache = _paged_cache(blocks + 2, kv_heads, block_size, dim, "transposed")
    block_row = torch.randperm(blocks + 2)[:blocks].int()
    positions = torch.arange(length)
    keys = key_cache[block_row[positions // block_size].long(), :, positions % block_size].transpose(0, 1)
    values = value_cache[block_row[positions // block_size].long(), :, positions % block_size].transpose(0, 1)
    query = torch.randn(heads, dim)
    slot_groups = torch.randint(0, 4, ((blocks + 2) * block_size,), dtype=torch.int32)
    got = decode.decode_step(
        query, key_cache, value_cache, block_row, length, slot_groups, torch.tensor([0]), num_groups=4,
        sink_tokens=2, window=window, dense_below=dense_below, dense_kv_heads=(), scale=dim**-0.5,
    )  # fmt: skip
    want = torch.nn.functional.scaled_dot_product_attention(
        query[None, :, None], keys[None], values[None], scale=dim**-0.5, enable_gqa=True
    )[0, :, 0]
    if length >= dense_below and length - 1 > window:
        assert not torch.allclose(got, want, atol=1e-3)  # the pattern hides keys here
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sharing", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dim", [48, 64, 128])
@pytest.mark.parametrize("layout", ["transposed", "rows"])
def test_paged_kernel_equals_the_torch_step_for_each_head_shape(sharing, dim, layout, monkeypatch):
    """The kernel's variants (head size 64 or 128 with 1 to 4 query heads per kv head as constants, any other shape
    read from the call) against the gathered torch step: a block whose 8 pieces are all read, partial chunks, the
    last block part-filled, a dense kv head beside a routed one."""
    assert native.native_kernels() is not None, "the C kernels must build on this machine (cc on the PATH)"
    torch.manual_seed(sharing * dim)
    kv_heads, block_size, length, groups = 2, 128, 1100, 6
    blocks = -(-length // block_size)
    key_cache, value_cache = _paged_cache(blocks + 3, kv_heads, block_size, dim, layout)
    block_row = torch.randperm(blocks + 3)[:blocks].int()
    # runs of one group (pieces wholly hidden) beside mixed ones
    slot_groups = torch.randint(0, groups, ((blocks + 3) * block_size // 8,), dtype=torch.int32).repeat_interleave(8)
    slot_groups[: 2 * block_size] = torch.randint(0, groups, (2 * block_size,), dtype=torch.int32)
    query = torch.randn(kv_heads * sharing, dim)
    arguments = (query, key_cache, value_cache, block_row, length, slot_groups, torch.tensor([1, 4]))
    options = dict(num_groups=groups, sink_tokens=3, window=100, dense_below=0, dense_kv_heads=(1,), scale=dim**-0.5)
    got = decode.decode_step(*arguments, **options)
    monkeypatch.setattr(decode, "paged_decode", lambda *args: None)
    want = decode.decode_step(*arguments, **options)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_side_cache_routes_decoding_tokens_as_route_tokens_and_write_do(kernel, monkeypatch):
    """`SideCache.route_token` (the vLLM decoding step's routing: one C call per token, or its torch operations where
    the kernel cannot run) against resuming from the cache, `route_tokens` and `write`, over tokens that cross blocks:
    the same probes, groups and resumable column sums."""
    from focus_hf.attention.routing import RoutingState, route_tokens
    from focus_hf.vllm import side_cache
    from focus_hf.vllm.side_cache import SideCache

    assert native.native_kernels() is not None, "the C kernels must build on this machine (cc on the PATH)"
    if kernel == "torch":
        monkeypatch.setattr(side_cache, "route_token", lambda *args: None)
    torch.manual_seed(0)
    groups, iterations, prompt, total = 6, 10, 10, 45
    key_scores, query_scores = torch.randn(total, groups) * 4, torch.randn(total, groups) * 4
    block_row = torch.tensor([4, 0, 2, 5], dtype=torch.int32)
    caches = [SideCache(6, 16, iterations, groups, torch.device("cpu")) for _ in range(2)]
    options = dict(iterations=iterations, top_k=2, sink_tokens=2, probe_mass=0.8)
    _, state = route_tokens(
        key_scores[None, :prompt], torch.ones(1, prompt, dtype=torch.bool),
        RoutingState.empty(1, iterations, groups, torch.device("cpu")), query_scores=query_scores[None, :prompt],
        token_columns=True, **options,
    )  # fmt: skip
    for side in caches:
        side.write(block_row, 0, state.key_groups[0], state.token_column_lse[0])
    fast, slow = caches
    for position in range(prompt, total):
        probes = fast.route_token(block_row, position, key_scores[position], query_scores[position], 2, 0.8)
        resumed = RoutingState.empty(1, iterations, groups, torch.device("cpu"))
        resumed.seen, resumed.valid_count = position, torch.tensor([position])
        resumed.column_lse = slow.column_lse(block_row, position - 1)
        tokens, routed = route_tokens(
            key_scores[None, position : position + 1], torch.ones(1, 1, dtype=torch.bool), resumed,
            query_scores=query_scores[None, position : position + 1], token_columns=True, **options,
        )  # fmt: skip
        slow.write(block_row, position, routed.key_groups[0], routed.token_column_lse[0])
        assert probes.tolist() == tokens.top_groups[0, 0].tolist()
    assert torch.equal(fast.slot_groups, slow.slot_groups)
    torch.testing.assert_close(fast.table, slow.table, rtol=1e-6, atol=1e-6)
