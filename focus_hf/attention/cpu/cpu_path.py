"""The CPU path: hard-mode Focus attention from standard attention calls and the C kernels, with no n x n tensor.

Every pair the hard pattern allows (`pattern.allowed_pairs`) lies in exactly one of two sets:

  the own-group pass   same-group pairs: j <= i and key_groups[j] is among query_groups[i] (local and sink pairs
                       included) - the paper's first call, tokens sorted by group;
  the window band      every other allowed pair: j <= i, key_groups[j] not among query_groups[i], and i - j <= window
                       or j a sink - the paper's second call.

The own-group pass (`partials.probe_part`): keys are sorted by their group and query entries (one per probed group) by
the group they probe, each in position order; a query entry sees a prefix of its segment's keys, so each segment's
entries go in chunks, one non-causal call per chunk over the keys the chunk reaches, masked only on the staircase
between its first and last entry's reach (past `partials.SPLIT_MIN_KEYS` keys, the keys every entry sees go in an
unmasked call with each kv head's query heads folded into the query axis, and the staircase in a second, small one).
Where a segment's entries are its own newest keys (own-group routing at top_k = 1), the staircase is a causal square and
the chunk needs no mask at all. At top_k = 1 the sinks of other groups ride in front of each segment's keys: every query
after the last sink reads its window band sink pairs there, near or far, and the local part leaves the sinks out of its
window - no separate pass. The same code serves top-1 and top-k, shared and separate query routers, and chunked prefill
after a KV cache. No local pair has to be taken out of the own-group pass (a call could not express "j < i - w") because
the window band leaves the same-group pairs out instead.  The window band is split in two: the local pairs - queries in
blocks of `partials.LOCAL_BLOCK` read the `window` keys before their block and the block itself, as overlapping strided
views of the keys, under a [block, window + block] mask; and the pairs with sinks farther than the window that did not
ride in the own-group pass (top_k > 1, and the few queries before the last sink), a handful of keys done with two small
matmuls.

On CPU in float32 and bfloat16 the C prefill kernel of `native` runs the own-group pass in one call per block of
OWN_GROUP_ROWS queries (`segments.SegmentKeys`, the group sort a counting sort in C): it reads each segment's keys where
they lie through their token indices (no gathered copy), gives each entry its reach (skipping the key blocks past a
query block's last) and folds each entry into its query's row of the output as it finishes - no chunks, calls or merges
in torch. It runs the local part and the sink pairs too (the local rule read from group bits), folded into the same
output, and each block's window band is folded in before the next block's own-group pass, so that one block's
log-sum-exp is held rather than every query's.

The partial results of a query (the own-group pass, local, sinks) are merged exactly by log-sum-exp. Hidden keys carry
finfo.min rather than -inf, so a partial without visible keys has a log-sum-exp near finfo.min, gets weight 0 in the
merge and never produces a NaN.

Decoding (at most DECODE_MAX_QUERIES queries) gathers only the keys those queries can reach - their groups' keys,
their window and the sinks - and runs one small attention over them (unmasked for one query). A one-query step
whose layer keeps group-sorted copies of each sample's distant keys (`grouped_keys.GroupedKeys`, kept per KV cache
by `tuner.layer`) reads its probed groups from the copy and its window from the cache, as slices: no gather (on CPU
in one call of the C kernel of `native`, where it could be built).

Below `crossover.dense_below` keys (a crossover measured once per machine, shape and path), "auto" runs the pattern as
one dense masked call; so does every backend when the model's mask is more than causal + padding (sliding-window
layers), since the fast paths read only the key padding from it. On CPU in float32 and bfloat16 (and a mask of no more
than causal + padding) the C prefill kernel reads the pattern from per-token group bits (`pattern.pattern_bits`) as it
goes, 1.0-1.5x the speed of unmasked dense SDPA at 256-2K tokens; elsewhere its bias is built by `pattern.pattern_bias`
(the kernel's causal flag hiding the future keys of square calls). When every query probes all K groups, the pattern is
causal attention, and one causal call runs it.

Forward only: the attention kernels' backward ignores the gradient of the log-sum-exp they return, which the
merge depends on, so `attention.focus_attention_forward` sends calls that need gradients to the reference path.

Costs (n tokens, K groups, window w, top-k probes): the own-group pass ~ k n^2 / 2K (+ n PROBE_CHUNK / 2 on the
staircases), the window band ~ n (w + partials.LOCAL_BLOCK); memory: the float32 output and log-sum-exp, one segment's
keys and one block of STREAM_ROWS queries' partial results - on CPU in float32 and bfloat16 the output, 4 bytes per key
(the sorted keys), one block's log-sum-exp and entries and one packing buffer (`native_prefill.packing_scratch`): less
than dense SDPA adds to its output at 128K tokens. A decoding step reads ~ k n / K + w keys; the group-sorted copy it
reads them from holds the routed heads' distant keys and values a second time (off with
`set_routing(decode_copy=False)`).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from focus_hf.attention.backends import Kernel
from focus_hf.attention.cpu.grouped_keys import GroupedKeys
from focus_hf.attention.cpu.native_prefill import SEGMENT_SLAB_KEYS, packing_scratch, prefill_attention
from focus_hf.attention.cpu.partials import (
    few_query_attention,
    gather_tokens,
    hidden_bias,
    local_part,
    merge_into,
    probe_part,
    sink_part,
    slot_buffer,
)
from focus_hf.attention.cpu.segments import SegmentKeys
from focus_hf.attention.pattern import (
    BITS_MAX_GROUPS,
    allowed_pairs,
    pattern_bias,
    pattern_bits,
    probes,
)
from focus_hf.attention.routing import waiting_keys

# Up to this many queries against a longer cache, gathering the reachable keys beats laying out all groups.
DECODE_MAX_QUERIES = 16
# Up to this many reachable keys of one sample, an index_select along the token axis of each state is the cheapest
# gather (no index to build) and one query's unmasked SDPA beats two matmuls; beyond, one index_select of rows over
# all heads (`gather_tokens`) and the matmuls run faster (CPU, measured: gather 80 vs 94 us at 2K keys, 2.8 vs 1.8 ms
# at 17K; attention 143 vs 157 us at 2K, 2.8 vs 2.3 ms at 17K).
DIRECT_GATHER_MAX = 4096
# Queries per block of the window band's parts (local and sinks) in a prefill: each block's partial result is folded
# into the output before the next is computed, so a call holds the output and one block's partials, not a second
# full-size result (~5 KiB per row, ~5 MiB per block at 9 x 64 heads). 1,024 and 4,096 rows ran equally fast at 4K and
# 16K.
STREAM_ROWS = 1024
# Query rows per block of the own-group pass in the C kernel (`segments.SegmentKeys`). Each block's call reads its
# segments' keys up to its last query again, so fewer rows repack more keys; a block's log-sum-exp and entries take ~48
# bytes per row at 9 heads and top_k 1.
OWN_GROUP_ROWS = 16384


def sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_valid: Optional[torch.Tensor],
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    num_groups: int,
    window: int,
    scaling: float,
    kernel: Kernel,
) -> torch.Tensor:
    """The own-group pass and the window band merged: [batch, q, heads, dim].

    In the C kernel (`segments.SegmentKeys`), the own-group pass goes OWN_GROUP_ROWS queries at a time and each block's
    window band is folded in before the next, so that only one block's log-sum-exp is held beside the output; elsewhere
    the own-group pass comes whole from `probe_part` and the window band follows. The window band's parts go STREAM_ROWS
    queries at a time (memory)."""
    valid = key_valid
    if valid is None:
        valid = torch.ones(query.shape[0], key.shape[2], dtype=torch.bool, device=query.device)
    batch, heads, q_len, dim = query.shape
    first_query = key.shape[2] - q_len

    def fold_window_band(
        output: torch.Tensor,
        lse: torch.Tensor,
        sinks_done: Optional[torch.Tensor],
        begin: int,
        end: int,
        scratch: Optional[torch.Tensor] = None,
    ) -> None:
        """Fold the window band of query rows begin .. end - 1 into float32 `output` [batch, end - begin, heads, dim]
        and `lse` [batch, end - begin, heads], which hold their own-group pass (`sinks_done` [batch, end - begin]: the
        rows whose sink pairs rode there, or None), STREAM_ROWS queries at a time: each block's partial result is folded
        in before the next is computed, so that only one block's is held beside the output. `scratch`:
        `native_prefill.packing_scratch` for the C kernel's calls."""
        # The queries that may have sink pairs left: the own-group pass did those of the queries it marks.
        sink_end = end
        if sinks_done is not None:  # padding queries' outputs are meaningless: no sink pass for them
            pending = (~sinks_done & valid[:, first_query + begin : first_query + end]).any(dim=0).nonzero()
            sink_end = begin + (int(pending[-1]) + 1 if len(pending) else 0)
        for start, stop, keys_end in row_blocks(begin, sink_end, first_query):
            rows = slice(start - begin, stop - begin)
            sinks = sink_part(
                query[:, :, start:stop],
                key[:, :, :keys_end],
                value[:, :, :keys_end],
                query_groups[:, start:stop],
                key_groups[:, :keys_end],
                key_sink[:, :keys_end],
                window,
                scaling,
                None if sinks_done is None else sinks_done[:, rows],
                into=(output[:, rows], lse[:, rows]),
            )
            if sinks is not None:  # else the kernel folded them in (or there are none)
                merge_into(output[:, rows], lse[:, rows], *sinks)
            del sinks
        for start, stop, keys_end in row_blocks(begin, end, first_query):
            rows = slice(start - begin, stop - begin)
            local = local_part(
                query[:, :, start:stop],
                key[:, :, :keys_end],
                value[:, :, :keys_end],
                None if key_valid is None else key_valid[:, :keys_end],
                query_groups[:, start:stop],
                key_groups[:, :keys_end],
                window,
                scaling,
                kernel,
                key_sink[:, :keys_end],
                None if sinks_done is None else sinks_done[:, rows],
                into=(output[:, rows], lse[:, rows]),
                scratch=scratch,
            )
            if local is not None:  # else the kernel folded it in
                merge_into(output[:, rows], lse[:, rows], *local)
            del local

    riders = key_sink if query_groups.shape[-1] == 1 else None  # top-1 queries read their sinks in the own-group pass
    block_rows = min(OWN_GROUP_ROWS, q_len)
    in_kernel = SegmentKeys.build(query, key, value, query_groups, key_groups, valid, riders, num_groups, block_rows)
    if in_kernel is None:
        output, lse, sinks_done = probe_part(
            query, key, value, valid, query_groups, key_groups, num_groups, scaling, kernel, key_sink
        )
        fold_window_band(output, lse, sinks_done, 0, q_len)
        return output.to(query.dtype)
    output = query.new_zeros(batch, q_len, heads, dim, dtype=torch.float32)
    block_lse = query.new_empty(batch, block_rows, heads, dtype=torch.float32)
    # The local part's calls read a block of queries and the window before it; the own-group pass's read slabs of one
    # segment.
    local_keys = min(STREAM_ROWS + window, key.shape[2])
    scratch = packing_scratch(key.dtype, key.shape[1], dim, (batch, local_keys, False), (1, SEGMENT_SLAB_KEYS, True))
    for start in range(0, q_len, block_rows):
        end = min(start + block_rows, q_len)
        lse = block_lse[:, : end - start].fill_(torch.finfo(torch.float32).min)
        sinks_done = in_kernel.fold(query, key, value, start, end, output[:, start:end], lse, scaling, scratch)
        fold_window_band(output[:, start:end], lse, sinks_done, start, end, scratch)
    return output.to(query.dtype)


