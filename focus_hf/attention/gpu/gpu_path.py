"""The GPU path: hard-mode Focus attention on CUDA's kernels, variable-length flash attention and FlexAttention.

The allowed pairs split as on the CPU path (`cpu_path`) into the own-group pass - the pairs whose key group is one the
query probes (local and sink pairs included) - and the window band - the other allowed pairs, within the window or
with a sink. Here each is one or a few calls of the kernels of `kernels`, with no n x n tensor anywhere:

- the own-group pass, own-group top-1 (every query probes its own key group only) in half precision: sorted by (sample,
  group, position), the tokens of one group of one sample are one sequence and the own-group pass is causal attention
  inside each - a variable-length flash call per run of heads (`fold_own_groups`; unrouted tokens, group -1, are one
  more group, each sample's padding one more sequence).
- the own-group pass, any other routing (top_k > 1, a separate query router, adaptive probes, float32): keys sorted by
  (group, position) per sample and query entries - one per probed group - by (probed group, position). An entry sees a
  prefix of its group's sorted keys, so a block of 128 sorted entries reads one range of sorted key blocks, which the
  sort's offsets give (`sorted_range_blocks`); key blocks that every entry of a one-group block sees whole are listed as
  full, read without a mask. One FlexAttention call per run of heads (`fold_probed_groups`).
- the window band, without a model's mask where the kernels run varlen in a dtype of float32's range: sliding-window
  flash calls over chunks of rows, the probed groups, sinks and padding hidden by indicator columns appended to the
  head dimension, and the sinks as a small product (`window`).
- the window band otherwise: in plain torch (`bands`), in token order: each block of 128 queries against the keys of its
  window and the sinks, keeping those whose group the query does not probe and real (not padding). A FlexAttention call
  here spent its time reading the pattern pair by pair in its mask (`bands`' docstring has the H200's figures).

The parts write into the call's result, allocated once in its final layout [batch, q, heads, dim], and a float32
log-sum-exp; each part after the first is merged by log-sum-exp (`merge_heads`), a row without visible keys weighing
0. Costs (n tokens, K groups, top_k probes, window w): the own-group pass ~ top_k n^2 / 2K pairs, the window band
~ n (w + 2 * 128) pairs. Memory beyond the inputs, the result and its log-sum-exp: each part's temporaries - sorted
keys, values and queries of a run of heads, packed chunks of rows - within `budget.temporary_bytes`, a share of the
result's size, and the block lists (one row per 128 queries) and per-token indices, small.

Nothing is read from the device during a call (no sync) where the caller says whether queries probe their own group
(`own_group`) and how many sinks there are (`sink_slots`), as a model's layer does: sequence lengths are bounded by the
call's, block lists brought into range on the device (`block_masks`), and every decision taken from shapes.

Exact by construction for every routing; what it assumes of the kernels is checked on each device by `verify`, which
`hard` asks before this path runs.
"""

from __future__ import annotations

from typing import Optional

import torch

from focus_hf.attention.gpu import budget
from focus_hf.attention.gpu.bands import band_attention
from focus_hf.attention.gpu.block_masks import BLOCK, BlockLists, blocks_of, run_lists
from focus_hf.attention.gpu.kernels import GpuKernels
from focus_hf.attention.gpu.merge import merge_heads
from focus_hf.attention.gpu.paged_keys import PagedKeys
from focus_hf.attention.gpu.pair_rule import NO_KEY, NO_QUERY, make_rule, padded, range_mask, rule_mask, token_rule
from focus_hf.attention.gpu.window import window_attention, window_dtype

# The parts of the pattern a call takes (`pair_rule`): (near pairs of unprobed groups, pairs of probed groups).
OWN_GROUP_PASS = (False, True)
WHOLE_PATTERN = (True, True)


