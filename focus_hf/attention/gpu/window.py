"""The window band of the GPU path as flash calls: a sliding window, the sinks, and group indicators in the head dim.

The window band - the pairs within the window, or with a sink, whose key group the query does not probe - is a band
along the diagonal with holes where a key's group is probed, and a few columns (the sinks). Flash attention's sliding
window (`window_size=(w, 0)`) reads exactly the band and takes no mask; the holes go into the scores themselves. Each
key gets one more column per segment (its group, or "not routed yet") and one "hidden" column, holding 1 where it
belongs; each query holds -M in the columns of the groups it probes and in the hidden one. The appended dot product is
then 0 for a pair of the window band - exactly: every product is a zero - and -M or less for any other pair.

The sinks are one more call per chunk of rows, over each sample's sinks in one sequence - the sinks first, then
hidden slots up to the chunk's length, so that causal attention aligned to the bottom right lets every query of the
chunk see every sink. A sink's indicators are its group's column and one column of its own, in which a query holds -M
when that sink comes after it; in the sliding-window call every sink is hidden (its hidden column), so that no pair
counts twice. The two calls are merged by log-sum-exp. The sinks' scores are then the kernel's own (float32
accumulation), and they take no float32 copy of the queries.

M is a power of two with M * scale >= 4 * bound + 256, `bound` being a bound of |score| that the states allow (scale
times the head dim times the largest |entry| of the queries and of the keys). A hidden pair then lies more than 256
below the row's largest visible score, so its weight, exp of that difference, is exactly 0 in float32 (and a merge
gives a call whose row holds only hidden pairs a weight of exactly 0 against one that holds a visible pair); a row whose
band holds no pair of the window band has a log-sum-exp below -M * scale / 2 while any other row's is above -bound,
and it is given output 0 and log-sum-exp `NEG`, the kernels' convention for a row without a key. Half precision
(float16, largest 65504) cannot hold such an M for every input, so only dtypes with float32's range take this path
(`window_dtype`); the others keep `bands`.

The queries go in chunks of rows, all heads at once: a chunk's queries, and its keys from w before its first query,
are packed with their indicators into buffers reused from chunk to chunk, and each sample's chunk is one sequence of
the calls. Chunks hold at most `budget.temporary_bytes` (a share of the output), so that the band's memory is a fixed
share of the call's at every length. The band writes into the call's output [batch, heads, q, dim] (in the query's
dtype) and natural-log log-sum-exp [batch, heads, q] (float32): it is the first part to fill them.
"""

from __future__ import annotations

from typing import Optional

import torch

from focus_hf.attention.gpu import budget
from focus_hf.attention.gpu.bands import sink_states
from focus_hf.attention.gpu.kernels import NEG, GpuKernels
from focus_hf.attention.gpu.merge import merge_heads

# Below this, M * scale exceeds every score the states allow by 4 times their bound (see the module docstring).
MARGIN = 256.0
# The fewest query rows of a chunk: a budget smaller than that many rows takes more memory, not more chunks.
MIN_CHUNK_ROWS = 1024


def window_dtype(dtype: torch.dtype) -> bool:
    """Whether `dtype` holds the indicator's magnitude for any input: float32's exponent range (bfloat16 has it)."""
    return torch.finfo(dtype).max >= 2.0**127


