"""The Focus attention pattern: which (query, key) pairs may attend, and the soft gate that tends to it.

Rule (hard mode): key j is visible to query i iff j <= i and at least one of
  - i - j <= window (full local attention),
  - j is one of the first `sink_tokens` real tokens of its sequence (attention sinks),
  - j's group (its top-1 group) is among i's top-k groups.
With top_k = 1 this is "i and j share a group". Giving keys a single group while queries probe k groups keeps
every allowed pair in exactly one group, which is what makes the fast two-call decomposition exact.

Soft mode (training) adds log(p_i . p_j) to the logit of every distant, non-sink pair, where p are the soft group
assignments: p_i . p_j is the probability that i and j land in the same group, so as routing sharpens the gate
goes to 0 for same-group pairs and to -inf for the others, i.e. to the hard top-1 pattern.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from focus_hf.attention.routing import waiting_keys

# `pattern_bits` gives each group one bit of an int32, and bit 31 to tokens not routed yet (group -1).
BITS_MAX_GROUPS = 31
# `local_bits` keeps bit 30 for the sinks whose pairs another part takes.
LOCAL_BITS_MAX_GROUPS = 30
SINK_BIT = 1 << 30


def group_bits(groups: torch.Tensor) -> torch.Tensor:
    """Each group's bit as int32's two's complement (kept int64): group g is bit g, group -1 bit 31."""
    unsigned = torch.where(groups < 0, 1 << 31, torch.ones_like(groups) << groups.clamp_min(0))
    return unsigned - (unsigned >= 1 << 31).long() * (1 << 32)


def probed_bits(query_groups: torch.Tensor) -> torch.Tensor:
    """The bits of the groups each query probes [..., q, top_k] -> [..., q] (int64, see `group_bits`)."""
    bits = group_bits(query_groups[..., 0])
    for rank in range(1, query_groups.shape[-1]):
        bits |= group_bits(query_groups[..., rank])
    return bits