def gpu_sparse_attention(
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
    kernels: GpuKernels,
    own_group: Optional[bool] = None,
    model_mask: Optional[torch.Tensor] = None,
    sink_slots: Optional[int] = None,
) -> torch.Tensor:
    """The own-group pass and the window band merged: [batch, q, heads, dim] in the query's dtype.

    Args:
        query: [batch, heads, q, dim], the last q of the kv tokens.
        key: [batch, kv_heads, kv, dim].
        value: [batch, kv_heads, kv, dim].
        key_valid: [batch, kv] False for padding keys, or None.
        query_groups: [batch, q, top_k] the groups each query probes (a slot repeating the first is not probed).
        key_groups: [batch, kv] each key's group (-1: not routed yet).
        key_sink: [batch, kv] whether each key is a sink.
        own_group: whether each query's first probe is its own key group (no separate query router); None: read
            from the groups (a device sync; never under torch.compile, where None counts as False).
        model_mask: a boolean mask [batch or 1, 1, q, kv] that may hide more than future and padding keys (a
            sliding window, packed documents), read pair by pair - by the window band's masks in torch and by the
            own-group pass's FlexAttention call, which it then takes whatever the routing; None: causal + `key_valid`.
        sink_slots: the most sinks any sample has (routing's `sink_tokens`), which sizes the window band's sink columns
            without reading the flags from the device (`bands.band_attention`); None: read.
    """
    batch, heads, q_len, dim = query.shape
    kv_len = key.shape[2]
    valid = key_valid
    if valid is None:
        valid = torch.ones(batch, kv_len, dtype=torch.bool, device=query.device)
    # The result in its final layout from the start: the parts write [batch, heads, q, dim] views of it.
    result = query.new_empty(batch, q_len, heads, dim)
    output = result.transpose(1, 2)
    lse = torch.empty(batch, heads, q_len, dtype=torch.float32, device=query.device)
    if model_mask is None and window_dtype(query.dtype) and kernels.runs_window(query.dtype):
        near = (query_groups, key_groups, key_sink, num_groups, window, scaling, kernels)
        window_attention(output, lse, query, key, value, valid, *near, sink_slots=sink_slots)
    else:
        near = (query_groups, key_groups, key_sink, window, scaling, model_mask)
        band_attention(output, lse, query, key, value, valid, *near, sink_slots=sink_slots)
    if own_group is None:
        own_group = not torch.compiler.is_compiling() and torch.equal(
            query_groups[..., 0], key_groups[:, kv_len - q_len :]
        )
    if own_group and model_mask is None and query_groups.shape[-1] == 1 and kernels.runs_varlen(query.dtype):
        fold_own_groups(output, lse, query, key, value, valid, key_groups, num_groups, scaling, kernels)
    else:
        routing = (valid, query_groups, key_groups, num_groups, scaling, kernels, model_mask)
        fold_probed_groups(output, lse, query, key, value, *routing)
    return result


def pattern_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_valid: Optional[torch.Tensor],
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    window: int,
    scaling: float,
    kernels: GpuKernels,
    model_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The whole pattern as one FlexAttention call over every causal key block, the rule evaluated as it goes (no
    bias, no n x n tensor): the GPU's "one dense masked call", which "auto" runs below its crossover. Key blocks
    that lie inside the window of every query of a query block are full (read without the rule). Returns [batch, q,
    heads, dim]. `model_mask`: as in `gpu_sparse_attention` (no block is then full)."""
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    valid = key_valid
    if valid is None:
        valid = torch.ones(batch, kv_len, dtype=torch.bool, device=query.device)
    rule = token_rule(valid, query_groups, key_groups, key_sink, window, q_len, WHOLE_PATTERN, model_mask)
    device = query.device
    kv_blocks = blocks_of(kv_len)
    first = (kv_len - q_len) + torch.arange(blocks_of(q_len), device=device) * BLOCK
    last = torch.clamp(first + BLOCK, max=kv_len) - 1
    # Full: every key of the block is at most `window` before the block's last query and not after its first query,
    # and no key of it is padding.
    full_start = torch.clamp(last - window + BLOCK - 1, min=0) // BLOCK
    full_end = torch.maximum(torch.clamp((first + 1) // BLOCK, max=kv_blocks), full_start)  # exclusive
    whole = padded(valid, 1, kv_blocks * BLOCK, False).view(batch, kv_blocks, BLOCK).all(dim=-1)
    slot = torch.arange(kv_blocks, device=device)
    in_full = (slot >= full_start[:, None]) & (slot < full_end[:, None])  # [q_blocks, kv_blocks]
    in_full = in_full[None] & whole[:, None, :] & (model_mask is None)
    causal = slot[None, :] <= (last // BLOCK)[:, None]
    partial = causal[None] & ~in_full
    # Listed in index order: a sort of each row puts the listed blocks first (a row per 128 queries, no n x n).
    order = torch.sort((~partial).to(torch.uint8), dim=-1, stable=True).indices
    full_order = torch.sort((~in_full).to(torch.uint8), dim=-1, stable=True).indices
    blocks = BlockLists(
        partial.sum(-1, dtype=torch.int32),
        order.to(torch.int32),
        in_full.sum(-1, dtype=torch.int32),
        full_order.to(torch.int32),
        rule_mask(rule),
        q_len,
        kv_len,
    )
    output, _ = kernels.flex(query, key, value, blocks, scaling)
    return output.transpose(1, 2).contiguous()


def decode_from_paged_keys(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_valid: Optional[torch.Tensor],
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    window: int,
    scaling: float,
    paged: PagedKeys,
    kernels: GpuKernels,
) -> torch.Tensor:
    """One query per sample [batch, heads, 1, dim] - the newest of key/value [batch, kv_heads, n, dim] - over its
    window, the sinks and its probed groups' distant keys: one FlexAttention call over the pages of `paged`, which the
    step first brings up to date (`PagedKeys.update`). Returns [batch, 1, heads, dim]."""
    paged.update(key, value, key_groups, key_sink, key_valid, window)
    blocks = paged.decode_blocks(query_groups[:, 0], key_groups, key_sink, key.shape[2])
    output, _ = kernels.flex(query, paged.keys, paged.values, blocks, scaling)
    return output.transpose(1, 2).contiguous()


def key_segments(valid: torch.Tensor, key_groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Each key's segment within its sample: its group, num_groups for a key not routed yet (group -1), and
    num_groups + 1 for padding."""
    routed = torch.where(key_groups >= 0, key_groups, num_groups)
    return torch.where(valid, routed, num_groups + 1)