def window_attention(
    output: torch.Tensor,
    lse: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    num_groups: int,
    window: int,
    scaling: float,
    kernels: GpuKernels,
    sink_slots: Optional[int] = None,
) -> None:
    """The window band without a model's mask, written into `output` [batch, heads, q, dim] (the query's dtype) and
    `lse` [batch, heads, q] (float32) (see the module docstring).

    Args:
        query: [batch, heads, q, dim], the last q of the kv tokens.
        key: [batch, kv_heads, kv, dim].
        value: [batch, kv_heads, kv, dim].
        valid: [batch, kv] False for padding keys.
        query_groups: [batch, q, top_k] the groups each query probes (-1: the keys not routed yet; below -1: none).
        key_groups: [batch, kv] each key's group (-1: not routed yet).
        key_sink: [batch, kv] whether each key is a sink.
        num_groups: K, the router's groups.
        window: the local window w: a query at p sees the keys at p - w .. p.
        scaling: the softmax scale.
        kernels: a kernel set whose `runs_window(query.dtype)`.
        sink_slots: as in `bands.band_attention`.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    offset = kv_len - q_len
    sinks = sink_states(key, value, valid, key_groups, key_sink, sink_slots)
    slots = sinks[0].shape[2]
    hidden = num_groups + 1  # the indicator columns: the groups, "not routed yet", hidden, then one per sink
    flags = slice(dim, dim + num_groups + 2 + slots)
    width = kernels.head_dims(flags.stop)  # the packed head dim: states, indicators, zeros
    magnitude = _magnitude(query, key, scaling)
    key_flags, query_flags = _indicators(
        valid, query_groups, key_groups, key_sink, num_groups, sinks[2], offset, magnitude, query.dtype
    )

    element = batch * width * query.element_size()
    runs = kernels.varlen_calls(heads, kv_heads)
    # Per row: its packed queries, its window's and the sinks' packed keys and values, a call's results, the sinks'
    # part of every head; its log-sum-exps.
    per_row = (heads + 4 * kv_heads + 2 * heads // len(runs)) * element + batch * heads * (
        dim * query.element_size() + 12
    )
    fixed = 2 * (window + slots) * kv_heads * element
    rows = min(q_len, max(budget.runs_of(q_len, per_row, budget.temporary_bytes(query), fixed), MIN_CHUNK_ROWS))
    # Zeros: the columns past the indicators stay 0 in every chunk.
    packed_queries = query.new_zeros(batch * rows, heads, width)
    packed_keys = query.new_zeros(batch * (rows + window), kv_heads, width)
    packed_values = query.new_zeros(batch * (rows + window), kv_heads, width)
    sink_keys, sink_values = _packed_sinks(sinks, num_groups, dim, width, rows)
    # The sinks' part of a chunk, token-major as the calls return it.
    far, far_lse = query.new_empty(batch, rows, heads, dim), lse.new_empty(batch, rows, heads)
    query_tokens, key_tokens, value_tokens = (states.transpose(1, 2) for states in (query, key, value))
    tokens, lse_tokens = output.transpose(1, 2), lse.transpose(1, 2)  # [batch, q, heads, dim], [batch, q, heads]
    # Each call's heads in the result and in the sinks' part.
    targets = [(tokens[:, :, run], lse_tokens[:, :, run], far[:, :, run], far_lse[:, :, run]) for run in runs]
    step = torch.arange(batch + 1, device=query.device, dtype=torch.int32)
    for start in range(0, q_len, rows):
        count = min(rows, q_len - start)
        spans = count + window  # key slots: from w before the chunk's first query to its last
        queries = packed_queries[: batch * count]
        queries.view(batch, count, heads, width)[..., :dim] = query_tokens[:, start : start + count]
        queries.view(batch, count, heads, width)[..., flags] = query_flags[:, start : start + count, None]
        keys, values = packed_keys[: batch * spans], packed_values[: batch * spans]
        key_slots, value_slots = keys.view(batch, spans, kv_heads, width), values.view(batch, spans, kv_heads, width)
        before = max(0, window - offset - start)  # slots before the first key: empty and hidden
        if before:
            key_slots[:, :before] = 0
            key_slots[:, :before, :, dim + hidden] = 1
            value_slots[:, :before] = 0
        real = slice(offset + start - window + before, offset + start + count)
        key_slots[:, before:, :, :dim] = key_tokens[:, real]
        key_slots[:, before:, :, flags] = key_flags[:, real, None]
        value_slots[:, before:, :, :dim] = value_tokens[:, real]
        if start == 0 or count < rows:  # each sample's chunk is one sequence; the sinks are its keys' first
            near = (step * count, step * spans, count, spans)
            sink_sequences = (step * count, step * (slots + rows), count, slots + rows)
        chunk = slice(start, start + count)
        for run, (run_tokens, run_lse, run_far, run_far_lse) in zip(runs, targets):
            run_queries = queries[:, run]
            part, part_lse = kernels.varlen(run_queries, keys, values, *near, scaling, window)
            run_tokens[:, chunk] = part.view(batch, count, -1, width)[..., :dim]
            run_lse[:, chunk] = part_lse.view(batch, count, -1)
            if slots:
                part, part_lse = kernels.varlen(run_queries, sink_keys, sink_values, *sink_sequences, scaling)
                run_far[:, :count] = part.view(batch, count, -1, width)[..., :dim]
                run_far_lse[:, :count] = part_lse.view(batch, count, -1)
            del part, part_lse
        if slots:
            sinks_part = (far[:, :count].transpose(1, 2), far_lse[:, :count].transpose(1, 2))
            merge_heads(output[:, :, chunk], lse[:, :, chunk], slice(None), *sinks_part)
    # Rows whose band holds no pair: the kernels' convention for a row without a visible key.
    empty = lse < magnitude * (-scaling / 2)
    lse.masked_fill_(empty, NEG)
    output.masked_fill_(empty[..., None], 0)


def _indicators(
    valid: torch.Tensor,
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    num_groups: int,
    sink_position: torch.Tensor,
    offset: int,
    magnitude: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indicator columns in `dtype`, K + 2 + s per token (s sink slots): a key's [batch, kv, K + 2 + s] hold 1 in
    its segment's column (its group, K for "not routed yet") and, for a sink or padding, in the hidden one (K + 1); a
    query's [batch, q, K + 2 + s] hold -M in the columns of the groups it probes (K for -1, the hidden one for a slot
    that probes none), in the hidden one, and in the column of each sink after it (`sink_position` [batch, s], -1: an
    empty slot)."""
    slots = sink_position.shape[1]
    columns = torch.arange(num_groups + 2, device=valid.device)
    hidden = columns == num_groups + 1
    segment = torch.where(key_groups >= 0, key_groups, num_groups).long()
    key_flags = (segment[..., None] == columns) | ((key_sink | ~valid)[..., None] & hidden)
    probes = query_groups.long()
    probe_column = torch.where(probes >= 0, probes, torch.where(probes == -1, num_groups, num_groups + 1))
    probed = (probe_column[..., None] == columns).any(dim=-2) | hidden
    position = offset + torch.arange(query_groups.shape[1], device=valid.device)
    later = sink_position[:, None, :] > position[None, :, None]  # [batch, q, s]
    minus = -magnitude.to(dtype)
    query_flags = torch.where(torch.cat([probed, later], dim=-1), minus, torch.zeros_like(minus))
    key_flags = torch.cat([key_flags, key_flags.new_zeros(*key_flags.shape[:2], slots)], dim=-1)
    return key_flags.to(dtype), query_flags


