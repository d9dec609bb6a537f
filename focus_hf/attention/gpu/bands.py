"""The window band of the GPU path in plain torch: each block of queries against its window's keys and the sinks.

The window band - the pairs within the window, or with a sink, whose key group the query does not probe - is a narrow
band along the diagonal plus a few columns. As one FlexAttention call, its `mask_mod` read the pattern's tensors pair by
pair, and on an H200 that reading was the call's cost: 282 ms at 256K tokens (32 / 8 heads, w 128), against 6 ms for
a mask computed from the indices alone over the same blocks (`benchmarks/results/gpu/chunked-scan/profile.json`,
`mask_costs`). Here each block of BAND_ROWS queries reads its band - the BAND_ROWS + w keys that end with its last
query, one strided view of the keys - and its sample's sinks, gathered once; the mask is built once per chunk of
blocks by broadcast comparisons of positions and groups, shared by every head, and attention is two batched matmuls
and a softmax in float32. A sink inside a band is taken with the sinks only, so no pair counts twice. Chunks of bands
hold at most `budget.temporary_bytes` of float32 temporaries.

Writes what `kernels.flex` returns for the window band into the call's output and log-sum-exp: the output in the query's
dtype and the natural-log log-sum-exp in float32, `NEG` with a zero output for a row without a visible key, ready for
`merge.merge_heads`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from focus_hf.attention.gpu import budget
from focus_hf.attention.gpu.kernels import NEG

BAND_ROWS = 128  # queries per band


def band_attention(
    output: torch.Tensor,
    lse: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    window: int,
    scaling: float,
    model_mask: Optional[torch.Tensor] = None,
    sink_slots: Optional[int] = None,
) -> None:
    """The window band, written into `output` [batch, heads, q, dim] (the query's dtype) and `lse` [batch, heads, q]
    (float32): it is the first part to fill them.

    Args:
        query: [batch, heads, q, dim], the last q of the kv tokens.
        key: [batch, kv_heads, kv, dim].
        value: [batch, kv_heads, kv, dim].
        valid: [batch, kv] False for padding keys.
        query_groups: [batch, q, top_k] the groups each query probes.
        key_groups: [batch, kv] each key's group (-1: not routed yet, never probed).
        key_sink: [batch, kv] whether each key is a sink.
        window: the local window w: a query at p sees the keys at p - w .. p.
        scaling: the softmax scale.
        model_mask: a boolean mask [batch or 1, 1, q, kv] (True: may attend), or None.
        sink_slots: at least the number of sinks of any sample (routing's `sink_tokens`: a sample's sinks are its
            first real tokens), so that nothing is read from the device; None: counted from `key_sink` (one read,
            which under torch.compile is a graph break).
    """
    batch, heads, q_len, dim = query.shape
    kv_len = key.shape[2]
    offset = kv_len - q_len
    bands = -(-q_len // BAND_ROWS)
    span = BAND_ROWS + window
    # Per-key tensors padded by w before the keys (the first band starts there) and after them to whole bands; band r
    # then starts at offset + r * BAND_ROWS of the padded positions. A sink is taken with the sinks, never in a band:
    # padding and sinks are hidden from the bands alike.
    pad = (window, bands * BAND_ROWS - q_len)
    positions = torch.arange(kv_len, device=key.device).expand(batch, kv_len)
    band_position = _bands(torch.where(valid & ~key_sink, positions, -1), pad, offset, span)  # [b, bands, span]
    band_group = _bands(key_groups, pad, offset, span)
    sinks = sink_states(key, value, valid, key_groups, key_sink, sink_slots)

    expanded_mask = None if model_mask is None else model_mask[:, 0].expand(-1, q_len, kv_len)
    # A band's float32 temporaries: its scores and weights (their chunk's mask is smaller), its queries and output.
    per_band = batch * heads * BAND_ROWS * (2 * (span + sinks[0].shape[-1]) + 2 * dim) * 4
    step = budget.runs_of(bands, per_band, budget.temporary_bytes(query))
    for first in range(0, bands, step):
        chunk = slice(first, min(first + step, bands))
        rows = slice(chunk.start * BAND_ROWS, min(chunk.stop * BAND_ROWS, q_len))
        missing = (chunk.stop - chunk.start) * BAND_ROWS - (rows.stop - rows.start)  # the last band's padding rows
        query_index = torch.arange(rows.start, rows.start + (chunk.stop - chunk.start) * BAND_ROWS, device=key.device)
        probes = F.pad(query_groups[:, rows].long(), (0, 0, 0, missing), value=-3)  # padding rows probe nothing
        mask = _chunk_mask(
            offset + query_index,
            probes,
            band_position[:, chunk],
            band_group[:, chunk],
            sinks,
            window,
            expanded_mask,
            query_index.clamp(max=q_len - 1),
        )
        # The keys of the chunk's bands only: positions offset + start * BAND_ROWS - w up to its last query.
        low, high = offset + chunk.start * BAND_ROWS - window, offset + chunk.stop * BAND_ROWS
        band_keys, band_values = (_span(states, low, high).unfold(2, span, BAND_ROWS) for states in (key, value))
        queries = F.pad(query[:, :, rows], (0, 0, 0, missing))
        part, part_lse = _attend(queries, band_keys, band_values, sinks, mask, scaling)
        output[:, :, rows] = part[:, :, : rows.stop - rows.start]
        lse[:, :, rows] = part_lse[:, :, : rows.stop - rows.start]


def _bands(per_key: torch.Tensor, pad: tuple[int, int], offset: int, span: int) -> torch.Tensor:
    """[batch, kv] per-key values as each band's [batch, bands, span] (-1 at padding positions)."""
    return F.pad(per_key, pad, value=-1)[:, offset:].unfold(1, span, BAND_ROWS)


def _span(states: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """states[:, :, low:high] of [batch, kv_heads, kv, dim], zeros where the range passes either end."""
    kv_len = states.shape[2]
    inside = states[:, :, max(low, 0) : min(high, kv_len)]
    return F.pad(inside, (0, 0, max(-low, 0), max(high - kv_len, 0)))


def sink_states(
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    slots: Optional[int],
) -> tuple[torch.Tensor, ...]:
    """Each sample's sinks, in position order, in `slots` columns (None: the most any sample has, read from the
    device): keys and values [batch, kv_heads, s, dim], positions [batch, s] (-1: an empty slot) and groups
    [batch, s]."""
    if slots is None:
        slots = int(key_sink.sum(dim=1).max()) if key_sink.numel() else 0
    count = min(slots, key_sink.shape[1])
    # A stable sort on "not a sink" puts each sample's sinks first, in position order.
    order = torch.argsort((~key_sink).to(torch.int8), dim=1, stable=True)[:, :count]
    real = (key_sink & valid).gather(1, order)
    index = order[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[-1])
    return key.gather(2, index), value.gather(2, index), torch.where(real, order, -1), key_groups.gather(1, order)


def _chunk_mask(
    query_position: torch.Tensor,
    probes: torch.Tensor,
    band_position: torch.Tensor,
    band_group: torch.Tensor,
    sinks: tuple[torch.Tensor, ...],
    window: int,
    model_mask: Optional[torch.Tensor],
    mask_rows: torch.Tensor,
) -> torch.Tensor:
    """[batch, bands, BAND_ROWS, span + s] the pairs of the window band among a chunk's bands and the sinks;
    `model_mask` [batch or 1, q, kv] (expanded), read at `mask_rows` (the chunk's queries in the call, past its last
    clamped to it)."""
    batch, bands, span = band_position.shape
    _, _, sink_position, sink_group = sinks
    # [batch, bands, BAND_ROWS, 1] against [batch, bands, 1, span], then against the sinks [batch, 1, 1, s].
    rows = query_position.view(1, bands, BAND_ROWS, 1)
    probed_rows = probes.view(batch, bands, BAND_ROWS, 1, -1)
    key_position = torch.cat(
        [band_position[:, :, None, :], sink_position[:, None, None, :].expand(-1, bands, -1, -1)], dim=-1
    )
    key_group = torch.cat([band_group, sink_group[:, None, :].expand(-1, bands, -1)], dim=-1)[:, :, None, :]
    probed = (probed_rows == key_group[..., None]).any(dim=-1)
    near = rows - key_position <= window
    near[..., span:] = True  # a sink is near every query
    mask = (key_position >= 0) & (key_position <= rows) & near & ~probed
    if model_mask is not None:  # [batch or 1, q, kv], any dimension broadcast: read at the pairs only
        sample = torch.arange(model_mask.shape[0], device=mask.device).view(-1, 1, 1, 1)
        row = mask_rows.view(1, bands, BAND_ROWS, 1)
        mask &= model_mask[sample, row, key_position.clamp(min=0)]
    return mask


def _attend(
    queries: torch.Tensor,
    band_keys: torch.Tensor,
    band_values: torch.Tensor,
    sinks: tuple[torch.Tensor, ...],
    mask: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: queries [batch, heads, bands * BAND_ROWS, dim] against their bands [batch, kv_heads, bands, dim, span]
    and the sinks, under `mask` [batch, bands, BAND_ROWS, span + s]; (output, lse) for the chunk's rows."""
    batch, heads, rows, dim = queries.shape
    kv_heads, bands = band_keys.shape[1], band_keys.shape[2]
    per_kv = heads // kv_heads
    sink_keys, sink_values = sinks[0], sinks[1]
    # Query heads of one kv head and the rows of one band as one matrix: [batch, kv, bands, per_kv * BAND_ROWS, dim].
    grouped = queries.float().reshape(batch, kv_heads, per_kv, bands, BAND_ROWS, dim).transpose(2, 3)
    grouped = grouped.reshape(batch, kv_heads, bands, per_kv * BAND_ROWS, dim)
    scores = torch.cat(
        [grouped @ band_keys.float(), grouped @ sink_keys.float()[:, :, None].transpose(-1, -2)], dim=-1
    )  # [batch, kv, bands, per_kv * BAND_ROWS, span + s]
    scores = scores.view(batch, kv_heads, bands, per_kv, BAND_ROWS, -1).mul_(scaling)
    scores.masked_fill_(~mask[:, None, :, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores.sub_(torch.where(torch.isfinite(lse), lse, 0.0)[..., None]))  # 0 where masked
    weights = weights.view(batch, kv_heads, bands, per_kv * BAND_ROWS, -1)
    span = band_keys.shape[-1]
    output = weights[..., :span] @ band_values.float().transpose(-1, -2)
    output = output + weights[..., span:] @ sink_values.float()[:, :, None]
    # Back to [batch, heads, rows, dim] with head = kv head * per_kv + its index among them.
    output = output.view(batch, kv_heads, bands, per_kv, BAND_ROWS, dim).transpose(2, 3)
    output = output.reshape(batch, heads, rows, dim)
    lse = lse.transpose(2, 3).reshape(batch, heads, rows)
    return output.to(queries.dtype), lse.clamp_min(NEG)
