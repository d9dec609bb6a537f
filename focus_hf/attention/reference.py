"""Dense masked attention: the plain O(n^2) oracle every faster path is checked against, and the same attention run in
chunks of queries, whose memory grows with chunk x kv instead of q x kv (the reference and fallback path)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from focus_hf.attention.pattern import causal_positions, pattern_bias, soft_gate

# Bytes of one chunk's float32 scores over all heads (`chunked_attention`); a chunk holds about three times this at
# its peak (the scores, the weights, one head's bias). On the CPU a chunk's buffers stay below glibc's largest mmap
# threshold (32 MiB), so malloc hands the same memory to chunk after chunk: larger buffers are mapped afresh each
# time, and faulting their pages in cost 12x the pass that fills them (256 MiB: 214 ms, 18 ms once reused).
# Elsewhere the caching allocator reuses memory anyway, and bigger chunks mean fewer kernel launches.
CPU_CHUNK_BYTES = 16 << 20
DEVICE_CHUNK_BYTES = 512 << 20

HIDDEN = torch.finfo(torch.float32).min  # the bias of a hidden pair: any score plus this rounds to it

ChunkBias = Callable[[slice, int], torch.Tensor]
"""`bias(rows, keys)`: the additive float32 bias of the query rows `rows` over the first `keys` keys, broadcastable
to [batch, heads, rows, keys]: 0 (or soft mode's gate) where a pair may attend, `HIDDEN` where it may not. A hidden
pair gets weight exactly 0, as under `dense_attention`'s mask, for one pass over one head's pairs, where a masked fill
of every head's scores costs several."""


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: Optional[torch.Tensor],
    *,
    scaling: float,
    bias: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    dropout: float = 0.0,
    return_weights: bool = False,
):
    """Attention over explicitly allowed pairs.

    Args:
        query: [batch, heads, q, head_dim].
        key, value: [batch, kv_heads, kv, head_dim]; heads must be a multiple of kv_heads (GQA: query head h
            reads kv head h // (heads // kv_heads), as in transformers' `repeat_kv`).
        allowed: bool [batch, 1 or heads, q, kv], or None for "everything".
        scaling: multiplier of q.k.
        bias: optional additive float term on the logits, broadcastable to [batch, heads, q, kv].
        softcap: optional logit soft-capping (Gemma 2): tanh(s / cap) * cap before the bias.
        dropout: dropout probability on the attention weights.
        return_weights: also return the attention weights [batch, heads, q, kv] (`output_attentions=True`).

    Returns:
        [batch, q, heads, head_dim] (and the weights with `return_weights`). A query with no allowed key gets a
        uniform average (finite, meaningless): such rows only occur at padding positions.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    # The query heads of one kv head side by side as one matrix [batch, kv_heads, repeats * q, dim]: one product per
    # kv head reads its keys in place, where repeating them for each query head would copy every key (and value).
    # Memory order is the same, so the scores view as [batch, heads, q, kv] for free.
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * q_len, dim)
    # In place where autograd allows (not on tanh's output, which its backward pass reads): each copy of the scores
    # would cost a pass over them and as much memory again.
    scores = (grouped @ key.transpose(-1, -2)).view(batch, heads, q_len, kv_len).float().mul_(scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores.add_(bias)
    if allowed is not None:
        scores = scores.masked_fill_(~allowed, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    if dropout > 0.0:
        weights = F.dropout(weights, p=dropout, training=True)
    output = (weights.reshape(batch, kv_heads, -1, kv_len) @ value).view(batch, heads, q_len, value.shape[-1])
    output = output.transpose(1, 2).contiguous()
    return (output, weights) if return_weights else output


def chunked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: ChunkBias,
    *,
    scaling: float,
    softcap: Optional[float] = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    budget: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`dense_attention` chunk by chunk of queries, each chunk's pairs made by `bias` when it runs: memory grows with
    chunk x kv, not q x kv, so a long call is slow but fits.

    The queries are the last q of the keys (query i is key kv - q + i) and see no later key - every caller's mask
    is causal - so a chunk reads only the keys up to its last query, which also halves the work of a prefill.

    Args:
        query: [batch, heads, q, head_dim].
        key, value: [batch, kv_heads, kv, head_dim] (GQA as in `dense_attention`).
        bias: each chunk's pairs as an additive bias (`ChunkBias`): `causal_bias`, `hard_bias` or `soft_bias`.
        scaling, softcap, dropout: as in `dense_attention`.
        return_weights: also return the attention weights [batch, heads, q, kv] (`output_attentions=True`): these
            are q x kv by nature (0 on the keys after each chunk, which it does not read).
        budget: bytes of one chunk's float32 scores over all heads; None: `CPU_CHUNK_BYTES` on the CPU,
            `DEVICE_CHUNK_BYTES` elsewhere. At least one query row runs at a time.

    Returns:
        ([batch, q, heads, head_dim], the weights or None), as transformers' attention functions return them. A real
        query's output is the same as with the whole call at once; a query with no allowed key gets a uniform average
        over the keys its chunk reads (finite, meaningless: such rows only occur at padding positions).
    """
    batch, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    if budget is None:
        budget = CPU_CHUNK_BYTES if query.device.type == "cpu" else DEVICE_CHUNK_BYTES
    rows = max(1, budget // (batch * heads * kv_len * 4))
    # Contiguous once: the products then read each chunk's keys as a view, where strided keys (transformers hands
    # transposed ones) would be copied for every chunk.
    key, value = key.contiguous(), value.contiguous()
    # With gradients, autograd would keep every chunk's scores and weights for the backward pass (q x kv again):
    # each chunk is recomputed in the backward pass instead. Not only the states: the bias may carry
    # gradients (soft mode's gate, whose routers train on a frozen model). A call of one chunk keeps the plain graph.
    recompute = rows < q_len and torch.is_grad_enabled()

    def attend(chunk: slice, keys: int):
        return dense_attention(
            query[:, :, chunk],
            key[:, :, :keys],
            value[:, :, :keys],
            None,
            scaling=scaling,
            bias=bias(chunk, keys),
            softcap=softcap,
            dropout=dropout,
            return_weights=True,
        )

    # Written in place into tensors made once: each chunk's buffers are a little larger than the last one's, and a
    # small output kept between them would pin the heap, so that no freed buffer fits the next (the peak then grew
    # by 0.7-1.5 GiB over one 32K call on the CPU).
    output = value.new_empty(batch, q_len, heads, value.shape[-1])
    weights = value.new_zeros(batch, heads, q_len, kv_len) if return_weights else None
    for start in range(0, q_len, rows):
        chunk = slice(start, min(start + rows, q_len))
        keys = kv_len - q_len + chunk.stop
        if recompute:  # the bias's own terms (soft mode's gate) are recomputed with the chunk
            chunk_output, chunk_weights = checkpoint(attend, chunk, keys, use_reentrant=False)
        else:
            chunk_output, chunk_weights = attend(chunk, keys)
        output[:, chunk] = chunk_output
        if weights is not None:
            weights[:, :, chunk, :keys] = chunk_weights
        del chunk_weights  # one chunk's weights live at a time
    return output, weights


def causal_bias(model_mask: Optional[torch.Tensor], q_len: int, kv_len: int, device: torch.device) -> ChunkBias:
    """Chunk bias of plain causal attention and the model's mask (bool [batch or 1, 1, q, kv], True = may attend, or
    None), for a call whose queries are the last `q_len` of its `kv_len` keys."""

    def bias(rows: slice, keys: int) -> torch.Tensor:
        visible = torch.zeros(1, 1, rows.stop - rows.start, keys, device=device)
        return _hide(visible, rows, keys, model_mask)

    return bias


def hard_bias(
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    window: int,
    model_mask: Optional[torch.Tensor],
) -> ChunkBias:
    """Chunk bias of the hard Focus pattern (`pattern.pattern_bias`, the pairs of `pattern.allowed_pairs`, causality
    included) and the model's mask.

    Args:
        query_groups: [batch, q, top_k] groups each query probes; the queries are the last q of the keys.
        key_groups: [batch, kv] each key's group.
        key_sink: [batch, kv] whether each key is a sink.
        window: local window w.
        model_mask: bool [batch or 1, 1, q, kv] (True = may attend), or None.
    """
    # `pattern_bias` reads the pattern from a table with a column per group: the groups present are enough.
    num_groups = int(torch.maximum(query_groups.max(), key_groups.max()).clamp_min(0)) + 1

    def bias(rows: slice, keys: int) -> torch.Tensor:
        query_part = query_groups[:, rows]
        pattern = pattern_bias(query_part, key_groups[:, :keys], key_sink[:, :keys], window, num_groups, torch.float32)
        return _hide(pattern[:, None], rows, keys, model_mask, future=False)  # the pattern hides the future itself

    return bias


def soft_bias(
    query_probs: torch.Tensor,
    key_probs: torch.Tensor,
    key_sink: torch.Tensor,
    window: int,
    floor: float,
    model_mask: Optional[torch.Tensor],
) -> ChunkBias:
    """Chunk bias of soft mode: the soft gate (`pattern.soft_gate`), differentiable in the probabilities, on causal
    pairs the model's mask allows.

    Args:
        query_probs: [batch, q, groups] each query's probe probabilities; the queries are the last q of the keys.
        key_probs: [batch, kv, groups] each key's group probabilities.
        key_sink: [batch, kv] whether each key is a sink.
        window: local window w.
        floor: smallest same-group probability (the gate's floor).
        model_mask: bool [batch or 1, 1, q, kv] (True = may attend), or None.
    """
    query_positions, key_positions = causal_positions(query_probs.shape[1], key_probs.shape[1], key_probs.device)

    def bias(rows: slice, keys: int) -> torch.Tensor:
        gate = soft_gate(
            query_probs[:, rows],
            key_probs[:, :keys],
            key_sink[:, :keys],
            query_positions[rows],
            key_positions[:keys],
            window,
            floor,
        )
        return _hide(gate[:, None], rows, keys, model_mask)

    return bias


def _hide(
    bias: torch.Tensor, rows: slice, keys: int, model_mask: Optional[torch.Tensor], future: bool = True
) -> torch.Tensor:
    """`bias` [batch or 1, 1, rows, keys] of query rows that are the last of the `keys` keys, with `HIDDEN` on the
    pairs the model's mask hides and (with `future`) on keys after the query. In place where it can be."""
    count = rows.stop - rows.start
    if future:
        later = torch.ones(count, keys, dtype=torch.bool, device=bias.device).triu_(keys - count + 1)
        bias = bias.masked_fill_(later, HIDDEN)
    if model_mask is not None:  # out of place: a mask per sample widens a bias shared by the batch
        bias = torch.where(model_mask[..., rows, :keys], bias, HIDDEN)
    return bias


def reference_hard_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    model_mask: Optional[torch.Tensor],
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    window: int,
    scaling: float,
) -> torch.Tensor:
    """The pattern and the model's mask applied to dense attention in chunks of queries (`reference.chunked_attention`):
    exact wherever it runs, memory growing with one chunk x kv. [batch, q, heads, dim]."""
    bias = hard_bias(query_groups, key_groups, key_sink, window, model_mask)
    return chunked_attention(query, key, value, bias, scaling=scaling)[0]