def _counts(index: torch.Tensor, size: int) -> torch.Tensor:
    """How often each of 0 .. size - 1 occurs in `index` (bincount's, with a size known before the data: no sync,
    a static shape under torch.compile)."""
    return torch.zeros(size, dtype=torch.long, device=index.device).index_add_(0, index, torch.ones_like(index))


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    """int32 [N + 1] cumulative offsets of N sequence lengths."""
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int()


def head_runs(query: torch.Tensor, kv_heads: int, per_kv_head: int, per_query_head: int) -> tuple[int, int]:
    """(kv heads per run, query heads per run) of a part whose temporaries are `per_kv_head` bytes per kv head (its
    sorted keys and values) and `per_query_head` per query head: every head at once where they fit the call's
    `budget.temporary_bytes`, else one kv head at a time with as many of its query heads as fit and divide its query
    heads (runs of one size: a FlexAttention call compiles once per head shape) - at least one."""
    heads = query.shape[1]
    per_kv = heads // kv_heads
    limit = budget.temporary_bytes(query)
    if kv_heads * (per_kv_head + per_kv * per_query_head) <= limit:
        return kv_heads, heads
    fit = budget.runs_of(per_kv, per_query_head, limit, fixed=per_kv_head)
    return 1, max(size for size in range(1, fit + 1) if per_kv % size == 0)