def row_blocks(begin: int, end: int, first_query: int) -> Iterator[tuple[int, int, int]]:
    """(start, stop, keys_end) of each block of STREAM_ROWS of queries begin .. end - 1. Rows start .. stop - 1 see
    keys up to keys_end = first_query + stop only; the parts read kv_len - q_len as the first query's position, so
    slicing queries and keys alike is exact."""
    for start in range(begin, end, STREAM_ROWS):
        stop = min(start + STREAM_ROWS, end)
        yield start, stop, first_query + stop


def reachable_keys(
    query_groups: torch.Tensor, key_groups: torch.Tensor, key_sink: torch.Tensor, window: int
) -> torch.Tensor:
    """Bool [batch, kv]: the keys any of the call's queries (the last of the keys) may attend to - their probed
    groups, the window before the first of them, and the sinks. For one query this is exactly its row of the
    pattern (every key precedes it)."""
    kv_len, q_len = key_groups.shape[1], query_groups.shape[1]
    reachable = probes(query_groups.flatten(1).unsqueeze(1), key_groups)[:, 0] | key_sink
    reachable[:, max(kv_len - q_len - window, 0) :] = True
    return reachable


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_valid: Optional[torch.Tensor],
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    window: int,
    scaling: float,
    kernel: Kernel,
    grouped: Optional[list[GroupedKeys]] = None,
) -> torch.Tensor:
    """Few queries against many keys: gather the keys they can reach, then one masked call. [batch, q, heads, dim].

    One query (the common decoding step) sees exactly the keys it reaches, so it needs no pattern mask: only the
    trailing slots of samples that reach fewer keys than the batch's most are hidden. One sample with at most
    DIRECT_GATHER_MAX reachable keys (short and mid-length caches) takes the cheapest route: an index_select along
    the token axis and, on CPU, plain SDPA.

    With `grouped` (one query; a copy per sample), the distant keys come from the group-sorted copies
    (`grouped_decode`).
    """
    batch, _, q_len, _ = query.shape
    if grouped is not None and q_len == 1 and len(grouped) == batch:
        output = grouped_decode(
            query, key, value, key_valid, query_groups, key_groups, key_sink, window, scaling, grouped
        )
        if output is not None:
            return output
    key_groups, key_sink = waiting_keys(key_groups, key_sink, key.shape[2])
    kv_len, device = key.shape[2], query.device
    first_query = kv_len - q_len
    reachable = reachable_keys(query_groups, key_groups, key_sink, window)
    if key_valid is not None:
        reachable &= key_valid
    if batch == 1:
        index = reachable[0].nonzero().view(1, -1)
        count = None
        if index.shape[1] <= DIRECT_GATHER_MAX:
            keys = slot_buffer(key)[0].index_select(1, index[0])[None]
            values = slot_buffer(value)[0].index_select(1, index[0])[None]
            if q_len == 1 and device.type == "cpu":
                # The one query sees every gathered key; at this size unmasked SDPA beats the two matmuls.
                output = F.scaled_dot_product_attention(query, keys, values, scale=scaling, enable_gqa=True)
                return output.transpose(1, 2).contiguous()
        else:
            sample = torch.zeros(1, 1, dtype=torch.long, device=device)
            keys, values = gather_tokens(key, sample, index), gather_tokens(value, sample, index)
    else:
        count = reachable.sum(dim=1)
        length = int(count.max())
        slot = torch.where(reachable, reachable.cumsum(dim=1) - 1, length)
        index = torch.zeros(batch, length + 1, dtype=torch.long, device=device)
        index = index.scatter_(1, slot, torch.arange(kv_len, device=device).expand(batch, -1))[:, :length]
        sample = torch.arange(batch, device=device)[:, None]
        keys, values = gather_tokens(key, sample, index), gather_tokens(value, sample, index)
    if q_len == 1:
        visible = None if count is None else (torch.arange(index.shape[1], device=device) < count[:, None])[:, None]
    else:
        query_positions = torch.arange(first_query, kv_len, device=device)
        visible = allowed_pairs(
            query_groups, key_groups.gather(1, index), key_sink.gather(1, index), query_positions, index, window
        )
        if count is not None:
            visible &= (torch.arange(index.shape[1], device=device) < count[:, None]).unsqueeze(1)
    bias = None if visible is None else hidden_bias(visible.unsqueeze(1), query.dtype)
    if device.type == "cpu":
        output = few_query_attention(query, keys, values, bias, scaling)
    else:
        output, _ = kernel(query, keys, values, causal=False, bias=bias, scale=scaling)
    return output.transpose(1, 2).contiguous()


