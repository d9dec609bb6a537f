"""A decoding step of Focus read straight from vLLM's paged KV cache: only the keys the pattern lets the query see.

One query's pattern is a set of keys (its window, the sinks, the keys of the groups it probes), so its attention is
plain attention over that set: the step picks the set with `pattern.allowed_pairs` from the side cache's groups,
reads those keys and values from their blocks, and runs the project's one-query C kernel (`native.attend_runs`)
over them. Dense kv heads read all their keys. Gathering every key of the request first, as the prefill path does,
would move the whole cache at every step - more than vLLM's dense kernel reads.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from focus_hf.attention.cpu.native import attend_runs
from focus_hf.attention.pattern import allowed_pairs


def visible_positions(
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    sink_tokens: int,
    window: int,
    dense_below: int,
) -> Optional[torch.Tensor]:
    """Positions [m] of the keys the last of `len(key_groups)` tokens sees, or None when it sees them all.

    Args:
        query_groups: [top_k] the groups the query probes.
        key_groups: [n] every key's group (the query's own last).
    """
    length = key_groups.shape[0]
    if length - 1 <= window or length < dense_below:  # all within the window, or a query `dense_below` keeps dense
        return None
    positions = torch.arange(length, device=key_groups.device)
    allowed = allowed_pairs(
        query_groups[None, None], key_groups[None], (positions < sink_tokens)[None], positions[-1:], positions, window
    )[0, 0]
    return allowed.nonzero()[:, 0]


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query [heads, dim] over keys and values [kv_heads, m, dim] (GQA): [heads, dim]."""
    output = attend_runs(query, [(keys, values)], scale)
    if output is not None:
        return output
    return F.scaled_dot_product_attention(query[None, :, None], keys[None], values[None], scale=scale, enable_gqa=True)[
        0, :, 0
    ]


def decode_step(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_row: torch.Tensor,
    visible: Optional[torch.Tensor],
    length: int,
    dense_kv_heads: tuple[int, ...],
    scale: float,
) -> torch.Tensor:
    """The Focus attention of one decoding query [heads, dim] of a request whose block-table row is `block_row`.

    Args:
        key_cache, value_cache: [num_blocks, kv_heads, block_size, dim] views of vLLM's paged cache.
        visible: `visible_positions` of the routed heads (None: every key).
        length: the request's tokens, the query's own included.
        dense_kv_heads: kv heads that see every key.
    """
    block_size = key_cache.shape[2]
    per_kv = query.shape[0] // key_cache.shape[1]

    def read(positions: Optional[torch.Tensor], head: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [kv_heads (or 1), m, dim] at `positions` (None: all), contiguous rows for the kernel."""
        if positions is None:
            positions = torch.arange(length, device=block_row.device)
        blocks = block_row[positions // block_size].long()
        offsets = positions % block_size
        if head is not None:  # one kv head: [m, dim]
            return key_cache[blocks, head, offsets][None], value_cache[blocks, head, offsets][None]
        keys, values = key_cache[blocks, :, offsets], value_cache[blocks, :, offsets]  # [m, kv_heads, dim]
        return keys.transpose(0, 1).contiguous(), values.transpose(0, 1).contiguous()

    keys, values = read(visible)
    output = attend(query, keys, values, scale)
    if visible is not None:
        for head in dense_kv_heads:
            dense_keys, dense_values = read(None, head)
            queries = slice(head * per_kv, (head + 1) * per_kv)
            output[queries] = attend(query[queries], dense_keys, dense_values, scale)
    return output
