"""Dense masked attention: the plain O(n^2) oracle every faster path is checked against."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


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