def pattern_bits(
    query_groups: torch.Tensor, key_groups: torch.Tensor, key_sink: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group rule of the pattern as int32 bits (`native_prefill.prefill_attention`): query i may see key j from afar
    iff bits[i] & key_bits[j] is not 0. A key has its group's bit (a sink every bit), a query those of the groups it
    probes [..., q, top_k]; group -1 (not routed yet) is bit 31, so that such queries and keys see each other as
    `probes` says. For at most BITS_MAX_GROUPS groups. Returns ([..., q], [..., kv])."""
    key_bits = torch.where(key_sink, -1, group_bits(key_groups))
    return probed_bits(query_groups).to(torch.int32), key_bits.to(torch.int32)


def local_bits(
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: Optional[torch.Tensor],
    sinks_done: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bits for the local part (`native_prefill.prefill_attention(local=True)`): query i and key j share a bit iff j's
    group is among i's probed groups, or j is a sink and `sinks_done[i]` (its sink pairs were taken by the own-group
    pass) - exactly the window pairs the local part leaves out. For at most LOCAL_BITS_MAX_GROUPS groups."""
    query_bits, key_bits = probed_bits(query_groups), group_bits(key_groups)
    if key_sink is not None and sinks_done is not None:
        query_bits = query_bits | torch.where(sinks_done, SINK_BIT, 0)
        key_bits = key_bits | torch.where(key_sink, SINK_BIT, 0)
    return query_bits.to(torch.int32), key_bits.to(torch.int32)


def pair_distance(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """[..., q, kv] signed distance i - j between absolute positions [..., q] and [..., kv] (leading dims broadcast).

    int32: positions stay far below 2**31, and the q x kv result is half the memory traffic of int64.
    """
    return query_positions.to(torch.int32).unsqueeze(-1) - key_positions.to(torch.int32).unsqueeze(-2)


def causal_positions(q_len: int, kv_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute positions of queries and keys when the keys are the last `kv_len` tokens, queries the last `q_len`."""
    keys = torch.arange(kv_len, device=device)
    return keys[kv_len - q_len :], keys


def probes(query_groups: torch.Tensor, key_groups: torch.Tensor) -> torch.Tensor:
    """Bool [..., q, kv]: whether key j's single group is among query i's probed groups.

    Args:
        query_groups: [..., q, top_k].
        key_groups: [..., kv].
    """
    keys = key_groups.unsqueeze(-2)
    shared = query_groups[..., 0, None] == keys
    for rank in range(1, query_groups.shape[-1]):  # k passes: cheaper than a [q, k, kv] compare reduced over k
        shared |= query_groups[..., rank, None] == keys
    return shared


def probes_every_group(query_groups: torch.Tensor, num_groups: int) -> bool:
    """Whether every query [..., q, top_k] probes all `num_groups` groups (the hard pattern is then causal).

    A query's probed groups are distinct, and a slot that is not probed repeats its first group
    (`routing.probed_groups`), so it probes them all when its other top_k - 1 slots all differ from the first."""
    if query_groups.shape[-1] < num_groups:
        return False
    others = (query_groups[..., 1:] != query_groups[..., :1]).sum(dim=-1)
    return bool((others == num_groups - 1).all())


def probed_mask(query_groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Bool [..., num_groups]: the groups each query probes (a repeated slot counts once), from [..., top_k]."""
    mask = torch.zeros(*query_groups.shape[:-1], num_groups, dtype=torch.bool, device=query_groups.device)
    return mask.scatter_(-1, query_groups, True)


def probed_distant_keys(
    query_groups: torch.Tensor, key_groups: torch.Tensor, key_sink: torch.Tensor, window: int, num_groups: int
) -> torch.Tensor:
    """Per query of one sample whose queries are its keys: how many non-sink keys farther than `window` lie in the
    groups it probes, [n] int64, counted in O(n K) memory instead of materialising n x n.

    Args:
        query_groups: [n, top_k] (a repeated slot counts once).
        key_groups: [n] each key's own group.
        key_sink: [n] whether each key is a sink (sinks are counted apart: they are visible anyway).
    """
    positions = torch.arange(key_groups.shape[0], device=key_groups.device)
    member = torch.zeros(key_groups.shape[0], num_groups, dtype=torch.long, device=key_groups.device)
    member[positions[~key_sink], key_groups[~key_sink]] = 1
    farthest = positions - window - 1  # last distant key of each query (negative: none)
    per_group = member.cumsum(0)[farthest.clamp(min=0)] * (farthest >= 0)[:, None]
    return (per_group * probed_mask(query_groups, num_groups)).sum(1)


def allowed_pairs(
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int,
) -> torch.Tensor:
    """Boolean [batch, q, kv] mask of the pairs the hard Focus pattern allows (causality included).

    Args:
        query_groups: [batch, q, top_k] groups each query probes.
        key_groups: [batch, kv] the single group of each key.
        key_sink: [batch, kv] True for sink tokens.
        query_positions: [q] or [batch, q] absolute positions of the queries.
        key_positions: [kv] or [batch, kv] absolute positions of the keys.
        window: local window w.
    """
    distance = pair_distance(query_positions, key_positions)
    return (distance >= 0) & ((distance <= window) | key_sink[:, None, :] | probes(query_groups, key_groups))


def pattern_bias(
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    window: int,
    num_groups: int,
    dtype: torch.dtype,
    hide_future: bool = True,
) -> torch.Tensor:
    """Additive bias [batch, q, kv] of the pattern of a call whose queries are the last q of its kv keys: 0 where the
    pair is allowed, finfo(dtype).min where it is hidden.

    With `hide_future=False` the entries of future keys are left as they fall, for a square call whose kernel applies
    causality itself. The bias is written in one gather from a [batch, q, K + 2] table of each query's row over the
    groups (column K: sinks, seen by all; column K + 1: keys or queries not routed yet, group -1, which see each other
    as `probes` says), then the window's band is one strided fill (and the future one masked fill): a single pass
    over q x kv whatever top_k is, where comparing groups takes one pass per probe and converting a boolean mask to
    a bias another.
    """
    batch, q_len, _ = query_groups.shape
    kv_len = key_groups.shape[1]
    first = kv_len - q_len  # the first query's position
    hidden = torch.finfo(dtype).min
    sink_column, unrouted_column = num_groups, num_groups + 1
    rows = torch.full((batch, q_len, num_groups + 2), hidden, dtype=dtype, device=query_groups.device)
    rows.scatter_(2, torch.where(query_groups < 0, unrouted_column, query_groups), 0.0)
    rows[:, :, sink_column] = 0.0
    columns = torch.where(key_sink, sink_column, torch.where(key_groups < 0, unrouted_column, key_groups))
    bias = rows.gather(2, columns[:, None, :].expand(batch, q_len, kv_len))
    # Query i (position first + i) sees keys first + i - window .. first + i in its window; for the leading rows that
    # band starts at key 0 and is cut there.
    leading = min(max(window - first, 0), q_len)
    if q_len > leading:  # row i's band is row i of a strided [q - leading, window + 1] view: one step further a row
        offset = bias.storage_offset() + leading * kv_len + first + leading - window
        band = bias.as_strided((batch, q_len - leading, window + 1), (q_len * kv_len, kv_len + 1, 1), offset)
        band.fill_(0.0)
    if leading:  # also zeroes keys after some of these rows' own positions: hidden below, or by a causal kernel
        bias[:, :leading, : first + leading] = 0.0
    if hide_future and q_len > 1:
        future = torch.ones(q_len, kv_len, dtype=torch.bool, device=bias.device).triu_(first + 1)
        bias.masked_fill_(future, hidden)
    return bias


@dataclass(frozen=True, eq=False)
class FocusPattern:
    """The hard pattern of one attention call: which (query, key) pairs may attend - the routing's decision as one
    frozen object that the attention's paths read (the role FlexAttention's `BlockMask` plays there). A model's calls
    get theirs from `function.LayerRouting.pattern`; the queries are the last `q` of the call's `kv` keys.

    Attributes:
        query_groups: [batch, q, top_k] the groups each query probes (a slot repeating the first is not probed).
        key_groups: [batch, kv] each key's group (-1: not routed yet). May end before the last keys, whose decoding
            steps wait in their state's list (`routing.note_step`): those are in no group yet and not sinks
            (`keys_up_to`).
        key_sink: [batch, kv] whether each key is an attention sink (visible to every later query).
        num_groups: K.
        window: the local window w: a key at most w positions before its query is always visible.
        model_mask: the model's boolean mask [batch or 1, 1, q, kv] (True = may attend), or None (causal, no padding).
        mask_is_padding: whether `model_mask` hides no more than future and padding keys; False for sliding-window
            layers, packed documents or a custom mask (the paths then apply it in full); None: not known (under
            torch.compile, where checking would break the graph).
        sink_tokens: the most sinks a sample has (the adapter's `sink_tokens`); None: read from `key_sink` where
            needed (one device read).
        own_group: whether each query's first probe is its own key group (no separate query router), as the routing
            knows; None: read from the groups where needed (a device sync).
    """

    query_groups: torch.Tensor
    key_groups: torch.Tensor
    key_sink: torch.Tensor
    num_groups: int
    window: int
    model_mask: Optional[torch.Tensor] = None
    mask_is_padding: Optional[bool] = True
    sink_tokens: Optional[int] = None
    own_group: Optional[bool] = None

    @property
    def top_k(self) -> int:
        return self.query_groups.shape[-1]

    @property
    def general_mask(self) -> bool:
        """Whether the model's mask may hide more than future and padding keys (or is not known to hide no more)."""
        return self.model_mask is not None and self.mask_is_padding is not True

    def keys_up_to(self, kv_len: int) -> "FocusPattern":
        """The pattern over `kv_len` keys: keys past `key_groups` (decoding steps still waiting) in no group yet and
        not sinks (`routing.waiting_keys`)."""
        if self.key_groups.shape[1] >= kv_len:
            return self
        key_groups, key_sink = waiting_keys(self.key_groups, self.key_sink, kv_len)
        return replace(self, key_groups=key_groups, key_sink=key_sink)

    def later_queries(self, first: int) -> "FocusPattern":
        """The pattern of the call's queries from the `first`-th on (the keys unchanged)."""
        mask = None if self.model_mask is None else self.model_mask[..., first:, :]
        return replace(self, query_groups=self.query_groups[:, first:], model_mask=mask)

    def key_valid(self, batch: int) -> Optional[torch.Tensor]:
        """Bool [batch, kv]: the real keys of a causal + padding mask (None: no mask). The last query follows every
        key, so its row of the mask hides exactly the padding keys."""
        return None if self.model_mask is None else self.model_mask[:, 0, -1, :].expand(batch, -1)

    def probes_every_group(self) -> bool:
        """Whether every query probes all K groups: the pattern is then plain causal attention."""
        return probes_every_group(self.query_groups, self.num_groups)


def soft_gate(
    query_probs: torch.Tensor,
    key_probs: torch.Tensor,
    key_sink: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int,
    floor: float,
) -> torch.Tensor:
    """Additive float32 gate [batch, q, kv]: 0 for local and sink pairs, log(p_i . p_j) for the others.

    Causality is not applied here: the caller's mask removes future keys.
    """
    same_group = torch.einsum("bqg,bkg->bqk", query_probs.float(), key_probs.float())
    gate = same_group.clamp_min(floor).log()
    free = (pair_distance(query_positions, key_positions) <= window)[None] | key_sink[:, None, :]
    return gate.masked_fill(free, 0.0)
