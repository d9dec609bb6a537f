"""The window band of the GPU path as one sliding-window flash call: group indicators appended to the head dimension.

The window band - the pairs within the window, or with a sink, whose key group the query does not probe - is a band
along the diagonal with holes where a key's group is probed. Flash attention's sliding window (`window_size=(w, 0)`)
reads exactly the band and takes no mask; the holes go into the scores themselves. Each key gets one more column per
segment (its group, or "not routed yet") and one "hidden" column (a sink, taken apart, or padding), holding 1 where it
belongs; each query holds -M in the columns of the groups it probes and in the hidden one. The appended dot product is
then 0 for a pair of the window band - exactly: every product is a zero - and -M or less for any other pair of the band.

M is a power of two with M * scale >= 4 * bound + 256, `bound` being the largest |score| the states allow (scale times
the largest query norm times the largest key norm). A hidden pair then lies more than 256 below the row's largest
visible score, so its weight, exp of that difference, is exactly 0 in float32; a row whose band holds no pair of set
B has a log-sum-exp below -M * scale / 2 while any other row's is above -bound, and it is given output 0 and
log-sum-exp `NEG`, the kernels' convention for a row without a key. Half precision (float16, largest 65504) cannot
hold such an M for every input, so only dtypes with float32's range take this path (`window_dtype`); the others keep
`bands`.

The sinks - a few keys every query may see - are one small product in float32 (`sink_attention`), merged by
log-sum-exp. Returns what `bands.band_attention` returns: output [batch, heads, q, dim] in the query's dtype and the
natural-log log-sum-exp [batch, heads, q] in float32.
"""

from __future__ import annotations

from typing import Optional

import torch

from focus_hf.attention.gpu.bands import sink_states
from focus_hf.attention.gpu.kernels import NEG, GpuKernels
from focus_hf.attention.gpu.merge import merge_heads

# Bytes of the copies one windowed call may take (a run of kv heads' keys and values, its queries and their result).
WINDOW_BYTES = 1 << 29
# Query rows of the sinks' float32 scores at a time.
SINK_ROWS = 65536
# Below this, M * scale exceeds every score the states allow by 4 times their bound (see the module docstring).
MARGIN = 256.0


def window_dtype(dtype: torch.dtype) -> bool:
    """Whether `dtype` holds the indicator's magnitude for any input: float32's exponent range (bfloat16 has it)."""
    return torch.finfo(dtype).max >= 2.0**127


