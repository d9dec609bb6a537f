"""The CPU engine's attention backend with Focus: vLLM's `CPU_ATTN` for layers without a router, Focus for the rest.

vLLM's CPU platform always picks `CPU_ATTN`, so the plugin registers this subclass under that name
(`plugin.register`); it reaches every worker because the plugin is an entry point vLLM loads in each process.

A routed layer's call, per request of the batch: resume routing after the request's cached tokens from the side
cache (`side_cache`), route the call's tokens with the routers' scores (`routing.route_tokens`, the function the
transformers adapter runs) and record them. A prefill chunk then reads the request's keys, values and key groups
through the block table and runs the very attention function the transformers adapter registers
(`attention.function.focus_attention_forward`: window, sinks, groups, dense heads, `dense_below`, the CPU kernels);
a decoding step reads only the keys its pattern shows it (`decode`), with the same pattern and kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from focus_hf.attention.function import LayerRouting, focus_attention_forward
from focus_hf.attention.routing import RoutingState, route_tokens
from focus_hf.errors import FocusRuntimeError
from focus_hf.vllm.adapter import LayerRouter
from focus_hf.vllm.decode import decode_step
from focus_hf.vllm.side_cache import SideCache

# Attributes the model hooks (`model_hooks`) leave on vLLM's `Attention` layer.
ROUTER_ATTRIBUTE = "_focus_router"
SCORES_ATTRIBUTE = "_focus_scores"
SIDE_CACHE_ATTRIBUTE = "_focus_side_cache"
LAYOUT_CHECKED_ATTRIBUTE = "_focus_layout_checked"  # the cache tensor (its address) whose layout was verified


class FocusCPUAttentionBackend(CPUAttentionBackend):
    """`CPU_ATTN` whose layers run Focus attention where the model hooks gave them a router."""

    @staticmethod
    def get_impl_cls() -> type["FocusCPUAttentionImpl"]:
        return FocusCPUAttentionImpl


class _AttentionModule(nn.Module):
    """What `focus_attention_forward` reads from the attention module it is called for (transformers' signature): the
    GQA group size of the dense paths."""

    def __init__(self, num_heads: int, num_kv_heads: int, layer_index: int) -> None:
        super().__init__()
        self.num_key_value_groups = num_heads // num_kv_heads
        self.is_causal = True
        self.layer_idx = layer_index


class FocusCPUAttentionImpl(CPUAttentionBackendImpl):
    """`CPUAttentionBackendImpl` with Focus attention for the decoder layers that carry a router."""

    def forward(
        self,
        layer: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: Optional[torch.Tensor] = None,
        output_block_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        router: Optional[LayerRouter] = getattr(layer, ROUTER_ATTRIBUTE, None)
        if router is None or attn_metadata is None or self.attn_type != AttentionType.DECODER:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        scores = getattr(layer, SCORES_ATTRIBUTE, None)
        setattr(layer, SCORES_ATTRIBUTE, None)  # one call's scores serve that call only
        if scores is None:
            raise FocusRuntimeError(
                f"{layer.layer_name} has a Focus router but its attention module did not route this call: the model "
                "hooks did not run (is the model compiled? focus_hf.vllm runs the model eagerly)."
            )
        self._focus_attention(layer, router, scores, query, key, kv_cache, attn_metadata, output)
        return output

    def _side_cache(self, layer: nn.Module, router: LayerRouter, kv_cache: torch.Tensor) -> SideCache:
        num_blocks, _, block_size, _ = kv_cache.shape
        side = getattr(layer, SIDE_CACHE_ATTRIBUTE, None)
        if side is None or not side.fits(num_blocks, block_size):
            settings = router.settings
            side = SideCache(num_blocks, block_size, settings.sinkhorn_iterations, settings.num_groups, kv_cache.device)
            setattr(layer, SIDE_CACHE_ATTRIBUTE, side)
        return side

    def _focus_attention(self, layer, router, scores, query, key, kv_cache, metadata, output) -> None:
        settings = router.settings
        key_scores, query_scores = scores
        side = self._side_cache(layer, router, kv_cache)
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        # Per block and kv head: block_size keys then as many values (`CPUAttentionBackendImpl.forward`); the CPU
        # kernels of vLLM 0.32 ("vec", "vec16" ISAs) store the keys transposed, [head_dim, block_size], and the values
        # as rows, [block_size, head_dim]. `_check_layout` verifies that reading on each layer's cache tensor.
        halves = kv_cache.view(num_blocks, num_kv_heads, 2, -1)
        key_cache = halves[:, :, 0].view(num_blocks, num_kv_heads, self.head_size, block_size).transpose(2, 3)
        value_cache = halves[:, :, 1].view(num_blocks, num_kv_heads, block_size, self.head_size)
        starts = metadata.query_start_loc.tolist()
        lengths = metadata.seq_lens.tolist()
        head_dim = self.head_size
        query = query.view(-1, self.num_heads, head_dim)
        out = output.view(-1, self.num_heads, head_dim)
        for request, seq_len in enumerate(lengths):
            first, last = starts[request], starts[request + 1]
            q_len = last - first
            if q_len == 0:
                continue
            cached = seq_len - q_len
            block_row = metadata.block_table[request]
            layout_unchecked = getattr(layer, LAYOUT_CHECKED_ATTRIBUTE, None) != kv_cache.data_ptr()
            if layout_unchecked and int(metadata.slot_mapping[last - 1]) >= 0:
                # the layout check: the call's last key, as read back from its block, is the one vLLM wrote
                block = block_row[(seq_len - 1) // block_size].long()
                written = key.view(-1, self.num_kv_heads, head_dim)[last - 1]
                _check_layout(key_cache[block, :, (seq_len - 1) % block_size], written, layer)
                setattr(layer, LAYOUT_CHECKED_ATTRIBUTE, kv_cache.data_ptr())
            if q_len == 1 and cached:
                out[first] = self._decoding_step(router, side, key_scores, query_scores, query, key_cache, value_cache,
                                                 block_row, first, seq_len)  # fmt: skip
                continue
            state = RoutingState.empty(1, settings.sinkhorn_iterations, settings.num_groups, key_scores.device)
            if cached:  # routing resumes after the last cached token
                state.seen = cached
                state.valid_count = torch.tensor([cached], device=key_scores.device)
                state.column_lse = side.column_lse(block_row, cached - 1)
            tokens, routed = route_tokens(
                key_scores[None, first:last],
                torch.ones(1, q_len, dtype=torch.bool, device=key_scores.device),
                state,
                iterations=settings.sinkhorn_iterations,
                top_k=settings.top_k,
                sink_tokens=settings.sink_tokens,
                query_scores=None if query_scores is None else query_scores[None, first:last],
                probe_mass=settings.probe_mass,
                token_columns=True,
            )
            side.write(block_row, cached, routed.key_groups[0], routed.token_column_lse[0])
            positions = torch.arange(seq_len, device=key_scores.device)
            keys = RoutingState(
                seen=seq_len,
                valid_count=torch.tensor([seq_len]),
                column_lse=routed.column_lse,
                key_probs=routed.key_probs[:, :0],  # hard routing reads groups and sinks only
                key_groups=side.key_groups(side.slots(block_row, seq_len))[None],
                key_sink=(positions < settings.sink_tokens)[None],
            )
            module = _AttentionModule(self.num_heads, self.num_kv_heads, router.layer_index)
            routing = LayerRouting(
                mode="hard",
                backend="auto",
                window=settings.window,
                num_groups=settings.num_groups,
                top_k=settings.top_k,
                gate_floor=settings.gate_floor,
                queries=tokens,
                keys=keys,
                dense_below=settings.dense_below,
                dense_kv_heads=router.dense_kv_heads,
            )
            blocks = block_row[: -(-seq_len // block_size)].long()
            request_keys = _paged_rows(key_cache, blocks, seq_len)
            request_values = _paged_rows(value_cache, blocks, seq_len)
            # No mask: the call's queries are the last of its keys (a later chunk is causal from the bottom-right
            # corner), which is what the attention function assumes of a call without one.
            result, _ = focus_attention_forward(
                module,
                query[first:last].transpose(0, 1)[None].contiguous(),
                request_keys,
                request_values,
                None,
                scaling=self.scale,
                focus_routing=routing,
            )
            out[first:last] = result[0]

    def _decoding_step(
        self, router, side, key_scores, query_scores, query, key_cache, value_cache, block_row, row, length
    ) -> torch.Tensor:
        """One request's decoding step (query row `row` of the call, the last of its `length` tokens): routing resumed
        from the side cache (`SideCache.route_token`: no state kept beside it, the side cache is the state), then only
        the keys the pattern shows the query, read straight from the paged cache."""
        settings = router.settings
        probes = side.route_token(
            block_row,
            length - 1,
            key_scores[row],
            None if query_scores is None else query_scores[row],
            settings.top_k,
            settings.probe_mass,
        )
        return decode_step(
            query[row],
            key_cache,
            value_cache,
            block_row,
            length,
            side.slot_groups,
            probes,
            num_groups=settings.num_groups,
            sink_tokens=settings.sink_tokens,
            window=settings.window,
            dense_below=settings.dense_below,
            dense_kv_heads=router.dense_kv_heads,
            scale=self.scale,
        )


def _check_layout(read: torch.Tensor, written: torch.Tensor, layer: nn.Module) -> None:
    """Refuse a KV-cache layout this backend does not read right: a misread layout gives other numbers entirely,
    where the same layout gives the stored values (NaN included, should a model produce any)."""
    if not torch.allclose(read, written, rtol=0.0, atol=0.0, equal_nan=True):
        raise FocusRuntimeError(
            f"{layer.layer_name}: the keys read back from vLLM's paged KV cache are not the keys it stored (largest "
            f"difference {(read - written).abs().nan_to_num(0.0).max().item():.3g}): this KV-cache layout (ISA "
            f"{getattr(layer, 'isa', '?')!r}, dtype {written.dtype}) is not supported by focus_hf.vllm. Serve in "
            "float32 on an x86 CPU (the 'vec' kernels), the configuration it is tested on."
        )


def _paged_rows(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """[1, kv_heads, length, dim]: one request's keys (or values) gathered from the paged cache
    [num_blocks, kv_heads, block_size, dim] (a view, possibly transposed) through its block ids, in one copy into
    rows the project's CPU kernels read (each head's rows one after another)."""
    _, kv_heads, block_size, dim = cache.shape
    rows = cache.new_empty(kv_heads, len(blocks), block_size, dim)
    torch.index_select(cache, 0, blocks, out=rows.permute(1, 0, 2, 3))
    return rows.view(kv_heads, -1, dim)[None, :, :length]
