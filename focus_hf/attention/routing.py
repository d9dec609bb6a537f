"""Causal Sinkhorn routing: which groups each token belongs to.

The paper balances groups with Sinkhorn iterations whose column step sums over the whole sequence, so a token's
group depends on later tokens. Here the column step divides by the *prefix* sum (tokens 0..i), which keeps every
assignment a function of the tokens up to i only. That makes teacher-forced training honest and lets decoding
continue the very same computation token by token: the running column sums are carried in a `RoutingState`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

# Stands in for log(0): finite, so that gradients through logcumsumexp never see inf - inf.
LOG_ZERO = -1.0e4


@dataclass
class RoutingState:
    """What routing needs to remember between forward calls that share a KV cache (prefill, then decoding).

    Attributes:
        seen: tokens routed so far, padding included (matches the cache's sequence length).
        valid_count: real (non-padding) tokens so far, per sample, shape [batch].
        column_lse: running log column sums of each Sinkhorn iteration, shape [batch, iterations, groups].
        key_probs: soft group assignment of every token so far, shape [batch, seen, groups].
        key_groups: hard (top-1) group of every token so far, shape [batch, seen].
        key_sink: whether each token so far is an attention sink, shape [batch, seen].
    """

    seen: int
    valid_count: torch.Tensor
    column_lse: torch.Tensor
    key_probs: torch.Tensor
    key_groups: torch.Tensor
    key_sink: torch.Tensor

    @classmethod
    def empty(cls, batch: int, iterations: int, groups: int, device: torch.device) -> "RoutingState":
        return cls(
            seen=0,
            valid_count=torch.zeros(batch, dtype=torch.long, device=device),
            column_lse=torch.full((batch, iterations, groups), LOG_ZERO, device=device),
            key_probs=torch.zeros(batch, 0, groups, device=device),
            key_groups=torch.zeros(batch, 0, dtype=torch.long, device=device),
            key_sink=torch.zeros(batch, 0, dtype=torch.bool, device=device),
        )


def routing_scores(
    hidden: torch.Tensor, projection: torch.Tensor, centroids: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Cosine similarity of each projected token to each centroid, divided by the temperature.

    Args:
        hidden: [batch, seq, hidden_size] hidden states entering the attention block.
        projection: [hidden_size, group_dim] router projection W_g.
        centroids: [num_groups, group_dim].
        temperature: tau.

    Returns:
        float32 scores of shape [batch, seq, num_groups].
    """
    projected = hidden.to(projection.dtype) @ projection
    similarity = F.normalize(projected.float(), dim=-1) @ F.normalize(centroids.float(), dim=-1).T
    return similarity / temperature


def causal_sinkhorn(
    scores: torch.Tensor,
    valid: torch.Tensor,
    iterations: int,
    column_lse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Balance group assignments with Sinkhorn iterations whose column sums run over the prefix only.

    Args:
        scores: [batch, seq, groups] log-potentials (scores / tau).
        valid: [batch, seq] bool, False for padding; padding never enters any column sum.
        iterations: number of (column, row) normalisation rounds.
        column_lse: [batch, iterations, groups] running log column sums from earlier calls, or None.

    Returns:
        (log_probs [batch, seq, groups] whose rows sum to one, updated column_lse).
    """
    batch, _, groups = scores.shape
    if column_lse is None:
        column_lse = scores.new_full((batch, iterations, groups), LOG_ZERO)
    keep = valid.unsqueeze(-1)
    log_q = scores
    new_column_lse = []
    for step in range(iterations):
        contribution = log_q.masked_fill(~keep, LOG_ZERO)
        prefix = torch.logaddexp(torch.logcumsumexp(contribution, dim=1), column_lse[:, step, None, :])
        new_column_lse.append(prefix[:, -1] if prefix.shape[1] else column_lse[:, step])
        # Padding rows are normalised by their own mass too, only to keep them finite.
        normaliser = torch.where(keep, prefix, torch.logaddexp(prefix, log_q))
        log_q = torch.log_softmax(log_q - normaliser, dim=-1)
    return log_q, torch.stack(new_column_lse, dim=1)


@dataclass
class TokenRouting:
    """Routing of the tokens of one forward call."""

    log_probs: torch.Tensor  # [batch, seq, groups]
    top_groups: torch.Tensor  # [batch, seq, top_k], best group first
    sink: torch.Tensor  # [batch, seq] bool


def route_tokens(
    scores: torch.Tensor,
    valid: torch.Tensor,
    state: RoutingState,
    *,
    iterations: int,
    top_k: int,
    sink_tokens: int,
) -> tuple[TokenRouting, RoutingState]:
    """Route new tokens that follow `state`, returning their routing and the state including them."""
    log_probs, column_lse = causal_sinkhorn(scores, valid, iterations, state.column_lse)
    # A stable sort breaks ties (the first token's assignment is uniform) by group index, whatever top_k is.
    top_groups = torch.sort(log_probs, dim=-1, descending=True, stable=True).indices[..., :top_k]
    rank = state.valid_count[:, None] + valid.long().cumsum(dim=1) - 1
    sink = valid & (rank < sink_tokens)
    tokens = TokenRouting(log_probs=log_probs, top_groups=top_groups, sink=sink)
    new_state = RoutingState(
        seen=state.seen + scores.shape[1],
        valid_count=state.valid_count + valid.long().sum(dim=1),
        column_lse=column_lse,
        key_probs=torch.cat([state.key_probs, log_probs.exp()], dim=1),
        key_groups=torch.cat([state.key_groups, top_groups[..., 0]], dim=1),
        key_sink=torch.cat([state.key_sink, sink], dim=1),
    )
    return tokens, new_state
