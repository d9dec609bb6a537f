"""The partial attentions the fast hard-mode path is made of, each over one disjoint set of keys.

Each returns an output and its log-sum-exp, so that `merge_into` folds them together exactly; `cpu_path` describes the
split. Hidden keys carry finfo.min rather than -inf: a partial without visible keys then has a log-sum-exp near
finfo.min, gets weight 0 in the merge and never produces a NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from focus_hf.attention.backends import Kernel
from focus_hf.attention.cpu.native_prefill import prefill_attention, sink_pairs
from focus_hf.attention.pattern import LOCAL_BITS_MAX_GROUPS, local_bits, pair_distance, probes

# Queries per block of the local part. Each query reads LOCAL_BLOCK + window keys, so smaller blocks waste less,
# but the kernel's per-block overhead grows; 32 was fastest at w=128 on CPU (16 to 128 tried).
LOCAL_BLOCK = 32


def hidden_bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive bias: 0 where visible, finfo.min (finite, so empty rows stay NaN-free) where hidden. One pass."""
    visible_value = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, visible_value, torch.finfo(dtype).min)


def few_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Optional[torch.Tensor], scale: float
) -> torch.Tensor:
    """Attention of a few queries [batch, heads, q, dim] over key/value [batch, kv_heads, L, dim] under a bias
    [batch or 1, 1, q, L] (None: every key visible), as two matmuls (softmax in float32): [batch, heads, q, dim],
    no log-sum-exp.

    On CPU this is about twice as fast as the flash kernel for one query (and faster than dense SDPA itself),
    which is what decoding runs."""
    batch, heads, q_len, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    per_kv = heads // kv_heads
    # Query heads kv * per_kv + j share kv head kv: fold them into the rows of one matmul per kv head.
    scores = torch.matmul(query.reshape(batch, kv_heads, per_kv * q_len, dim), key.transpose(-1, -2))
    scores = scores.view(batch, kv_heads, per_kv, q_len, length).float().mul_(scale)
    if bias is not None:
        scores = scores.add_(bias.view(bias.shape[0], 1, 1, q_len, length))
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(batch, kv_heads, per_kv * q_len, length)
    return torch.matmul(probs, value).view(batch, heads, q_len, dim)