def fold_own_groups(
    output: torch.Tensor,
    lse: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    key_groups: torch.Tensor,
    num_groups: int,
    scaling: float,
    kernels: GpuKernels,
) -> None:
    """The own-group pass of own-group top-1 routing as variable-length causal attention, one sequence per (sample,
    segment), folded into `output` and `lse`. Queries are the last q tokens of each sequence, as the kernel's
    bottom-right causal alignment needs. The kernel is given the call's lengths as bounds of its sequences' lengths
    (those are on the device, and reading them would be a sync). The heads go in runs whose sorted copies fit
    `budget.temporary_bytes` (`head_runs`)."""
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    per_kv = heads // kv_heads
    segments = num_groups + 2
    segment = key_segments(valid, key_groups, num_groups)
    segment = segment + torch.arange(batch, device=query.device)[:, None] * segments  # [batch, kv]
    code = segment * kv_len + torch.arange(kv_len, device=query.device)
    key_order = code.flatten().argsort()
    query_order = code[:, kv_len - q_len :].flatten().argsort()  # flat index sample * q + query
    key_counts = _counts(segment.flatten(), batch * segments)
    query_counts = _counts(segment[:, kv_len - q_len :].flatten(), batch * segments)
    sequences = (_offsets(query_counts), _offsets(key_counts), q_len, kv_len)
    unsort = torch.empty_like(query_order)
    unsort[query_order] = torch.arange(len(query_order), device=query.device)
    key_sample, key_token = key_order // kv_len, key_order % kv_len
    query_sample, query_token = query_order // q_len, query_order % q_len
    element = batch * dim * query.element_size()
    # Per kv head its sorted keys and values; per query head its sorted queries, the kernel's result (where the kernel
    # takes no GQA: assembled from one call per query head) and that result back in token order.
    kv_run, query_run = head_runs(query, kv_heads, 2 * kv_len * element, 3 * q_len * element)
    for first in range(0, kv_heads, kv_run):
        kv_slice = slice(first, min(first + kv_run, kv_heads))
        sorted_keys, sorted_values = key[key_sample, kv_slice, key_token], value[key_sample, kv_slice, key_token]
        for first_head in range(kv_slice.start * per_kv, kv_slice.stop * per_kv, query_run):
            heads_run = slice(first_head, min(first_head + query_run, kv_slice.stop * per_kv))
            sorted_queries = query[query_sample, heads_run, query_token]  # [Tq, heads of the run, dim]
            part, part_lse = kernels.varlen(sorted_queries, sorted_keys, sorted_values, *sequences, scaling)
            del sorted_queries
            part = part[unsort].view(batch, q_len, -1, dim).transpose(1, 2)
            part_lse = part_lse[unsort].view(batch, q_len, -1).transpose(1, 2)
            merge_heads(output, lse, heads_run, part, part_lse)
            del part, part_lse
        del sorted_keys, sorted_values


