"""Causal Sinkhorn routing: which groups each token belongs to.

The paper balances groups with Sinkhorn iterations whose column step sums over the whole sequence, so a token's
group depends on later tokens. Here the column step divides by the *prefix* sum (tokens 0..i), which keeps every
assignment a function of the tokens up to i only. That makes teacher-forced training honest and lets decoding
continue the very same computation token by token: the running column sums are carried in a `RoutingState`.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from focus_hf.attention.prefix_scan import sequence_cumsum, sequence_logcumsumexp

# Stands in for log(0): finite, so that gradients through logcumsumexp never see inf - inf.
LOG_ZERO = -1.0e4


@dataclass
class RoutingState:
    """What routing needs to remember between forward calls that share a KV cache (prefill, then decoding).

    Attributes:
        seen: tokens routed so far, padding included (matches the cache's sequence length).
        valid_count: real (non-padding) tokens so far, per sample, shape [batch] - counted until `sinks_filled`
            (it decides which tokens are sinks); deferred tokens after that are not counted.
        column_lse: running log column sums of each Sinkhorn iteration, shape [batch, iterations, groups].
        key_probs: soft group assignment of every routed token, shape [batch, seen - pending, groups].
        key_groups: hard (top-1) group of every token so far, shape [batch, seen].
        key_sink: whether each token so far is an attention sink, shape [batch, seen].
        pending_hidden: attention inputs [batch, p, hidden_size] of the last p tokens, whose key side is deferred
            (`defer_tokens`): their key_groups are -1 and key_probs covers only the seen - p tokens before them,
            until `settle` routes them; None when no token waits.
        pending_valid: [batch, p] validity of those tokens, or None.
        token_column_lse: [batch, new, iterations, groups], the running log column sums after each token of the call
            that made this state (`route_tokens(token_columns=True)`), or None. A paged cache keeps them per token
            (`focus_hf.vllm.side_cache`) so that routing can resume after any cached prefix.
        noted_steps: the attention inputs and validity of the last decoding steps whose tokens wait
            (`note_step`, `NotedSteps`), or None. They count in `seen` and nowhere else: key_groups
            and key_sink end before them (`waiting_keys` reads them as in no group yet and not sinks) until
            `defer_noted_steps` defers them as one block; every other reader of the state calls it first.
        sinks_filled: every sample has had its sink tokens (`route_tokens` found so), so no later token is one; a
            decoding step then has no sink flag to work out. False where not known.
    """

    seen: int
    valid_count: torch.Tensor
    column_lse: torch.Tensor
    key_probs: torch.Tensor
    key_groups: torch.Tensor
    key_sink: torch.Tensor
    pending_hidden: Optional[torch.Tensor] = None
    pending_valid: Optional[torch.Tensor] = None
    token_column_lse: Optional[torch.Tensor] = None
    noted_steps: Optional["NotedSteps"] = None
    sinks_filled: bool = False

    @property
    def pending(self) -> int:
        """Tokens whose key side is not routed yet."""
        return 0 if self.pending_hidden is None else self.pending_hidden.shape[1]

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
    hidden: torch.Tensor,
    projection: torch.Tensor,
    centroids: torch.Tensor,
    temperature: float,
    directions: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Cosine similarity of each projected token to each centroid, divided by the temperature.

    Args:
        hidden: [batch, seq, hidden_size] hidden states entering the attention block.
        projection: [hidden_size, group_dim] router projection W_g.
        centroids: [num_groups, group_dim].
        temperature: tau.
        directions: `scaled_directions(centroids, temperature)` where the caller keeps it (inference: it changes
            only with the centroids); None: computed here.

    Returns:
        float32 scores of shape [batch, seq, num_groups].
    """
    projected = hidden.to(projection.dtype) @ projection
    if projected.dtype != torch.float32:
        projected = projected.float()
    if directions is None:
        directions = scaled_directions(centroids, temperature)
    # cos = (p . c) / |p|: the projection's norm divides the K scores rather than its group_dim coordinates, as
    # F.normalize would (fewer operations: this runs in every routed layer at every decoding step).
    norm = torch.linalg.vector_norm(projected, dim=-1, keepdim=True).clamp_min(1e-12)
    return (projected @ directions) / norm


def scaled_directions(centroids: torch.Tensor, temperature: float) -> torch.Tensor:
    """[group_dim, num_groups] float32: each centroid's unit direction divided by the temperature, as columns."""
    return (F.normalize(centroids.float(), dim=-1) / temperature).T


# Largest |score| for which exp(score) and its prefix sums stay well inside float64's range, so the iteration can
# run on probabilities. Router scores are cosine / tau, so this holds for every tau >= 0.002; beyond it the
# log-space iteration runs.
PROBABILITY_SPACE_LIMIT = 500.0


def causal_sinkhorn(
    scores: torch.Tensor,
    valid: torch.Tensor,
    iterations: int,
    column_lse: Optional[torch.Tensor] = None,
    token_columns: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Balance group assignments with Sinkhorn iterations whose column sums run over the prefix only.

    Args:
        scores: [batch, seq, groups] log-potentials (scores / tau).
        valid: [batch, seq] bool, False for padding; padding never enters any column sum.
        iterations: number of (column, row) normalisation rounds.
        column_lse: [batch, iterations, groups] running log column sums from earlier calls, or None.
        token_columns: also return the running log column sums after each token, [batch, seq, iterations, groups]
            (the `column_lse` a later call would start from, had this one stopped after that token).

    Returns:
        (log_probs [batch, seq, groups] whose rows sum to one, updated column_lse[, per-token column_lse]).
    """
    batch, seq, groups = scores.shape
    if column_lse is None:
        column_lse = scores.new_full((batch, iterations, groups), LOG_ZERO)
    if seq and float(scores.detach().abs().amax()) <= PROBABILITY_SPACE_LIMIT:
        result = _probability_space_sinkhorn(scores, valid, iterations, column_lse, token_columns)
    else:
        result = _log_space_sinkhorn(scores, valid, iterations, column_lse, token_columns)
    return result if token_columns else result[:2]


def _probability_space_sinkhorn(
    scores: torch.Tensor, valid: torch.Tensor, iterations: int, column_lse: torch.Tensor, token_columns: bool = False
) -> tuple[torch.Tensor, ...]:
    """The iteration on probabilities in float64: a cumulative sum and two divisions per round, ~9x faster on a
    CPU than log-sum-exp prefixes. Equal to `_log_space_sinkhorn` within float32 rounding."""
    tiny = torch.finfo(torch.float64).tiny
    # No shift: one computed from the call's tokens would make earlier tokens depend on later ones.
    q = torch.exp(scores.double()).clamp_min(tiny)
    if scores.shape[1] == 1 and bool(valid.all()):
        log_probs, new_column_lse = _one_token_sinkhorn(q, iterations, column_lse, scores.dtype)
        return log_probs, new_column_lse, new_column_lse[:, None]
    keep = valid.unsqueeze(-1).double()
    new_column_lse, per_token = [], []
    for step in range(iterations):
        prefix = torch.exp(column_lse[:, step].double())[:, None, :] + sequence_cumsum(q * keep)
        new_column_lse.append(torch.log(prefix[:, -1]).float().clamp_min(LOG_ZERO))
        if token_columns:
            per_token.append(torch.log(prefix).float().clamp_min(LOG_ZERO))
        # Padding rows are normalised by their own mass too, only to keep them finite.
        q = q / torch.where(keep.bool(), prefix, prefix + q)
        q = (q / q.sum(dim=-1, keepdim=True)).clamp_min(tiny)
    columns = torch.stack(per_token, dim=2) if token_columns else None
    return torch.log(q).to(scores.dtype), torch.stack(new_column_lse, dim=1), columns


def _one_token_sinkhorn(
    q: torch.Tensor, iterations: int, column_lse: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_probability_space_sinkhorn` for one real token per sample (a decoding step), q = exp(scores) in float64:
    the same operations on the same values (a prefix sum of one token is the token), in a quarter of the calls -
    decoding runs it once per layer per token, where per-call overhead is most of the cost."""
    tiny = torch.finfo(torch.float64).tiny
    columns = torch.exp(column_lse.double()).unsqueeze(2).unbind(1)  # per iteration [batch, 1, K], views made once
    prefixes = []
    for step in range(iterations):
        prefix = columns[step] + q
        prefixes.append(prefix)
        q = q / prefix
        q = (q / q.sum(dim=-1, keepdim=True)).clamp_min_(tiny)
    new_column_lse = torch.log(torch.cat(prefixes, dim=1)).float().clamp_min(LOG_ZERO)
    return torch.log(q).to(dtype), new_column_lse


def _log_space_sinkhorn(
    scores: torch.Tensor, valid: torch.Tensor, iterations: int, column_lse: torch.Tensor, token_columns: bool = False
) -> tuple[torch.Tensor, ...]:
    """The iteration in log space (log-sum-exp prefixes): exact for any score spread."""
    keep = valid.unsqueeze(-1)
    log_q = scores
    new_column_lse, per_token = [], []
    for step in range(iterations):
        contribution = log_q.masked_fill(~keep, LOG_ZERO)
        prefix = torch.logaddexp(sequence_logcumsumexp(contribution), column_lse[:, step, None, :])
        new_column_lse.append(prefix[:, -1] if prefix.shape[1] else column_lse[:, step])
        if token_columns:
            per_token.append(prefix)
        # Padding rows are normalised by their own mass too, only to keep them finite.
        normaliser = torch.where(keep, prefix, torch.logaddexp(prefix, log_q))
        log_q = torch.log_softmax(log_q - normaliser, dim=-1)
    columns = torch.stack(per_token, dim=2) if token_columns else None
    return log_q, torch.stack(new_column_lse, dim=1), columns


@dataclass
class TokenRouting:
    """Routing of the tokens of one forward call."""

    # [batch, seq, groups] key-side (Sinkhorn-balanced) assignment; None while deferred (`defer_tokens`).
    log_probs: Optional[torch.Tensor]
    top_groups: torch.Tensor  # [batch, seq, top_k] groups each token probes as a query, best first
    sink: torch.Tensor  # [batch, seq] bool
    # [batch, seq, groups] query-side log-probabilities of a separate query router; None: queries use log_probs.
    query_log_probs: Optional[torch.Tensor] = None

    # [batch, seq] each token's own group as a key; None: the first probe (the same when there is no query router).
    own_groups: Optional[torch.Tensor] = None

    @property
    def key_groups(self) -> torch.Tensor:
        """[batch, seq] the group each token is filed under as a key."""
        return self.top_groups[..., 0] if self.own_groups is None else self.own_groups

    def select_tokens(self, tokens: slice) -> "TokenRouting":
        """The routing of some of the call's tokens (a slice along the sequence)."""

        def part(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if tensor is None else tensor[:, tokens]

        return TokenRouting(
            log_probs=part(self.log_probs),
            top_groups=part(self.top_groups),
            sink=part(self.sink),
            query_log_probs=part(self.query_log_probs),
            own_groups=part(self.own_groups),
        )

    @property
    def probe_log_probs(self) -> torch.Tensor:
        """Log-probabilities of the groups each token probes as a query."""
        return self.log_probs if self.query_log_probs is None else self.query_log_probs


def probed_groups(log_probs: torch.Tensor, top_k: int, probe_mass: Optional[float] = None) -> torch.Tensor:
    """The groups each token probes as a query, best first: [..., top_k] from its log-probabilities [..., K].

    Without `probe_mass`, the top_k most probable groups. With it (adaptive probing), a query stops once the
    groups before a slot hold at least `probe_mass` of its probability: a confident query probes one group, an
    unsure one up to top_k. Slots it does not probe repeat its first group, so the probed set is always the
    distinct groups of the row and every mask built from it (`pattern.probes`) needs no other marker.

    Ties (the first token's assignment is uniform) go to the lower group index, whatever top_k is: argmax returns
    the first maximum, and the stable sort keeps index order among equals.
    """
    if top_k == 1:
        return log_probs.argmax(dim=-1, keepdim=True)
    ranked = torch.sort(log_probs, dim=-1, descending=True, stable=True)
    groups = ranked.indices[..., :top_k]
    if probe_mass is None:
        return groups
    probability = ranked.values[..., :top_k].float().exp()
    before = probability.cumsum(dim=-1) - probability  # mass of the better slots
    probed = before < probe_mass
    probed[..., 0] = True
    return torch.where(probed, groups, groups[..., :1])


def route_tokens(
    scores: torch.Tensor,
    valid: torch.Tensor,
    state: RoutingState,
    *,
    iterations: int,
    top_k: int,
    sink_tokens: int,
    query_scores: Optional[torch.Tensor] = None,
    probe_mass: Optional[float] = None,
    token_columns: bool = False,
) -> tuple[TokenRouting, RoutingState]:
    """Route new tokens that follow `state`, returning their routing and the state including them.

    Keys always take their group from the causal Sinkhorn assignment of `scores`. Queries probe the top-k groups
    of the same assignment, or, when `query_scores` is given (a separate query-side projection), of
    softmax(query_scores): a query then looks for the groups that hold the keys it needs, which need not be
    the group it is itself filed under. With `probe_mass`, a query probes fewer than top_k groups where the first
    ones already hold that much of its routing probability (`probed_groups`). With `token_columns`, the new state
    also holds the running column sums after each new token (`RoutingState.token_column_lse`).
    """
    if state.pending or state.noted_steps:
        raise ValueError(
            "route_tokens after deferred tokens: defer_noted_steps(state, sink_tokens), then settle(state, "
            "key_scores, iterations) them first."
        )
    log_probs, column_lse, *per_token = causal_sinkhorn(
        scores, valid, iterations, state.column_lse, token_columns=token_columns
    )
    top_groups, key_groups, query_log_probs = token_groups(log_probs, query_scores, top_k, probe_mass)
    sink = _sinks(valid, state, sink_tokens)
    tokens = TokenRouting(
        log_probs=log_probs,
        top_groups=top_groups,
        sink=sink,
        query_log_probs=query_log_probs,
        own_groups=None if query_scores is None else key_groups,
    )
    valid_count = state.valid_count + valid.sum(dim=1)
    new_state = RoutingState(
        seen=state.seen + scores.shape[1],
        valid_count=valid_count,
        column_lse=column_lse,
        key_probs=torch.cat([state.key_probs, log_probs.exp()], dim=1),
        key_groups=torch.cat([state.key_groups, key_groups], dim=1),
        key_sink=torch.cat([state.key_sink, sink], dim=1),
        token_column_lse=per_token[0] if per_token else None,
        sinks_filled=state.sinks_filled or _all_past_sinks(valid_count, sink_tokens),
    )
    return tokens, new_state


def _all_past_sinks(valid_count: torch.Tensor, sink_tokens: int) -> bool:
    """Whether every sample has `sink_tokens` real tokens already. Read on the CPU only, once per routing call (a
    sync elsewhere, and a graph break under torch.compile); elsewhere not known (False)."""
    if valid_count.device.type != "cpu" or torch.compiler.is_compiling() or not valid_count.numel():
        return False
    return int(valid_count.min()) >= sink_tokens


def token_groups(
    log_probs: torch.Tensor, query_scores: Optional[torch.Tensor], top_k: int, probe_mass: Optional[float] = None
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The groups of routed tokens, from their key-side assignment `log_probs` [..., K] (`causal_sinkhorn`) and the
    scores of a separate query router [..., K] (None: queries use the assignment): the groups each probes as a
    query [..., top_k] (`probed_groups`), the group it is filed under as a key [...], and the query router's
    log-probabilities (None without one)."""
    query_log_probs = None if query_scores is None else torch.log_softmax(query_scores, dim=-1)
    top_groups = probed_groups(log_probs if query_log_probs is None else query_log_probs, top_k, probe_mass)
    key_groups = top_groups[..., 0] if query_scores is None else log_probs.argmax(dim=-1)
    return top_groups, key_groups, query_log_probs


def _sinks(valid: torch.Tensor, state: RoutingState, sink_tokens: int) -> torch.Tensor:
    """[batch, seq] whether each new token is one of its sequence's first `sink_tokens` real tokens."""
    if valid.shape[1] == 1:  # a decoding step: a real token's rank is the count before it (fewer passes)
        return valid & (state.valid_count < sink_tokens).unsqueeze(1)
    rank = state.valid_count[:, None] + valid.long().cumsum(dim=1) - 1
    return valid & (rank < sink_tokens)


def defer_tokens(
    hidden: torch.Tensor,
    valid: torch.Tensor,
    state: RoutingState,
    *,
    probes: Optional[torch.Tensor],
    sink_tokens: int,
) -> tuple[TokenRouting, RoutingState]:
    """Route new tokens while deferring their key side: the hidden states wait in the state until `settle`.

    A decoding step needs the new token's probes now (or nothing, when its call attends densely), but its own key
    group only once it lies beyond the window of a later query. The caller settles the waiting tokens in one call
    before that (or before anything else reads them), so decoding pays the key projection and the Sinkhorn
    iterations once per block instead of once per token. Settled groups equal those routed one token at a time up
    to float rounding (the same prefix sums, summed in another order).

    Args:
        hidden: [batch, seq, hidden_size] the new tokens' attention inputs.
        probes: [batch, seq, top_k] the groups the tokens probe (`FocusLayer.query_probes`; the routing holds no
            query log-probabilities), or None when the call attends densely and needs none (top_groups [batch, seq,
            1] of -1).

    Returns:
        The routing of the new tokens (no key-side `log_probs`, key group -1) and the state including them.
    """
    if state.noted_steps:
        raise ValueError("defer_tokens after noted steps: defer_noted_steps(state, sink_tokens) them first.")
    batch, seq = hidden.shape[:2]
    if probes is None:
        probes = torch.full((batch, seq, 1), -1, dtype=torch.long, device=hidden.device)
    key_groups = F.pad(state.key_groups, (0, seq), value=-1)  # the new tokens' groups are unknown (-1) until settled
    if state.sinks_filled:
        key_sink = F.pad(state.key_sink, (0, seq), value=False)
        sink = constant_rows(batch, seq, False, hidden.device)
    else:
        sink = _sinks(valid, state, sink_tokens)
        key_sink = torch.cat([state.key_sink, sink], dim=1)
    tokens = waiting_step(probes, sink)
    waiting = hidden if state.pending_hidden is None else torch.cat([state.pending_hidden, hidden], dim=1)
    waiting_valid = valid if state.pending_valid is None else torch.cat([state.pending_valid, valid], dim=1)
    # The constructor rather than dataclasses.replace: this runs in every routed layer at every decoding step. Once
    # every sample has its sinks nothing reads the count of real tokens again (`RoutingState.valid_count`).
    new_state = RoutingState(
        seen=state.seen + seq,
        valid_count=state.valid_count
        if state.sinks_filled
        else state.valid_count + (valid[:, 0] if seq == 1 else valid.sum(dim=1)),
        column_lse=state.column_lse,
        key_probs=state.key_probs,
        key_groups=key_groups,
        key_sink=key_sink,
        pending_hidden=waiting,
        pending_valid=waiting_valid,
        sinks_filled=state.sinks_filled,
    )
    return tokens, new_state


def constant_rows(batch: int, seq: int, value: Union[bool, int], device: torch.device) -> torch.Tensor:
    """A [batch, seq] tensor of `value` (bool, or an int64 group): what a decoding step's routing says of every new
    token (real, not a sink, group -1 while deferred). Made once per shape and shared by every layer and step (read
    only, never written in place), but under torch.compile, whose graph makes its own."""
    dtype = torch.bool if isinstance(value, bool) else torch.long
    if torch.compiler.is_compiling():
        return torch.full((batch, seq), value, dtype=dtype, device=device)
    return _shared_constant(batch, seq, value, dtype, device)


@functools.lru_cache(maxsize=64)
def _shared_constant(batch: int, seq: int, value: Union[bool, int], dtype: torch.dtype, device: torch.device):
    with torch.inference_mode(False):  # a normal tensor, also when first asked for under inference_mode
        return torch.full((batch, seq), value, dtype=dtype, device=device)


# Decoding with a query router defers the key-side Sinkhorn of new tokens and balances them in blocks of at most
# this many (never more than the window, so that a token's group is known before any query sees it from afar);
# a `NotedSteps` is made for as many.
PENDING_LIMIT = 64


class NotedSteps:
    """The attention inputs [batch, hidden_size] and validity [batch] of decoding steps whose tokens wait
    (`note_step`), copied into two buffers made for PENDING_LIMIT steps (grown if more come).

    Why copies: a step's input is a tensor the model frees after the layer. Kept alive (as a list of them once
    was), each step's inputs sit, one small block per layer, amid the megabytes that transformers' `DynamicCache`
    frees and takes again at every step (it concatenates each layer's keys into a new, slightly larger tensor):
    those blocks split the space it would reuse, so that the heap grew by tens of megabytes a step, and fresh pages
    (page faults) made many of Focus's decoding steps after a 16K prompt several times as slow as its own steps
    without them, slower than the base model's.
    """

    def __init__(self, hidden: torch.Tensor, valid: torch.Tensor, count: int = 0) -> None:
        self.count = count
        self._hold(hidden, valid)
        # The validity `query_validity` gives a step without padding (one shared tensor): nothing to copy then.
        self.every_token_real = constant_rows(valid.shape[0], 1, True, valid.device)

    def _hold(self, hidden: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep these buffers, and where a step's rows are copied by address (CPU): asked once, not at every step."""
        self.hidden = hidden  # [batch, capacity, hidden_size]
        self.valid = valid  # [batch, capacity]
        self.capacity = hidden.shape[1]
        by_address = hidden.is_cpu and hidden.stride(2) == 1
        self._address = hidden.data_ptr() if by_address else None
        size = hidden.element_size()
        self._row_bytes = hidden.shape[2] * size
        self._sample_stride, self._step_stride = hidden.stride(0) * size, hidden.stride(1) * size

    @classmethod
    def for_inputs(cls, hidden: torch.Tensor, capacity: int = 0) -> "NotedSteps":
        """Empty buffers for steps of `hidden` [batch, 1, hidden_size]: ordinary tensors, also when first made under
        inference_mode (a later step may run outside it)."""
        capacity = max(capacity, PENDING_LIMIT)
        with torch.inference_mode(False):
            buffer = hidden.new_empty(hidden.shape[0], capacity, hidden.shape[2], requires_grad=False)
            valid = torch.ones(hidden.shape[0], capacity, dtype=torch.bool, device=hidden.device)
        return cls(buffer, valid)

    def __len__(self) -> int:
        return self.count

    def append(self, hidden: torch.Tensor, valid: torch.Tensor) -> None:
        """Copy in one step's hidden [batch, 1, hidden_size] and validity [batch, 1]."""
        if self.count == self.capacity:
            grown = NotedSteps.for_inputs(hidden, 2 * self.count)
            grown.hidden[:, : self.count] = self.hidden
            grown.valid[:, : self.count] = self.valid
            self._hold(grown.hidden, grown.valid)
        if self._address is not None and hidden.dtype is self.hidden.dtype and hidden.is_contiguous():
            # A step's one row per sample, copied by address: a tensor copy cost about ten microseconds per layer
            # and step in a model, most of what the rest of a dense decoding step's bookkeeping costs.
            row = self._row_bytes
            source, target = hidden.data_ptr(), self._address + self.count * self._step_stride
            for sample in range(hidden.shape[0]):
                ctypes.memmove(target + sample * self._sample_stride, source + sample * row, row)
        else:
            with torch.no_grad():  # the routing of a waiting token reads its input, never a gradient through it
                self.hidden.narrow(1, self.count, 1).copy_(hidden)
        if valid is not self.every_token_real:  # else True already, as made
            self.valid.narrow(1, self.count, 1).copy_(valid)
        self.count += 1

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The noted steps' hidden [batch, count, hidden_size] and validity [batch, count] (views of the buffers)."""
        return self.hidden[:, : self.count], self.valid[:, : self.count]

    def index_select(self, index: torch.Tensor) -> "NotedSteps":
        """These steps of the samples at `index` (a batch reordered by beam search)."""
        hidden, valid = self.inputs()
        return NotedSteps(hidden.index_select(0, index), valid.index_select(0, index), self.count)


def note_step(state: RoutingState, hidden: torch.Tensor, valid: torch.Tensor) -> None:
    """Count a decoding step whose token waits in `state` (`NotedSteps`), in place: one that attends densely
    (below `dense_below`, within the window), or a routed one once every sample has its sinks (its routing is
    `waiting_step`'s).

    Its key side is needed only once it lies beyond the window: the step pays two small copies where
    `defer_tokens` would grow four tensors, so that a dense step decodes at the base model's cost. The tokens are
    deferred as one block (`defer_noted_steps`) when something next needs them - a full block to settle, or a
    prefill chunk.
    """
    if state.noted_steps is None:
        state.noted_steps = NotedSteps.for_inputs(hidden)
    state.noted_steps.append(hidden, valid)
    state.seen += 1


def waiting_step(probes: torch.Tensor, sink: Optional[torch.Tensor] = None) -> TokenRouting:
    """The routing of tokens whose key side waits (`defer_tokens`, `note_step`) and that probe `probes` [batch, seq,
    top_k]: no key side yet (group -1), and sink flags `sink` [batch, seq] (None: not sinks, as every token noted once
    every sample has its sinks)."""
    batch, seq = probes.shape[:2]
    return TokenRouting(
        log_probs=None,
        top_groups=probes,
        sink=constant_rows(batch, seq, False, probes.device) if sink is None else sink,
        own_groups=constant_rows(batch, seq, -1, probes.device),
    )


def waiting_keys(key_groups: torch.Tensor, key_sink: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """key_groups / key_sink [batch, n] of a state whose last steps wait in its list (`note_step`), brought to kv_len
    keys: the waiting ones in no group yet (-1) and not sinks, as `defer_tokens` files them."""
    missing = kv_len - key_groups.shape[1]
    if missing <= 0:
        return key_groups, key_sink
    return F.pad(key_groups, (0, missing), value=-1), F.pad(key_sink, (0, missing), value=False)


def defer_noted_steps(state: RoutingState, sink_tokens: int) -> RoutingState:
    """`state` with its noted steps (`note_step`) deferred as one block (`defer_tokens`), as if each had been
    deferred at its step."""
    steps = state.noted_steps
    if not steps:
        return state
    earlier = RoutingState(
        seen=state.seen - len(steps),
        valid_count=state.valid_count,
        column_lse=state.column_lse,
        key_probs=state.key_probs,
        key_groups=state.key_groups,
        key_sink=state.key_sink,
        pending_hidden=state.pending_hidden,
        pending_valid=state.pending_valid,
        sinks_filled=state.sinks_filled,
    )
    hidden, valid = steps.inputs()  # views: the buffers go with the deferred state (a new one takes the next)
    return defer_tokens(hidden, valid, earlier, probes=None, sink_tokens=sink_tokens)[1]


def settle(state: RoutingState, key_scores: torch.Tensor, iterations: int) -> RoutingState:
    """`state` with the key side of its waiting tokens routed, given their key scores [batch, pending, K] (the
    router's scores of `state.pending_hidden`)."""
    log_probs, column_lse = causal_sinkhorn(key_scores, state.pending_valid, iterations, state.column_lse)
    routed = state.seen - state.pending
    return RoutingState(
        seen=state.seen,
        valid_count=state.valid_count,
        column_lse=column_lse,
        key_probs=torch.cat([state.key_probs, log_probs.exp()], dim=1),
        key_groups=torch.cat([state.key_groups[:, :routed], log_probs.argmax(dim=-1)], dim=1),
        key_sink=state.key_sink,
        sinks_filled=state.sinks_filled,
    )
