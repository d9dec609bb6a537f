"""A group-sorted copy of the distant keys and values, so that a decoding step reads its probed groups as slices.

A decoding step of one sample may attend to its window (the last `window + 1` keys, a slice of the KV cache), the
sinks, and the distant keys of the groups it probes. In the KV cache those distant keys are scattered, and gathering
them costs a read and a write of each (plus a pass to find them) - about as much as attending to all keys until the
cache is long. `GroupedKeys` keeps, for each group, the sinks followed by that group's keys and values in position
order, for every position farther than the window from the newest query. Each step appends the one position that
has just left the window (amortised growth), so a step reads exactly the keys it may attend to, with no gather and
no mask: its probed groups' buffers and the window, read where they lie by one call of the C kernel of `native` (or,
without it, the window copied behind the first group's keys so that the two are one attention call).

One `GroupedKeys` serves one sample and one run of kv heads of one layer (a batch keeps one per sample). It
costs a second copy of those keys and values (up to GROWTH times their size while a buffer grows). The copy is a
pure function of the cache's keys, the routing's key groups, sinks and the key padding, all of which are fixed once
a position is farther than the window; whoever holds it must drop it when the cache is cropped, reordered or reset
(`tuner.layer` ties it to one cache and stops using it once the cache reorders its samples).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from focus_hf.attention.cpu.native_decode import (
    STEP_APPENDED,
    STEP_FULL,
    STEP_UNROUTED,
    GroupTables,
    attend_runs,
    copy_row,
    grouped_fill,
    grouped_step,
)

# Buffers grow to this factor of what they must hold (amortised appends), and start at MIN_CAPACITY slots.
GROWTH = 1.5
MIN_CAPACITY = 256


class GroupedKeys:
    """Keys and values [kv_heads, slots, dim] of every group, each buffer being the sinks, then the group's keys,
    in position order, for positions below `filled` (padding left out).

    Args:
        num_groups: K.
    """

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.filled = 0  # positions taken in (each appended to its group's buffer, or left out as padding)
        self.sinks = 0  # sinks at the front of every buffer
        # The buffers as the C kernel reads them (`native_decode.grouped_step`), which appends to them too.
        self.tables = GroupTables(num_groups)
        self.counts = self.tables.counts  # filled slots of each buffer, sinks included
        self.keys: list[Optional[torch.Tensor]] = [None] * num_groups
        self.values: list[Optional[torch.Tensor]] = [None] * num_groups

    def mark(self) -> tuple[int, int, tuple[int, ...]]:
        """The fill level, for `reset_to`."""
        return self.filled, self.sinks, tuple(self.counts)

    def reset_to(self, mark: tuple[int, int, tuple[int, ...]]) -> None:
        """Return to an earlier fill level (slots beyond it are overwritten by the next `extend`). Benchmarks use it
        to time the same decoding step, its append included, again and again."""
        self.filled, self.sinks, counts = mark
        self.counts[:] = counts

    def extend(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_groups: torch.Tensor,
        key_sink: torch.Tensor,
        key_valid: Optional[torch.Tensor],
        upto: int,
    ) -> bool:
        """Take in positions `filled` .. `upto` - 1 of one sample's key/value [kv_heads, n, dim] with their groups,
        sink flags and validity [n] (None: all valid).

        Returns False, taking in nothing, where that cannot be done exactly: a group not yet routed (-1), or a sink
        after other keys; the caller then attends another way."""
        first = self.filled
        if upto <= first:
            return True
        if upto - first == 1:  # a decoding step: one position, its flags read as Python values (no extra tensors)
            valid = key_valid is None or bool(key_valid[first])
            return self.take(key, value, int(key_groups[first]), bool(key_sink[first]), valid)
        span = slice(first, upto)
        groups, sink = key_groups[span], key_sink[span]
        real = torch.ones_like(sink) if key_valid is None else key_valid[span]
        sinks = (sink & real).nonzero().flatten()
        taken = ~sink & real  # the rows that join a group's keys
        members = taken.nonzero().flatten()
        member_groups = groups[members]
        if len(members) and int(member_groups.min()) < 0:
            return False
        if len(sinks):
            if len(members) and int(members[0]) < int(sinks[-1]):
                return False
            position = sinks + first
            if not self._append_sinks(key.index_select(1, position), value.index_select(1, position), 0, len(sinks)):
                return False
        added = torch.bincount(member_groups, minlength=self.num_groups).tolist()
        for group, count in enumerate(added):
            if count:
                self._reserve(group, self.counts[group] + count, key)
        run_keys, run_values = key.narrow(1, first, upto - first), value.narrow(1, first, upto - first)
        if not grouped_fill(self.tables, run_keys, run_values, groups, taken):
            order = torch.sort(member_groups, stable=True).indices
            position = members[order] + first
            sorted_keys, sorted_values = key.index_select(1, position), value.index_select(1, position)
            start = 0
            for group, count in enumerate(added):
                if count:
                    self._append(group, sorted_keys, sorted_values, start, count)
                    start += count
        self.filled = upto
        return True

    def take(self, key: torch.Tensor, value: torch.Tensor, group: int, sink: bool, valid: bool) -> bool:
        """`extend` by the one position `filled` of key/value [kv_heads, n, dim], its group, sink flag and validity
        given as Python values (a decoding step reads those of a batch at once)."""
        position = self.filled
        if valid:
            if sink:
                if not self._append_sinks(key, value, position, 1):
                    return False
            elif group < 0:
                return False
            else:
                self._append(group, key, value, position, 1)
        self.filled = position + 1
        return True

    def step(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sample: int,
        key_groups: torch.Tensor,
        key_sink: torch.Tensor,
        key_valid: Optional[torch.Tensor],
        query_groups: torch.Tensor,
        scale: float,
    ) -> Optional[torch.Tensor]:
        """A decoding step of sample `sample` of key/value [batch, kv_heads, n, dim] (the cache): `take` its key at
        position `filled` (the one that has just left the window; its group, sink flag and validity in key_groups /
        key_sink / key_valid [batch, n]), then `attend` with query [heads, dim] to its probes (query_groups [batch, 1,
        top_k]) and the window, rows `filled` .. n - 1. Returns [heads, dim], or None where the step cannot be served
        exactly (a probe or the key not routed yet; nothing is taken in then).

        One call of the C kernel (`native_decode.grouped_step`) where it takes the step; otherwise, and for a sink, the
        same in Python."""
        position = self.filled
        arguments = (key_groups, key_sink, key_valid, query_groups, scale)
        status = grouped_step(query, self.tables, self.sinks, key, value, sample, position, *arguments)
        if isinstance(status, torch.Tensor):
            self.filled = position + 1
            return status
        keys, values = key[sample], value[sample]
        if status == STEP_FULL:
            group = int(key_groups[sample, position])
            self._reserve(group, self.counts[group] + 1, keys)
            return self.step(query, key, value, sample, *arguments)
        if status == STEP_UNROUTED:
            return None
        probes = list(dict.fromkeys(query_groups[sample, 0].tolist()))  # distinct, best first
        if status != STEP_APPENDED:
            if min(probes) < 0:
                return None
            valid = key_valid is None or bool(key_valid[sample, position])
            if not self.take(keys, values, int(key_groups[sample, position]), bool(key_sink[sample, position]), valid):
                return None
        self.filled = position + 1
        return self.attend(query, keys, values, position + 1, probes, scale)

    def _append_sinks(self, keys: torch.Tensor, values: torch.Tensor, start: int, added: int) -> bool:
        """Sinks go in front of every buffer, so they must come before any group's keys."""
        if any(count != self.sinks for count in self.counts):
            return False
        for group in range(self.num_groups):
            self._append(group, keys, values, start, added)
        self.sinks += added
        return True

    def _append(self, group: int, keys: torch.Tensor, values: torch.Tensor, start: int, added: int) -> None:
        """Append rows start .. start + added - 1 of keys/values [kv_heads, n, dim] to the group's buffers."""
        count = self.counts[group]
        self._reserve(group, count + added, keys)
        # A decoding step's one key: one C call for keys and values, read in place (four tensor operations and two
        # views otherwise).
        if added != 1 or not copy_row(self.keys[group], self.values[group], count, keys, values, start):
            self.keys[group].narrow(1, count, added).copy_(keys.narrow(1, start, added))
            self.values[group].narrow(1, count, added).copy_(values.narrow(1, start, added))
        self.counts[group] = count + added

    def _reserve(self, group: int, slots: int, like: torch.Tensor) -> None:
        """Grow the group's buffers (amortised) until they hold at least `slots`, keeping the filled slots."""
        buffer = self.keys[group]
        if buffer is not None and slots <= buffer.shape[1]:
            return
        capacity = max(MIN_CAPACITY, int(slots * GROWTH))
        count = self.counts[group]
        for store in (self.keys, self.values):
            grown = like.new_empty(like.shape[0], capacity, like.shape[2])
            if store[group] is not None:
                grown[:, :count] = store[group][:, :count]
            store[group] = grown
        self.tables.hold(group, self.keys[group], self.values[group])

    def attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        window_start: int,
        groups: list[int],
        scale: float,
    ) -> torch.Tensor:
        """One query [heads, dim] over the distant keys of `groups` (distinct; sinks counted once) and the window: rows
        window_start .. of the sample's cached keys/values [kv_heads, n, dim]. Returns [heads, dim].

        The CPU kernel (`native_decode.attend_runs`) reads the groups' buffers and the window where they lie, as spans
        (no tensor views: per step they cost more than the kernel's work at short caches). Otherwise the window is
        copied behind the first group's keys, into free slots of its buffer (the next append overwrites them), so that
        the first group and the window are one run of keys: with one group the step is one attention call. Scores of
        several parts share one float32 softmax."""
        first = groups[0]
        count = self.counts[first]
        width = keys.shape[1] - window_start
        spans = [
            (self.keys[group], self.values[group], self.sinks, self.counts[group] - self.sinks) for group in groups[1:]
        ]
        others = [span for span in spans if span[3] > 0]  # the sinks are read once, with the first group
        own = [(self.keys[first], self.values[first], 0, count)] if count else []
        output = attend_runs(query, [*own, *others, (keys, values, window_start, width)], scale)
        if output is not None:
            return output
        kv_heads, dim = keys.shape[0], keys.shape[2]
        window_keys, window_values = keys.narrow(1, window_start, width), values.narrow(1, window_start, width)
        others = [
            (part_keys.narrow(1, start, length), part_values.narrow(1, start, length))
            for part_keys, part_values, start, length in others
        ]
        self._reserve(first, count + width, window_keys)
        keys = self.keys[first].narrow(1, 0, count + width)
        values = self.values[first].narrow(1, 0, count + width)
        keys.narrow(1, count, width).copy_(window_keys)
        values.narrow(1, count, width).copy_(window_values)
        parts = [(keys, values), *others]
        if len(parts) == 1:
            output = F.scaled_dot_product_attention(
                query.reshape(1, -1, 1, dim), keys.unsqueeze(0), values.unsqueeze(0), scale=scale, enable_gqa=True
            )
            return output.view(query.shape)
        rows = query.reshape(kv_heads, -1, dim)  # the query heads of each kv head
        scores = torch.cat([torch.bmm(rows, part_keys.mT) for part_keys, _ in parts], dim=-1)
        if scores.dtype != torch.float32:
            scores = scores.float()
        probs = torch.softmax(scores.mul_(scale), dim=-1)
        if probs.dtype != query.dtype:
            probs = probs.to(query.dtype)
        output, start = None, 0
        for part_keys, part_values in parts:
            end = start + part_keys.shape[1]
            share = probs[..., start:end]
            output = torch.bmm(share, part_values) if output is None else output.baddbmm_(share, part_values)
            start = end
        return output.view(query.shape)


def one_step_behind(
    key: torch.Tensor,
    value: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    num_groups: int,
    window: int,
) -> tuple[GroupedKeys, Callable[[], None]]:
    """For timing a decoding step of one sample (key/value [1, kv_heads, n, dim], groups and sinks [1, n], the query
    the n-th token): a `GroupedKeys` holding every key beyond the window but the newest of them, and a function that
    returns it there - so that each timed step appends that key, as a step of generate() does."""
    grouped = GroupedKeys(num_groups)
    behind = key.shape[2] - 2 - window
    if behind > 0:
        grouped.extend(key[0], value[0], key_groups[0], key_sink[0], None, behind)
    mark = grouped.mark()
    return grouped, lambda: grouped.reset_to(mark)