def merge_into(output: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a partial over a disjoint key set (part [..., dim], part_lse [...]) into float32 `output` and `lse`, in
    place: o = o * exp(lse - total) + part * exp(part_lse - total), lse = total = logaddexp(lse, part_lse)."""
    total = torch.logaddexp(lse, part_lse.float())
    output.mul_(torch.exp(lse - total).unsqueeze(-1)).addcmul_(part, torch.exp(part_lse - total).unsqueeze(-1))
    lse.copy_(total)


def sink_slots(key_sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices [batch, S] of each sample's sink keys (S = most sinks in a sample) and which of them exist.

    From the sinks' coordinates alone, with no temporary as long as the keys (the sink pass of a long prefill runs
    this once per block of queries)."""
    batch = key_sink.shape[0]
    sample, position = key_sink.nonzero().unbind(1)  # row-major: each sample's sinks in position order
    count = torch.bincount(sample, minlength=batch)
    sinks = int(count.max()) if len(sample) else 0
    rank = torch.arange(len(sample), device=key_sink.device) - (count.cumsum(0) - count)[sample]
    index = torch.zeros(batch, sinks, dtype=torch.long, device=key_sink.device)
    index[sample, rank] = position
    return index, torch.arange(sinks, device=key_sink.device) < count[:, None]


def slot_buffer(states: torch.Tensor) -> torch.Tensor:
    """Head-major `states` [batch, heads, n, dim] or, when they are the first n slots of longer rows (a static KV
    cache's filled slots: `function.filled_slots`), those whole rows [batch, heads, slots, dim] - the same tokens at
    the same indices, but a tensor whose per-head rows are contiguous, so that a gather along the tokens does not
    first copy the whole cache (index_select does so with a non-contiguous input: 14 ms per step at 8K tokens)."""
    batch, heads, n, dim = states.shape
    if states.is_contiguous() or states.stride(3) != 1 or states.stride(2) != dim or states.stride(1) % dim:
        return states
    slots = states.stride(1) // dim
    end = states.storage_offset() + (batch - 1) * states.stride(0) + heads * states.stride(1)
    if slots <= n or end * states.element_size() > states.untyped_storage().nbytes():
        return states
    return states.as_strided((batch, heads, slots, dim), states.stride(), states.storage_offset())


def gather_tokens(states: torch.Tensor, sample: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """States [batch, heads, n, dim] of tokens `token` [R, L] in samples `sample` [R, 1] -> [R, heads, L, dim].

    One gather of contiguous rows: whole tokens when the states are token-major (fresh projections), per-head
    rows otherwise (a KV cache).
    """
    batch, heads, n, dim = states.shape
    rows, length = token.shape
    tokens = states.transpose(1, 2)
    if tokens.is_contiguous():
        # index_select of whole rows: about four times as fast as advanced indexing over (sample, token).
        flat = (sample * n + token).flatten()
        picked = tokens.reshape(batch * n, heads * dim).index_select(0, flat)
        return picked.view(rows, length, heads, dim).transpose(1, 2)
    if tokens.stride(3) == 1 and tokens.stride(2) == dim and tokens.stride(1) == heads * dim:
        picked = tokens.flatten(2)[sample, token]  # [R, L, heads * dim]
        return picked.view(rows, length, heads, dim).transpose(1, 2)
    states = slot_buffer(states)
    n = states.shape[2]
    if states.is_contiguous():
        # A head-major cache: one index_select of rows, about twice as fast as advanced indexing over two dims.
        head = torch.arange(heads, device=states.device)
        flat = ((sample * heads).unsqueeze(1) + head.view(1, heads, 1)) * n + token.unsqueeze(1)  # [R, heads, L]
        return states.view(batch * heads * n, dim).index_select(0, flat.flatten()).view(rows, heads, length, dim)
    return states.transpose(0, 1)[:, sample, token].transpose(0, 1)


def token_span(states: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Token-major [batch, length, heads, dim] states of positions start .. start + length - 1, zeros outside.

    A view when the span lies inside the states and they are token-major (fresh projections), else one copy.
    """
    tokens = states.transpose(1, 2)
    n = tokens.shape[1]
    if start >= 0 and start + length <= n and tokens.is_contiguous():
        return tokens[:, start : start + length]
    inside = tokens[:, max(start, 0) : start + length]
    return F.pad(inside, (0, 0, 0, 0, max(-start, 0), max(start + length - n, 0)))


def sliding_windows(tokens: torch.Tensor, size: int, step: int) -> torch.Tensor:
    """[batch, length, ...] -> [batch * windows, size, ...]: windows of `size` every `step` positions.

    A view when batch is 1 (overlapping windows share memory), else one copy.
    """
    windows = tokens.unfold(1, size, step)  # the window axis comes last
    return windows.movedim(-1, 2).flatten(0, 1)


def local_part(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_valid: Optional[torch.Tensor],
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    window: int,
    scaling: float,
    kernel: Kernel,
    key_sink: Optional[torch.Tensor] = None,
    sinks_done: Optional[torch.Tensor] = None,
    into: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    scratch: Optional[torch.Tensor] = None,
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The window band's local pairs: output [batch, q, heads, dim] and lse [batch, q, heads] over the keys at most
    `window` before each query whose group the query does not probe - and that are not sinks (`key_sink` [batch, kv])
    for the queries that `sinks_done` [batch, q] marks (their sink pairs rode in the own-group pass, `probe_part`).

    On CPU in float32 and bfloat16 the C kernel of `native` takes the whole part in one call, the rule evaluated from
    group bits (`pattern.local_bits`) as it goes, with no mask to build (the sparse path, K=8 top-1 at 4K tokens,
    alternating in one process: 63.4 -> 60.1 ms), and folds it straight into `into` (float32 output [batch, q, heads,
    dim] and lse [batch, q, heads] of the other parts), if given: it then returns None (`scratch`:
    `native_prefill.packing_scratch`, for the packed keys). Elsewhere queries go in blocks of LOCAL_BLOCK; block t reads
    the keys from `window` before its first query to its last, as overlapping strided views of the keys (no per-block
    copies), under a mask built here.
    """
    batch, heads, q_len, dim = query.shape
    kv_len, device = key.shape[2], query.device
    first_query = kv_len - q_len
    on_cpu = query.device.type == "cpu" and q_len > 0
    lo = max(first_query - window, 0)  # the first query's window: no query of the call reads a key before it
    # (max of a strided tensor copies it first: of the keys before `lo`, once per block of a long prefill)
    if on_cpu and max(int(query_groups.max()), int(key_groups[:, lo:].max())) < LOCAL_BITS_MAX_GROUPS:
        # Only the keys from the first query's window on (the kernel copies every key it is given).
        sinks = None if key_sink is None else key_sink[:, lo:]
        query_bits, key_bits = local_bits(query_groups, key_groups[:, lo:], sinks, sinks_done)
        computed = prefill_attention(
            query,
            key[:, :, lo:],
            value[:, :, lo:],
            causal=True,
            scale=scaling,
            first=first_query - lo,
            query_bits=query_bits,
            key_bits=key_bits,
            key_valid=None if key_valid is None else key_valid[:, lo:],
            window=window,
            local=True,
            into=None if into is None else (into[0].transpose(1, 2), into[1].transpose(1, 2)),
            scratch=scratch,
        )
        if computed is not None:
            return None if into is not None else (computed[0].transpose(1, 2), computed[1].transpose(1, 2))
    blocks = -(-q_len // LOCAL_BLOCK)
    span = blocks * LOCAL_BLOCK
    size = LOCAL_BLOCK + window
    queries = sliding_windows(token_span(query, 0, span), LOCAL_BLOCK, LOCAL_BLOCK)
    keys = sliding_windows(token_span(key, first_query - window, span + window), size, LOCAL_BLOCK)
    values = sliding_windows(token_span(value, first_query - window, span + window), size, LOCAL_BLOCK)

    # Query c of a block and its key x (both counted from the block's start) are i - j = window + c - x apart.
    offset = torch.arange(LOCAL_BLOCK, device=device)[:, None] - torch.arange(size, device=device) + window
    local = (offset >= 0) & (offset <= window)
    key_index = torch.arange(first_query - window, first_query + span, device=device)
    key_ok = (key_index >= 0) & (key_index < kv_len)
    key_index = key_index.clamp(0, kv_len - 1)
    key_ok = key_ok.expand(batch, -1) if key_valid is None else key_ok & key_valid[:, key_index]
    query_index = torch.arange(span, device=device).clamp(max=q_len - 1)  # the last block is padded with repeats
    block_groups = query_groups[:, query_index].view(batch, blocks, LOCAL_BLOCK, -1)
    window_groups = key_groups[:, key_index].unfold(1, size, LOCAL_BLOCK)  # [batch, blocks, size]
    visible = local & key_ok.unfold(1, size, LOCAL_BLOCK).unsqueeze(2) & ~probes(block_groups, window_groups)
    if sinks_done is not None and key_sink is not None:
        window_sinks = (key_sink[:, key_index] & key_ok).unfold(1, size, LOCAL_BLOCK)  # [batch, blocks, size]
        done = sinks_done[:, query_index].view(batch, blocks, LOCAL_BLOCK, 1)
        visible &= ~(window_sinks.unsqueeze(2) & done)
    output, lse = kernel(
        queries.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        causal=False,
        bias=hidden_bias(visible.flatten(0, 1).unsqueeze(1), query.dtype),
        scale=scaling,
    )
    output = output.transpose(1, 2).reshape(batch, span, heads, dim)[:, :q_len]
    lse = lse.transpose(1, 2).reshape(batch, span, heads)[:, :q_len]
    return output, lse


def sink_part(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    window: int,
    scaling: float,
    done: Optional[torch.Tensor] = None,
    into: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The window band's sink pairs: sinks farther than `window` whose group the query does not probe (and, `done`
    [batch, q] given, not for the queries it marks: `probe_part` included their sink pairs).

    On CPU in float32 and bfloat16 the C kernel of `native` folds them straight into `into` (float32 output [batch, q,
    heads, dim] and lse [batch, q, heads] of the other parts), if given, with nothing allocated per query (a 128K
    prefill held ~10 MiB more at top_k = 2 with the partial results below); it then returns None. Elsewhere: a handful
    of keys, two small matmuls instead of an attention kernel, whose per-row overhead would dominate. Every query head
    is scored against the sinks of every kv head (a kv_heads-fold waste on a tiny product) so that the token-major
    queries need no copy; the other kv heads' logits are hidden.

    Returns output [batch, q, heads, dim] and lse [batch, q, heads], or None without sinks or when folded.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len, device = key.shape[1], key.shape[2], query.device
    sink_index, sink_used = sink_slots(key_sink)
    sinks = sink_index.shape[1]
    if sinks == 0:
        return None
    if into is not None:
        position = torch.where(sink_used, sink_index, -1)
        group = key_groups.gather(1, sink_index)
        folded = (into[0].transpose(1, 2), into[1].transpose(1, 2))
        if sink_pairs(query, key, value, *folded, position, group, query_groups, done, window, scaling):
            return None
    distance = pair_distance(torch.arange(kv_len - q_len, kv_len, device=device), sink_index)  # [batch, q, sinks]
    visible = (distance > window) & sink_used[:, None, :] & ~probes(query_groups, key_groups.gather(1, sink_index))
    if done is not None:
        visible &= ~done[:, :, None]
    sample = torch.arange(batch, device=device)[:, None]
    sink_keys = gather_tokens(key, sample, sink_index).float() * scaling  # [batch, kv_heads, sinks, dim]
    sink_values = gather_tokens(value, sample, sink_index).float()
    queries = query.float().transpose(1, 2).reshape(batch, q_len * heads, dim)
    logits = queries @ sink_keys.flatten(1, 2).transpose(1, 2)  # [batch, q * heads, kv_heads * sinks]
    shape = (batch, q_len, kv_heads, heads // kv_heads, kv_heads, sinks)
    own = logits.view(shape).diagonal(dim1=2, dim2=4)  # [batch, q, heads per kv head, sinks, kv_heads]
    own = own.masked_fill(~visible[:, :, None, :, None], torch.finfo(torch.float32).min)
    lse = own.logsumexp(dim=3)  # [batch, q, heads per kv head, kv_heads]
    weights = torch.zeros_like(logits)
    weights.view(shape).diagonal(dim1=2, dim2=4).copy_(torch.exp(own - lse.unsqueeze(3)))
    output = (weights @ sink_values.flatten(1, 2)).view(batch, q_len, heads, dim)
    return output, lse.transpose(2, 3).reshape(batch, q_len, heads)


# Query slots per call of `probe_part`. A call reads its segment's keys up to its last query, and only the keys
# between its first and last query's reach are masked: smaller chunks waste fewer masked pairs on that staircase
# but pay the kernel's per-call overhead more often (128 / 256 / 512 measured at 8K on CPU: 256 was fastest).
PROBE_CHUNK = 256
# A chunk whose entries all see at least this many keys splits them into an unmasked call and the staircase
# (`chunk_attention`); CPU, K=8 top-1, one layer: 64K tokens 7.1-8.7 s -> 5.9 s for the own-group pass, while at 4K
# (every prefix shorter) the split alone made the own-group pass 45 -> 52 ms.
SPLIT_MIN_KEYS = 1024


# A causal chunk whose entries all see at most this many keys before its square runs them in the square's call
# behind as many stand-in query rows (`probe_part`), instead of a second call for them.
LEAD_MAX_KEYS = 16


# Query entries per call in a segment of at least 2 * CAUSAL_CHUNK entries that are its newest keys
# (`consecutive_segments`); shorter ones go in chunks of PROBE_CHUNK. The CPU kernel's causal calls cost 26 / 31 /
# 23 / 19 us per thousand pairs at 256 / 512 / 1K / 2K rows, and the folded prefix calls gain from more rows too: set
# A, K=8 top-1, CPU, chunks of 256 / 1,024 (before: staircases of 256): 4K 36 / 43 (36) ms, 8K 103 / 108 (107) ms,
# 32K 1.35 / 1.25 (1.45) s, 64K 5.0 / 4.6 (5.0) s. The cap bounds one call's query copy and result.
CAUSAL_CHUNK = 1024


def consecutive_segments(reach: torch.Tensor, starts: list[int]) -> list[bool]:
    """Per segment (sorted entries starts[s] .. starts[s + 1] - 1): whether each entry reaches one key more than the
    one before and the first reaches at least one, i.e. the entries are the segment's newest keys, so that a chunk
    of them sees a prefix that all its entries share plus a causal square (own-group routing, top_k = 1)."""
    bounds = [(start, end - 1) for start, end in zip(starts[:-1], starts[1:]) if end > start]
    if not bounds:
        return [False] * (len(starts) - 1)
    jumps = torch.cat([reach.new_zeros(1), (reach.diff() != 1).cumsum(0)])  # non-unit steps up to each entry
    index = torch.tensor(bounds, dtype=torch.long, device=reach.device)
    first_jumps, last_jumps, first_reach = torch.stack([jumps[index[:, 0]], jumps[index[:, 1]], reach[index[:, 0]]])
    flags = iter(((first_jumps == last_jumps) & (first_reach >= 1)).tolist())
    return [next(flags) if end > start else False for start, end in zip(starts[:-1], starts[1:])]


@dataclass
class SortedTokens:
    """Entries of tokens sorted by segment (sample * K + group), then position, with the segments' bounds.

    A token has m entries (m = 1 for keys, top_k for queries: one per probed group).

    Attributes:
        flat: [count] index ((sample * n + token) * m + entry) of each sorted entry.
        code: [count] its sort key, (sample * K + group) * kv_len + kv position (increasing).
        starts: K * batch + 1 offsets: segment s holds sorted entries starts[s] .. starts[s + 1] - 1.
        entries: m.
    """

    flat: torch.Tensor
    code: torch.Tensor
    starts: list[int]
    entries: int

    @classmethod
    def build(
        cls, groups: torch.Tensor, include: torch.Tensor, num_groups: int, first_position: int, kv_len: int
    ) -> "SortedTokens":
        """Sort the included entries of `groups` [batch, n, m] (`include`: [batch, n] per token or [batch, n, m]
        per entry); the tokens' kv positions start at `first_position`."""
        batch, n, m = groups.shape
        if include.dim() == 2:
            include = include[..., None].expand(-1, -1, m)
        # Only the included entries' segments are built and sorted (stably, so each stays in position order): a
        # sort of segment ids rather than of full codes holds fewer n-long temporaries (peak memory at 128K tokens).
        flat = include.flatten().nonzero().squeeze(1)
        segment = groups.flatten()[flat].long().add_(flat // (n * m) * num_groups)
        segment, order = segment.sort(stable=True)
        flat = flat[order]
        del order
        counts = torch.bincount(segment, minlength=batch * num_groups)
        starts = [0] + counts.cumsum(0).tolist()
        code = segment.mul_(kv_len).add_(flat // m % n + first_position)
        return cls(flat, code, starts, m)

    def gather(
        self, states: torch.Tensor, start: int = 0, end: Optional[int] = None, before: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """States [batch, heads, n, dim] of the tokens of sorted entries start .. end - 1: [1, heads, count, dim],
        after those of the tokens `before` (flat sample * n + token indices), if given, in one gather."""
        n = states.shape[2]
        token = self.flat[start:end] // self.entries
        if before is not None:
            token = torch.cat([before, token])
        return gather_tokens(states, (token // n)[None], (token % n)[None])


def folded_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: Optional[torch.Tensor],
    scaling: float,
    kernel: Kernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A non-causal call of query entries [1, heads, c, dim] over keys [1, kv_heads, S, dim] (`visible` [c, S] or
    None: all), with the query heads that share a kv head folded into the query axis, so that the kernel loads each
    key block once per kv head instead of once per query head (1.4x faster per pair at 8K keys on CPU; exact,
    since no row's mask depends on its head). Float32 output [1, heads, c, dim] and lse [1, heads, c]."""
    _, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    per_kv = heads // kv_heads
    folded = query.reshape(1, kv_heads, per_kv * length, dim)  # row p * length + r: head kv * per_kv + p, entry r
    bias = None
    if visible is not None:
        bias = hidden_bias(visible, query.dtype).repeat(per_kv, 1)[None, None]  # the same rows for every head
    output, lse = kernel(folded, key, value, causal=False, bias=bias, scale=scaling)
    return output.float().reshape(1, heads, length, dim), lse.float().reshape(1, heads, length)


def chunk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    reach: torch.Tensor,
    first_reach: int,
    last_reach: int,
    consecutive: bool,
    scaling: float,
    kernel: Kernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the own-group pass: query entries [1, heads, c, dim] over the first `reach` [c] (non-decreasing,
    from
    first_reach to last_reach) of their segment's keys [1, kv_heads, S, dim]. Float32 output [1, heads, c, dim] and
    lse [1, heads, c].

    `consecutive` (each entry reaches one key more than the one before, first_reach >= 1: the entries are the
    segment's own newest keys, as with own-group routing at top_k = 1): the last c keys are a causal square, run
    unmasked with the kernel's causal flag, and the keys before them, seen by every entry, go in one folded call.
    Otherwise, past SPLIT_MIN_KEYS keys seen by every entry (before first_reach), those go in one folded unmasked
    call and only the staircase between the first and last entry's reach in a masked one (merged by log-sum-exp),
    so the mask covers c x (last - first reach) pairs rather than the whole prefix (at 64K tokens, 256 x 256
    instead of 256 x 8,192 per chunk). Below, the second call costs more than it saves: one masked call.
    """
    if consecutive:
        square = first_reach - 1
        output, lse = kernel(
            query, key[:, :, square:last_reach], value[:, :, square:last_reach], causal=True, bias=None, scale=scaling
        )
        output, lse = output.float(), lse.float()
        if square:
            merge_into(
                output, lse, *folded_attention(query, key[:, :, :square], value[:, :, :square], None, scaling, kernel)
            )
        return output, lse
    if first_reach < SPLIT_MIN_KEYS:  # a short prefix: one call over every key reached, masked on the staircase
        return staircase_attention(query, key, value, reach, 0, last_reach, scaling, kernel)
    output, lse = folded_attention(query, key[:, :, :first_reach], value[:, :, :first_reach], None, scaling, kernel)
    if first_reach < last_reach:
        staircase = staircase_attention(query, key, value, reach, first_reach, last_reach, scaling, kernel)
        merge_into(output, lse, *staircase)
    return output, lse


def staircase_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    reach: torch.Tensor,
    begin: int,
    end: int,
    scaling: float,
    kernel: Kernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query entries [1, heads, c, dim] over keys begin .. end - 1 of [1, kv_heads, S, dim], entry r seeing those
    before reach[r] (non-decreasing): the staircase as a mask (for every key when begin is 0, folded with the query
    heads otherwise). Float32 output and lse. (On CPU in float32 and bfloat16 the C kernel takes all of the own-group
    pass, `segments.SegmentKeys`, so this path serves other devices and dtypes.)"""
    keys, values = key[:, :, begin:end], value[:, :, begin:end]
    visible = None
    if reach[0] < end:
        visible = torch.arange(begin, end, device=query.device) < reach[:, None]
    if begin:
        return folded_attention(query, keys, values, visible, scaling, kernel)
    bias = None if visible is None else hidden_bias(visible[None, None], query.dtype)
    output, lse = kernel(query, keys, values, causal=False, bias=bias, scale=scaling)
    return output.float(), lse.float()


def probe_part(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_valid: torch.Tensor,
    probe_groups: torch.Tensor,
    key_groups: torch.Tensor,
    num_groups: int,
    scaling: float,
    kernel: Kernel,
    key_sink: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The own-group pass: every pair (i, j), j <= i, whose key group is one of the groups query i probes.

    Keys are sorted by their own group and query entries (one per probed group) by the group they probe, each in
    position order, so that a segment (sample, group) is one contiguous run of keys and one of query entries, and
    an entry sees a prefix of its segment's keys. Each segment's entries go in chunks of PROBE_CHUNK, one call per
    chunk over the keys its last entry reaches; only the keys beyond its first entry's reach are masked. When a
    segment's entries are its own newest keys (own-group routing at top_k = 1), each chunk is instead a causal
    square plus the prefix all its entries see, with no mask at all (`chunk_attention`). Segments are not padded to
    each other: query routers are often far from balanced (a layer may send every query to one group), and padding
    would multiply the work by the imbalance. A query's entries are merged by log-sum-exp (its probed groups are
    distinct, so their key sets are disjoint). Chunks also beat one causal call per segment on CPU, whose kernel
    runs short causal calls at up to half its speed per pair.

    Sinks ride along at top_k = 1 (`key_sink` given): a segment's keys are gathered with the sample's sinks of other
    groups in front, and a chunk whose entries all lie past those sinks sees them as the first keys of its prefix
    (unmasked) - all the window band's sink pairs of its queries, near or far (`sink_riders`; `local_part` then leaves
    the sinks out of their window), at the cost of a few more keys per call instead of a separate pass over every query
    (`sink_part`, memory-bound: 12 of 69 ms at 4K tokens, CPU, K=8 top-1).

    On CPU in float32 and bfloat16 the C kernel takes the own-group pass instead (`segments.SegmentKeys`, which
    `cpu_path.sparse_attention` chooses): the chunks, gathers and merges here are the path of other devices and dtypes
    (K=8, 4K / 16K tokens, alternating in one process: top-1 52 -> 42 ms / 380 -> 334 ms, top-2 81 -> 66 ms / 813 -> 591
    ms).

    Args:
        probe_groups: [batch, q, top_k] the groups each query probes (the queries are the last q keys): distinct,
            except that a slot repeating the first group is not probed (`routing.probed_groups`).
        key_groups: [batch, kv] each key's own group.
        key_valid: [batch, kv] False for padding keys (padding queries get an empty set).
        key_sink: [batch, kv] the sink keys, or None: no sink rides along.

    Returns:
        float32 output [batch, q, heads, dim], lse [batch, q, heads], and bool [batch, q] marking the queries whose
        sink pairs (the window band's) are already included, or None when none are.
    """
    batch, heads, q_len, dim = query.shape
    kv_len, device = key.shape[2], query.device
    first_query = kv_len - q_len
    top_k = probe_groups.shape[-1]
    keys = SortedTokens.build(key_groups[..., None], key_valid, num_groups, 0, kv_len)
    query_valid = key_valid[:, first_query:]
    if top_k > 1:  # a slot that repeats the query's first group is not probed (adaptive probing): no entry
        probed = probe_groups != probe_groups[..., :1]
        probed[..., 0] = True
        query_valid = query_valid[..., None] & probed
    queries = SortedTokens.build(probe_groups, query_valid, num_groups, first_query, kv_len)
    # Keys of the entry's segment at or before it: codes share the segment prefix, so one search finds them.
    segment_start = torch.tensor(keys.starts[:-1], device=device)
    reach = torch.searchsorted(keys.code, queries.code, right=True)
    reach -= segment_start[queries.code // kv_len]
    riders: list[Optional[SinkRiders]] = [None] * (batch * num_groups)
    if top_k == 1 and key_sink is not None:
        riders = sink_riders(key_sink, key_groups, queries, num_groups)
    output = query.new_zeros(batch * q_len, heads, dim, dtype=torch.float32)
    lse = query.new_full((batch * q_len, heads), torch.finfo(torch.float32).min, dtype=torch.float32)
    sinks_done = torch.zeros(batch * q_len, dtype=torch.bool, device=device)
    consecutive = consecutive_segments(reach, queries.starts)
    chunks = []  # (segment, first entry, end, consecutive, sinks ride)
    for segment, causal in enumerate(consecutive):
        first, last = queries.starts[segment], queries.starts[segment + 1]
        size = CAUSAL_CHUNK if causal and last - first >= 2 * CAUSAL_CHUNK else PROBE_CHUNK
        rider = riders[segment]
        split = first if rider is None else rider.split  # entries from split on read the riding sinks
        for begin, stop, step, ride in (first, split, PROBE_CHUNK, False), (split, last, size, rider is not None):
            chunks += [(segment, start, min(start + step, stop), causal, ride) for start in range(begin, stop, step)]
    # The host needs only each chunk's first and last reach (a list of every entry's would be ~36 bytes per entry).
    ends = torch.tensor([[start, end - 1] for _, start, end, _, _ in chunks], dtype=torch.long, device=device)
    chunk_reach = reach[ends.view(-1)].view(-1, 2).tolist()
    # Results go straight to their queries' rows: a query's entries lie in distinct segments (its probed groups are
    # distinct), so a chunk holds at most one entry per query and, with top_k > 1, each is folded into what the
    # query's earlier segments left. Rows without keys (padding queries, queries before their segment's first key)
    # keep an empty set. Queries are gathered per chunk and keys per segment, so that no sorted copy of all queries,
    # keys or results is held at once (memory).
    keys_of = None
    for (segment, start, end, causal, ride), (first_reach, last_reach) in zip(chunks, chunk_reach):
        if last_reach == 0:  # no key of this segment is old enough yet: an empty set
            continue
        if keys_of != segment:
            keys_of, segment_keys, segment_values = segment, None, None  # the last segment's freed first
            sinks = None if riders[segment] is None else riders[segment].tokens
            bounds = (keys.starts[segment], keys.starts[segment + 1])
            segment_keys = keys.gather(key, *bounds, before=sinks)
            segment_values = keys.gather(value, *bounds, before=sinks)
        extra = 0 if sinks is None else len(sinks)  # the sinks in front, read only by chunks where they ride
        shift = extra if ride else 0
        # A causal chunk whose prefix is a few keys (the riding sinks, and the segment's first keys where its
        # first entries are sinks themselves) runs as one causal call: as many stand-in query rows in front make
        # the prefix and the square one square, instead of a second call for the prefix alone.
        lead = first_reach + shift - 1 if causal and first_reach + shift - 1 <= LEAD_MAX_KEYS else 0
        stand_ins = (queries.flat[start : start + 1] // top_k).expand(lead) if lead else None
        part, part_lse = chunk_attention(
            queries.gather(query, start, end, before=stand_ins),
            segment_keys[:, :, extra - shift :],
            segment_values[:, :, extra - shift :],
            reach[start:end] + shift,
            first_reach + shift - lead,
            last_reach + shift,
            causal,
            scaling,
            kernel,
        )
        part, part_lse = part[:, :, lead:], part_lse[:, :, lead:]
        rows = queries.flat[start:end] // top_k
        if ride:
            sinks_done.index_fill_(0, rows, True)
        part, part_lse = part[0].transpose(0, 1), part_lse[0].transpose(0, 1)
        if top_k > 1:
            row_output, row_lse = output.index_select(0, rows), lse.index_select(0, rows)
            merge_into(row_output, row_lse, part, part_lse)
            part, part_lse = row_output, row_lse
        output.index_copy_(0, rows, part)
        lse.index_copy_(0, rows, part_lse)
    done = None if all(rider is None for rider in riders) else sinks_done.view(batch, q_len)
    return output.view(batch, q_len, heads, dim), lse.view(batch, q_len, heads), done


@dataclass
class SinkRiders:
    """A segment's sinks that ride along: `tokens` the flat indices (sample * kv + token) of the sample's sinks in
    other groups, gathered in front of the segment's keys (None: there are none), and `split` the first entry that
    lies after every sink of the sample (entries from there on read them)."""

    tokens: Optional[torch.Tensor]
    split: int


def sink_riders(
    key_sink: torch.Tensor, key_groups: torch.Tensor, entries: SortedTokens, num_groups: int
) -> list[SinkRiders]:
    """Per segment (sample * K + group) of top-1 query entries: how the sink pairs of its queries ride in its
    chunks. A top-1 query probes one group, so every sink of another group before it is one of its window band pairs,
    near or far: the entries after the sample's last sink read all of them in front of their segment's keys (the
    local part then leaves the sinks out of their window), the few before it leave theirs to the window band."""
    kv_len, device = key_groups.shape[1], key_groups.device
    sink_index, sink_used = sink_slots(key_sink)
    none = torch.full((key_sink.shape[0], 1), -1, device=device)  # no sink: every entry is past it
    last_sink = torch.cat([torch.where(sink_used, sink_index, none), none], dim=1).amax(dim=1)
    segments = torch.arange(len(entries.starts) - 1, device=device)
    # The first entry of each segment with position > last sink: codes are segment * kv + position.
    thresholds = segments * kv_len + last_sink[segments // num_groups] + 1
    splits = torch.searchsorted(entries.code, thresholds).tolist()
    sinks = [
        [(token, group) for token, group, used in zip(*row) if used]
        for row in zip(sink_index.tolist(), key_groups.gather(1, sink_index).tolist(), sink_used.tolist())
    ]
    riders = []
    for segment in range(len(entries.starts) - 1):
        sample, group = divmod(segment, num_groups)
        tokens = [sample * kv_len + token for token, sink_group in sinks[sample] if sink_group != group]
        first, last = entries.starts[segment], entries.starts[segment + 1]
        split = min(max(splits[segment], first), last)
        riders.append(SinkRiders(torch.tensor(tokens, device=device) if tokens else None, split))
    return riders