def sorted_range_blocks(
    first_key: torch.Tensor, end_key: torch.Tensor, groups: torch.Tensor, real_entries: torch.Tensor, kv_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block lists of the own-group pass in sorted order, from each sorted entry's key range [first_key, end_key) among
    the sorted keys and its segment `groups` ([batch, entries]; ranges non-decreasing along the entries), the first
    `real_entries` [batch] entries of each sample being real (the excluded ones sort last and see no key).

    A block of BLOCK entries reads the key blocks from its first entry's first key to its last real entry's end key.
    Where all its entries are real and of one group, the key blocks inside its first entry's range are full: every
    entry of the block sees them whole. Returns (kv_num_blocks, kv_indices, full_num_blocks, full_indices), int32."""
    batch, entries = groups.shape
    device = groups.device
    q_blocks, kv_blocks = blocks_of(entries), blocks_of(kv_len)
    start = (torch.arange(q_blocks, device=device) * BLOCK).expand(batch, -1)
    block_end = torch.clamp(start + BLOCK, max=entries)  # exclusive
    last_real = torch.minimum(block_end, real_entries[:, None]) - 1
    empty = last_real < start
    low, first_end = first_key.gather(1, start), end_key.gather(1, start)
    high = end_key.gather(1, last_real.clamp(min=0))
    start_block = low // BLOCK
    end_block = torch.where(empty, start_block, -(-high // BLOCK))
    one_group = (groups.gather(1, start) == groups.gather(1, block_end - 1)) & (last_real == block_end - 1)
    full_start, full_end = -(-low // BLOCK), first_end // BLOCK
    has_full = one_group & ~empty & (full_end > full_start)
    full_start = torch.where(has_full, full_start, start_block)
    full_end = torch.where(has_full, full_end, start_block)
    count, indices = run_lists([(start_block, full_start - start_block), (full_end, end_block - full_end)], kv_blocks)
    full_count, full_indices = run_lists([(full_start, full_end - full_start)], kv_blocks)
    return count, indices, full_count, full_indices


def fold_probed_groups(
    output: torch.Tensor,
    lse: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    num_groups: int,
    scaling: float,
    kernels: GpuKernels,
    model_mask: Optional[torch.Tensor] = None,
) -> None:
    """The own-group pass of any routing in one FlexAttention call over sorted keys and sorted query entries, folded
    into `output` and `lse` one probe slot at a time (a query's probed groups are distinct, so its entries' key sets are
    disjoint). `model_mask`: as in `gpu_sparse_attention` (no block is then full)."""
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    per_kv = heads // kv_heads
    offset, top_k, device = kv_len - q_len, query_groups.shape[-1], query.device
    entries = q_len * top_k
    excluded = num_groups + 2  # padding queries and slots that repeat the first probe: no entry
    segment = key_segments(valid, key_groups, num_groups)  # [batch, kv]
    key_code = segment * kv_len + torch.arange(kv_len, device=device)
    key_order = key_code.argsort(dim=1)
    sorted_code = key_code.gather(1, key_order)
    probe = torch.where(query_groups >= 0, query_groups, num_groups)
    unprobed = torch.zeros_like(query_groups, dtype=torch.bool)
    unprobed[..., 1:] = query_groups[..., 1:] == query_groups[..., :1]
    probe = torch.where(unprobed | ~valid[:, offset:, None], excluded, probe).reshape(batch, entries)
    entry_order = (probe * entries + torch.arange(entries, device=device)).argsort(dim=1)
    entry_group = probe.gather(1, entry_order)
    entry_position = offset + entry_order // top_k
    # Each entry's keys: its group's sorted keys up to its own position.
    first_key = torch.searchsorted(sorted_code, entry_group * kv_len)
    end_key = torch.searchsorted(sorted_code, entry_group * kv_len + entry_position, right=True)
    real = entry_group != excluded
    real_entries = real.sum(dim=1)
    count, indices, full_count, full_indices = sorted_range_blocks(
        first_key, end_key, entry_group, real_entries, kv_len
    )

    if model_mask is None:  # the pattern is the ranges themselves
        mask_mod = range_mask(first_key, end_key)
    else:  # read pair by pair, with the model's mask; which may hide pairs inside a full block
        sorted_valid = valid.gather(1, key_order)
        no_sinks = torch.zeros_like(sorted_valid)  # the own-group pass takes only probed pairs: sinks play no part
        rule = make_rule(
            (torch.where(real, entry_position, NO_QUERY), entry_order // top_k, entry_group[..., None]),
            (torch.where(sorted_valid, key_order, NO_KEY), segment.gather(1, key_order), no_sinks),
            0,
            OWN_GROUP_PASS,
            model_mask,
        )
        mask_mod = rule_mask(rule)
        full_count = torch.zeros_like(full_count)
    blocks = BlockLists(count, indices, full_count, full_indices, mask_mod, entries, kv_len)
    entry_token = entry_order // top_k
    unsort = torch.empty_like(entry_order)
    unsort.scatter_(1, entry_order, torch.arange(entries, device=device).expand(batch, -1))
    slots = unsort.view(batch, q_len, top_k)
    element = batch * dim * query.element_size()
    # Per kv head its sorted keys and values; per query head its entries' queries, then their result (top_k rows per
    # query) with one slot's in token order.
    per_query_head = (2 * entries + q_len) * element
    kv_run, query_run = head_runs(query, kv_heads, 2 * kv_len * element, per_query_head)
    # Advanced indexing, [batch, heads of a run, n, dim] and contiguous: torch's CPU `gather` allocates a temporary
    # twice the size of its result besides it, which the CPU's accounting of the path's memory would count.
    sample = torch.arange(batch, device=device)[:, None, None]
    kv_index, query_index = (torch.arange(count, device=device)[None, :, None] for count in (kv_run, query_run))
    key_order, entry_token = key_order[:, None], entry_token[:, None]
    for first in range(0, kv_heads, kv_run):
        sorted_keys, sorted_values = (states[sample, first + kv_index, key_order] for states in (key, value))
        for first_head in range(first * per_kv, (first + kv_run) * per_kv, query_run):
            heads_run = slice(first_head, first_head + query_run)
            entry_queries = query[sample, first_head + query_index, entry_token]
            part, part_lse = kernels.flex(entry_queries, sorted_keys, sorted_values, blocks, scaling)
            del entry_queries
            for slot in range(top_k):
                rows = slots[:, None, :, slot]  # [batch, 1, q]: where each query's entry of this slot lies
                slot_lse = part_lse.gather(2, rows.expand(batch, query_run, q_len))
                merge_heads(output, lse, heads_run, part[sample, query_index, rows], slot_lse)
            del part, part_lse
        del sorted_keys, sorted_values
