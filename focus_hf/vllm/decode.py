"""A decoding step of Focus read straight from vLLM's paged KV cache: only the keys the pattern lets the query see.

One query's pattern is a set of keys (its window, the sinks, the keys of the groups it probes), so its attention is
plain attention over that set. The C kernel `native_decode.paged_decode` evaluates the pattern from the side cache's
groups slot by slot as it walks the request's blocks, and reads keys and values where vLLM stored them: scores only for
the pieces of a block that hold a visible key, values only of visible keys, nothing gathered or copied. Dense kv
heads read every key. Where the kernel cannot run (no C compiler, another dtype), the step picks the set with
`pattern.allowed_pairs`, gathers it and runs torch - the same result.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from focus_hf.attention.cpu.native_decode import attend_runs, paged_decode
from focus_hf.attention.pattern import allowed_pairs


def sees_everything(length: int, window: int, dense_below: int) -> bool:
    """Whether the last of `length` tokens sees every key: all lie in its window, or it is a query `dense_below`
    keeps dense."""
    return length - 1 <= window or length < dense_below


def visible_positions(
    query_groups: torch.Tensor, key_groups: torch.Tensor, sink_tokens: int, window: int
) -> torch.Tensor:
    """Positions [m] of the keys the last of `len(key_groups)` tokens sees.

    Args:
        query_groups: [top_k] the groups the query probes.
        key_groups: [n] every key's group (the query's own last).
    """
    positions = torch.arange(key_groups.shape[0], device=key_groups.device)
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
    length: int,
    slot_groups: torch.Tensor,
    query_groups: torch.Tensor,
    *,
    num_groups: int,
    sink_tokens: int,
    window: int,
    dense_below: int,
    dense_kv_heads: tuple[int, ...],
    scale: float,
) -> torch.Tensor:
    """The Focus attention of one decoding query [heads, dim] of a request whose block-table row is `block_row`.

    Args:
        key_cache, value_cache: [num_blocks, kv_heads, block_size, dim] views of vLLM's paged cache.
        length: the request's tokens, the query's own included.
        slot_groups: int32 [num_blocks * block_size]: each slot's key group (`SideCache.slot_groups`).
        query_groups: [top_k] the groups the query probes.
        dense_kv_heads: kv heads that see every key.
    """
    every_key = _every_key_flags(key_cache.shape[1], dense_kv_heads, sees_everything(length, window, dense_below))
    block_row = block_row.to(torch.int32)
    output = paged_decode(
        query, key_cache, value_cache, block_row, length, slot_groups, num_groups, query_groups, every_key,
        sink_tokens, window, scale,
    )  # fmt: skip
    if output is not None:
        return output
    return _gathered_step(query, key_cache, value_cache, block_row, length, slot_groups, query_groups, every_key,
                          sink_tokens, window, scale)  # fmt: skip


@functools.lru_cache(maxsize=256)
def _every_key_flags(kv_heads: int, dense_kv_heads: tuple[int, ...], everything: bool) -> torch.Tensor:
    """uint8 [kv_heads]: 1 for the kv heads that see every key (one tensor per layer's case, made once: a step runs
    this in every routed layer). Read only."""
    flags = torch.zeros(kv_heads, dtype=torch.uint8)
    flags[list(dense_kv_heads)] = 1
    if everything:
        flags[:] = 1
    return flags


def _gathered_step(
    query, key_cache, value_cache, block_row, length, slot_groups, query_groups, every_key, sink_tokens, window, scale
) -> torch.Tensor:
    """`decode_step` in torch: the visible keys gathered from their blocks, then one attention call per kind of head."""
    block_size = key_cache.shape[2]
    per_kv = query.shape[0] // key_cache.shape[1]
    positions = torch.arange(length, device=block_row.device)
    blocks = block_row[positions // block_size].long()
    offsets = positions % block_size

    def read(chosen: torch.Tensor, head: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [kv_heads (or 1), m, dim] at positions `chosen`, contiguous rows for the kernel."""
        if head is not None:
            return key_cache[blocks[chosen], head, offsets[chosen]][None], value_cache[
                blocks[chosen], head, offsets[chosen]
            ][None]
        keys, values = key_cache[blocks[chosen], :, offsets[chosen]], value_cache[blocks[chosen], :, offsets[chosen]]
        return keys.transpose(0, 1).contiguous(), values.transpose(0, 1).contiguous()

    if bool(every_key.all()):
        return attend(query, *read(positions), scale)
    key_groups = slot_groups[blocks * block_size + offsets].long()
    output = attend(query, *read(visible_positions(query_groups, key_groups, sink_tokens, window)), scale)
    for head in every_key.nonzero()[:, 0].tolist():
        queries = slice(head * per_kv, (head + 1) * per_kv)
        output[queries] = attend(query[queries], *read(positions, head), scale)
    return output