def grouped_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_valid: Optional[torch.Tensor],
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    window: int,
    scaling: float,
    grouped: list[GroupedKeys],
) -> Optional[torch.Tensor]:
    """One query per sample [batch, heads, 1, dim] over its window (a slice of the cache) and the distant keys of its
    probed groups and the sinks (slices of its sample's copy in `grouped`, first brought up to the keys now beyond
    the window): [batch, 1, heads, dim]. None where the copies cannot serve the step exactly (padding inside the
    window, a distant key not yet routed, a window grown since with `configure_adapter`); the caller then gathers."""
    kv_len = key.shape[2]
    first_window = kv_len - 1 - window  # keys before it are farther than the window
    if first_window <= 0 or key_groups.shape[1] < first_window or any(copy.filled > first_window for copy in grouped):
        return None
    if key_valid is not None and not bool(key_valid[:, first_window:].all()):
        return None
    outputs = []
    for sample, copy in enumerate(grouped):
        # One sample: its query [1, heads, 1, dim] as [heads, dim] is a view (a cheaper call than two indexings).
        rows = query.reshape(query.shape[1], query.shape[3]) if len(grouped) == 1 else query[sample, :, 0]
        if copy.filled == first_window - 1:  # as every step but the first: one position to take in, in one call
            output = copy.step(rows, key, value, sample, key_groups, key_sink, key_valid, query_groups, scaling)
        else:
            probes = list(dict.fromkeys(query_groups[sample, 0].tolist()))  # distinct, best first
            if min(probes) < 0:  # a query not routed yet (group -1): `pattern.probes` applies
                return None
            keys, values = key[sample], value[sample]
            sample_valid = None if key_valid is None else key_valid[sample]
            if not copy.extend(keys, values, key_groups[sample], key_sink[sample], sample_valid, first_window):
                return None
            output = copy.attend(rows, keys, values, first_window, probes, scaling)
        if output is None:
            return None
        outputs.append(output)
    if len(outputs) == 1:
        return outputs[0].view(1, 1, *outputs[0].shape)
    return torch.stack(outputs).unsqueeze(1)