def window_attention(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The window band without a model's mask: output [batch, heads, q, dim] in the query's dtype, lse [batch, heads, q]
    in float32 (see the module docstring).

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
    per_kv = heads // kv_heads
    device = query.device
    columns = num_groups + 2  # the groups, "not routed yet", hidden
    hidden = num_groups + 1
    key_column = torch.where(key_groups >= 0, key_groups, num_groups).long()
    key_flags = torch.zeros(batch, kv_len, columns, dtype=query.dtype, device=device)
    key_flags.scatter_(2, key_column[..., None], 1)
    key_flags[..., hidden] = (key_sink | ~valid).to(query.dtype)
    magnitude = _magnitude(query, key, scaling)
    probes = query_groups.long()
    probe_column = torch.where(probes >= 0, probes, torch.where(probes == -1, num_groups, hidden))
    query_flags = torch.zeros(batch, q_len, columns, dtype=torch.bool, device=device)
    query_flags.scatter_(2, probe_column, True)
    query_flags[..., hidden] = True
    query_flags = torch.where(query_flags, -magnitude.to(query.dtype), 0).to(query.dtype)

    sequences = (
        torch.arange(batch + 1, device=device, dtype=torch.int32) * q_len,
        torch.arange(batch + 1, device=device, dtype=torch.int32) * kv_len,
        q_len,
        kv_len,
    )
    output = query.new_empty(batch, heads, q_len, dim)
    lse = torch.empty(batch, heads, q_len, dtype=torch.float32, device=device)
    # The flags padded to the kernels' head dim, so that the kernels copy nothing more.
    spare = kernels.head_dims(dim + columns) - dim - columns
    key_flags, query_flags = (torch.nn.functional.pad(flags, (0, spare)) for flags in (key_flags, query_flags))
    value_flags = torch.zeros_like(key_flags)
    element = query.element_size() * (dim + columns + spare)
    per_kv_head = 2 * batch * kv_len * element  # its packed keys and values
    per_query_head = 2 * batch * q_len * element  # its packed queries and their result
    run = max(1, min(kv_heads, WINDOW_BYTES // (per_kv_head + per_kv * per_query_head)))
    # A kv head past the budget on its own takes its query heads in runs over one packed copy of its keys.
    query_run = run * per_kv if run > 1 else max(1, min(per_kv, (WINDOW_BYTES - per_kv_head) // per_query_head))
    empty_below = magnitude * (-scaling / 2)
    for first in range(0, kv_heads, run):
        kv_run = slice(first, min(first + run, kv_heads))
        keys, values = _packed(key[:, kv_run], key_flags), _packed(value[:, kv_run], value_flags)
        for first_head in range(kv_run.start * per_kv, kv_run.stop * per_kv, query_run):
            heads_run = slice(first_head, min(first_head + query_run, kv_run.stop * per_kv))
            count = heads_run.stop - heads_run.start
            queries = _packed(query[:, heads_run], query_flags)
            part, part_lse = kernels.varlen(queries, keys, values, *sequences, scaling, window)
            del queries
            part = part[..., :dim].reshape(batch, q_len, count, dim).transpose(1, 2)
            part_lse = part_lse.reshape(batch, q_len, count).transpose(1, 2)
            empty = part_lse < empty_below
            output[:, heads_run] = part.masked_fill(empty[..., None], 0)
            lse[:, heads_run] = part_lse.masked_fill(empty, NEG)
            del part, part_lse
        del keys, values
    sink_attention(output, lse, query, key, value, valid, query_groups, key_groups, key_sink, scaling, sink_slots)
    return output, lse


def _magnitude(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """M (a float32 0-d tensor, no device read): the least power of two with M * scale >= 4 * bound + MARGIN."""
    bound = scaling * _largest_norm(query) * _largest_norm(key)
    # Capped where bfloat16 still holds it (scores past 2^120 overflow the kernels anyway).
    return torch.exp2(torch.ceil(torch.log2((4 * bound + MARGIN) / scaling))).clamp(max=2.0**120)


def _largest_norm(states: torch.Tensor) -> torch.Tensor:
    """The largest vector norm along the last dimension, in float32, one kv head or query head at a time."""
    norms = [torch.linalg.vector_norm(states[:, head].float(), dim=-1).amax() for head in range(states.shape[1])]
    return torch.stack(norms).amax()


def _packed(states: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """[batch, h, n, dim] states and [batch, n, c] flags as the kernels' packed [batch * n, h, dim + c]."""
    batch, heads, length, _ = states.shape
    flags = flags[:, :, None].expand(batch, length, heads, flags.shape[-1])
    return torch.cat([states.transpose(1, 2), flags], dim=-1).reshape(batch * length, heads, -1)


def sink_attention(
    output: torch.Tensor,
    lse: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    scaling: float,
    sink_slots: Optional[int],
) -> None:
    """Fold the pairs of each query with the sinks it may see - real, not after it, of a group it does not probe -
    into `output` and `lse` (float32 scores, SINK_ROWS queries at a time)."""
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    per_kv = heads // kv_heads
    sink_keys, sink_values, sink_position, sink_group = sink_states(key, value, valid, key_groups, key_sink, sink_slots)
    if sink_keys.shape[2] == 0:
        return
    for start in range(0, q_len, SINK_ROWS):
        rows = slice(start, min(start + SINK_ROWS, q_len))
        position = (kv_len - q_len) + torch.arange(rows.start, rows.stop, device=query.device)
        probed = (query_groups[:, rows, None, :] == sink_group[:, None, :, None]).any(dim=-1)  # [batch, q, s]
        visible = (sink_position[:, None, :] >= 0) & (sink_position[:, None, :] <= position[None, :, None]) & ~probed
        grouped = query[:, :, rows].float().reshape(batch, kv_heads, per_kv, -1, dim)
        scores = (grouped @ sink_keys.float()[:, :, None].transpose(-1, -2)) * scaling  # [b, kv, per_kv, q, s]
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
        part_lse = torch.logsumexp(scores, dim=-1)
        has_key = visible.any(dim=-1)[:, None, None]
        weights = torch.exp(scores - torch.where(has_key, part_lse, 0.0)[..., None])
        part = (weights @ sink_values.float()[:, :, None]).reshape(batch, heads, -1, dim)
        part_lse = torch.where(has_key, part_lse, NEG).reshape(batch, heads, -1)
        # merge_heads folds whole rows: fold this chunk's rows through views of them.
        merge_heads(output[:, :, rows], lse[:, :, rows], slice(None), part, part_lse)
