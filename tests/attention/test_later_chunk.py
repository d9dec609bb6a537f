"""A call without a mask whose queries are the last of more keys - a later chunk of a prefill, as vLLM's backend
(`focus_hf.vllm.backend`) hands it - is causal from the bottom-right corner on every path: the base attention (the C
kernel, and torch where the kernel cannot run), dense heads, the `dense_below` split and the routed heads all give
what the same call gives with that mask spelled out."""

from __future__ import annotations

import pytest
import torch

from focus_hf.attention import function
from focus_hf.attention.function import LayerRouting, base_attention, focus_attention_forward
from focus_hf.attention.routing import RoutingState, TokenRouting

HEADS, KV_HEADS, DIM, GROUPS, WINDOW, SINKS = 6, 3, 32, 4, 24, 2


class _Module(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_key_value_groups = HEADS // KV_HEADS
        self.is_causal = True


def _bottom_right(q_len: int, kv_len: int) -> torch.Tensor:
    return (torch.arange(kv_len)[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None])[None, None]


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize(("q_len", "kv_len"), [(2, 40), (97, 300), (300, 301)])
def test_base_attention_without_mask_is_bottom_right_causal(kernel, q_len, kv_len, monkeypatch):
    if kernel == "torch":
        monkeypatch.setattr(function, "prefill_attention", lambda *args, **kwargs: None)
    generator = torch.Generator().manual_seed(q_len)
    query = torch.randn(1, HEADS, q_len, DIM, generator=generator)
    key, value = (torch.randn(1, KV_HEADS, kv_len, DIM, generator=generator) for _ in range(2))
    got, _ = base_attention(_Module(), query, key, value, None, scaling=DIM**-0.5)
    want = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=_bottom_right(q_len, kv_len), scale=DIM**-0.5, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dense_kv_heads", [(), (1,)])
@pytest.mark.parametrize(("q_len", "kv_len", "dense_below"), [(97, 300, 0), (97, 300, 250), (150, 600, 0)])
def test_focus_attention_of_a_later_chunk_equals_the_masked_call(dense_kv_heads, q_len, kv_len, dense_below):
    generator = torch.Generator().manual_seed(q_len + kv_len + dense_below)
    query = torch.randn(1, HEADS, q_len, DIM, generator=generator)
    key, value = (torch.randn(1, KV_HEADS, kv_len, DIM, generator=generator) for _ in range(2))
    key_groups = torch.randint(0, GROUPS, (1, kv_len), generator=generator)
    query_groups = torch.cat(
        [key_groups[:, kv_len - q_len :, None], torch.randint(0, GROUPS, (1, q_len, 1), generator=generator)], -1
    )

    def attend(mask):
        module = _Module()
        routing = LayerRouting(
            mode="hard",
            backend="auto",
            window=WINDOW,
            num_groups=GROUPS,
            top_k=2,
            gate_floor=1e-6,
            queries=TokenRouting(log_probs=None, top_groups=query_groups, sink=torch.zeros(1, q_len, dtype=bool)),
            keys=RoutingState(
                seen=kv_len,
                valid_count=torch.tensor([kv_len]),
                column_lse=torch.zeros(1, 10, GROUPS),
                key_probs=torch.zeros(1, 0, GROUPS),
                key_groups=key_groups,
                key_sink=(torch.arange(kv_len) < SINKS)[None],
            ),
            dense_kv_heads=dense_kv_heads,
            dense_below=dense_below,
        )
        return focus_attention_forward(module, query, key, value, mask, scaling=DIM**-0.5, focus_routing=routing)[0]

    torch.testing.assert_close(attend(None), attend(_bottom_right(q_len, kv_len)), atol=2e-5, rtol=2e-5)