def padding_keys(model_mask: Optional[torch.Tensor], batch: int) -> Optional[torch.Tensor]:
    """Bool [batch, kv]: the real keys of a causal + padding mask [batch or 1, 1, q, kv] (None: no mask). The last
    query follows every key, so its row hides exactly the padding keys."""
    return None if model_mask is None else model_mask[:, 0, -1, :].expand(batch, -1)


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    model_mask: Optional[torch.Tensor],
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    window: int,
    scaling: float,
    kernel: Kernel,
    num_groups: int,
    mask_is_padding: bool = True,
) -> torch.Tensor:
    """The exact pattern (and the model's own mask) as one dense masked call: [batch, q, heads, dim].

    With `mask_is_padding` (the model's mask hides no more than future and padding keys) and the CPU kernel of
    `native` at hand, a call of several queries evaluates the pattern from per-token group bits as it goes; else
    the pattern becomes a bias for torch's kernel (which reads it at a cost, after it is built)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len > 1 and (model_mask is None or mask_is_padding) and num_groups <= BITS_MAX_GROUPS:
        query_bits, key_bits = pattern_bits(query_groups, key_groups, key_sink)
        computed = prefill_attention(
            query,
            key,
            value,
            causal=True,
            scale=scaling,
            first=kv_len - q_len,
            query_bits=query_bits,
            key_bits=key_bits,
            key_valid=padding_keys(model_mask, query.shape[0]),
            window=window,
        )
        if computed is not None:
            return computed[0].transpose(1, 2).contiguous()
    if q_len == 1:
        # A decoding step: its row of the pattern takes a few passes over the keys, and SDPA reads a boolean mask
        # at almost no cost (a row without visible keys comes out 0, finite).
        visible = reachable_keys(query_groups, key_groups, key_sink, window)[:, None, None]
        if model_mask is not None:
            visible = visible & model_mask
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scaling, enable_gqa=True)
        return output.transpose(1, 2).contiguous()
    square = q_len == kv_len  # the kernel's causal flag then hides the future keys
    bias = pattern_bias(query_groups, key_groups, key_sink, window, num_groups, query.dtype, hide_future=not square)
    bias = bias[:, None]
    if model_mask is not None:
        bias = bias.masked_fill(~model_mask, torch.finfo(query.dtype).min)
    if query.device.type == "cpu" and q_len <= DECODE_MAX_QUERIES and q_len < kv_len:
        output = few_query_attention(query, key, value, bias, scaling)  # decoding: faster than the kernel
    else:
        # Square calls need the causal flag (`pattern_bias` leaves the pairs above the diagonal as they
        # fall); it also lets the kernel skip the blocks there.
        output, _ = kernel(query, key, value, causal=square, bias=bias, scale=scaling)
    return output.transpose(1, 2).contiguous()