def _packed_sinks(
    sinks: tuple[torch.Tensor, ...], num_groups: int, dim: int, width: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sinks' packed keys and values [batch * (s + rows), kv_heads, width]: per sample its s sink slots (states,
    their group's column, the hidden column for an empty slot, their own column), then `rows` hidden slots."""
    keys, values, position, group = sinks
    batch, kv_heads, slots, _ = keys.shape
    packed_keys = keys.new_zeros(batch, slots + rows, kv_heads, width)
    packed_values = keys.new_zeros(batch, slots + rows, kv_heads, width)
    if slots:
        packed_keys[:, :slots, :, :dim] = keys.transpose(1, 2)
        packed_values[:, :slots, :, :dim] = values.transpose(1, 2)
        column = dim + torch.where(group >= 0, group, num_groups)  # [batch, s]
        column = torch.where(position >= 0, column, dim + num_groups + 1)  # an empty slot: hidden
        packed_keys[:, :slots].scatter_(-1, column[:, :, None, None].expand(-1, -1, kv_heads, 1), 1)
        own = dim + num_groups + 2 + torch.arange(slots, device=keys.device)
        packed_keys[:, torch.arange(slots, device=keys.device), :, own] = 1
    packed_keys[:, slots:, :, dim + num_groups + 1] = 1
    return packed_keys.view(-1, kv_heads, width), packed_values.view(-1, kv_heads, width)


def _magnitude(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """M (a float32 0-d tensor, no device read): the least power of two with M * scale >= 4 * bound + MARGIN, where
    |q . k| * scale <= bound = scale * dim * max|q_i| * max|k_i| (a norm is at most sqrt(dim) times the largest
    entry: one reduction per tensor, no copy)."""
    bound = scaling * query.shape[-1] * _largest_entry(query) * _largest_entry(key)
    # Capped where bfloat16 still holds it (scores past 2^120 overflow the kernels anyway).
    return torch.exp2(torch.ceil(torch.log2((4 * bound + MARGIN) / scaling))).clamp(max=2.0**120)


def _largest_entry(states: torch.Tensor) -> torch.Tensor:
    """max |x| over `states`, as float32 0-d: one strided reduction (`aminmax` would first copy non-contiguous states,
    as a model's queries are)."""
    return torch.linalg.vector_norm(states, ord=float("inf")).float()
