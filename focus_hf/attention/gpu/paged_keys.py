"""A group-sorted, paged copy of a batch's keys and values on the device, for one-query decoding steps on the GPU.

A decoding step may attend to its window (the last `window + 1` keys), the sinks, and the distant keys of the groups
it probes. `PagedKeys` lays a batch's keys out so that one FlexAttention call reads just those: every slot of its
buffers `keys` / `values` [batch, kv_heads, slots + 1, dim] (the last a scratch slot) is either

- in the ring (the first RING slots): the newest positions, p in slot p % RING - every position not filed yet, which
  is the window and at most FILE_EVERY - 1 positions beyond it; or
- on a page of PAGE slots owned by one group - or by the sinks, owner K - holding that owner's distant keys in
  position order (`page_table[b, g, i]` is the i-th page of owner g, `count[b, g]` its filled slots).

`position[b, s]` is the token position in slot s, -1 for an empty slot or padding. A step (`decode_blocks`) lists
the ring's pages, the sinks' pages and its probed groups' pages; its mask (`pair_rule`) keeps a filled slot when its
key is within the window, a sink or of a probed group - read from the routing's groups, so tokens routed late are
seen as they are routed now - whether or not its page is listed: the lists only spare the kernel the other pages.

What a step does is a function of its key count n alone, so that under torch.compile a step is one graph with no
data-dependent control (two variants: with and without filing): it writes its own key into the ring (one copy) and,
when n crosses a multiple of FILE_EVERY beyond the window, files the FILE_EVERY positions that have left it into
their owners' pages (a few small operations, amortised). A store that did not see the previous step (a fresh cache,
a multi-token call, a new window) is rebuilt by one bulk filing (`refresh`).

The copy is a pure function of the cache's keys, the routing's groups and sinks and the key padding, all of which
are fixed once a position is beyond the window; it doubles the routed heads' KV memory (off with
`set_routing(decode_copy=False)`).
"""

from __future__ import annotations

from typing import Optional

import torch

from focus_hf.attention.gpu.block_masks import BLOCK, BlockLists, blocks_of
from focus_hf.attention.gpu.pair_rule import make_rule, rule_mask

PAGE = BLOCK  # slots of a page: one FlexAttention key block
# Positions filed into their groups' pages at a time: a step that files runs a few dozen small operations more.
FILE_EVERY = 128
# Buffers grow to this factor of the pages they must hold.
GROWTH = 1.5


def filed_before(n: int, window: int) -> int:
    """Positions below this are filed into pages when a step sees n keys: the largest multiple of FILE_EVERY that is
    farther than the window from the newest key (n - 1)."""
    return max(0, (n - 1 - window) // FILE_EVERY * FILE_EVERY)


class PagedKeys:
    """The paged copy of one batch's keys for one run of kv heads of one layer (see the module docstring).

    Args:
        num_groups: K.
        window: the local window w the copy was built for (a step with another window rebuilds it).
    """

    def __init__(self, num_groups: int, window: int) -> None:
        self.num_groups = num_groups
        self.window = window
        self.ring = -(-(window + FILE_EVERY) // PAGE) * PAGE  # holds every position not filed yet
        self.fresh = True  # nothing filed yet, or the copy must be rebuilt
        self.capacity = 0  # pages per sample
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.position: Optional[torch.Tensor] = None  # [batch, slots + 1] int64
        self.page_table: Optional[torch.Tensor] = None  # [batch, K + 1, capacity + 1] (the last column: scratch)
        self.count: Optional[torch.Tensor] = None  # [batch, K + 1]
        self.pages_used: Optional[torch.Tensor] = None  # [batch]

    @property
    def slots(self) -> int:
        return self.ring + self.capacity * PAGE

    def invalidate(self) -> None:
        """Rebuild at the next step (its cache changed other than by one appended key)."""
        self.fresh = True

    def _allocate(self, key: torch.Tensor, pages: int) -> None:
        """Buffers for `pages` pages per sample, keeping what is filed."""
        batch, kv_heads, _, dim = key.shape
        old_slots = self.slots if self.keys is not None else 0
        keys = key.new_zeros(batch, kv_heads, self.ring + pages * PAGE + 1, dim)
        values = key.new_zeros(batch, kv_heads, self.ring + pages * PAGE + 1, dim)
        position = torch.full((batch, self.ring + pages * PAGE + 1), -1, dtype=torch.long, device=key.device)
        table = torch.zeros(batch, self.num_groups + 1, pages + 1, dtype=torch.long, device=key.device)
        if self.keys is not None and not self.fresh:
            keys[:, :, :old_slots] = self.keys[:, :, :old_slots]
            values[:, :, :old_slots] = self.values[:, :, :old_slots]
            position[:, :old_slots] = self.position[:, :old_slots]
            table[:, :, : self.capacity] = self.page_table[:, :, : self.capacity]
        self.keys, self.values, self.position, self.page_table = keys, values, position, table
        self.capacity = pages

    def update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_groups: torch.Tensor,
        key_sink: torch.Tensor,
        key_valid: Optional[torch.Tensor],
        window: int,
    ) -> None:
        """Bring the copy up to a one-query step over key/value [batch, kv_heads, n, dim] (the query is the n-th key),
        with each key's group and sink flag [batch, n] and padding (None: none)."""
        n = key.shape[2]
        if window != self.window:
            self.__init__(self.num_groups, window)
        if key_valid is None:
            key_valid = torch.ones_like(key_sink)
        target = filed_before(n, window)
        needed = -(-target // PAGE) + self.num_groups + 1
        if self.keys is None or self.fresh or needed > self.capacity or self.keys.shape[0] != key.shape[0]:
            self.refresh(key, value, key_groups, key_sink, key_valid, max(needed, int(needed * GROWTH)))
            return
        previous = filed_before(n - 1, window)
        if target > previous:
            self._file(key, value, key_groups, key_sink, key_valid, previous, target)
        self._write_ring(key, value, key_valid, n - 1, n)

    def refresh(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_groups: torch.Tensor,
        key_sink: torch.Tensor,
        key_valid: torch.Tensor,
        pages: int,
    ) -> None:
        """Rebuild from the cache: file every position below `filed_before(n)`, ring the rest."""
        n = key.shape[2]
        self.fresh = True
        self._allocate(key, pages)
        batch, device = key.shape[0], key.device
        self.count = torch.zeros(batch, self.num_groups + 1, dtype=torch.long, device=device)
        self.pages_used = torch.zeros(batch, dtype=torch.long, device=device)
        self.position.fill_(-1)
        target = filed_before(n, self.window)
        if target:
            self._file(key, value, key_groups, key_sink, key_valid, 0, target)
        self._write_ring(key, value, key_valid, target, n)
        self.fresh = False

    def _write_ring(
        self, key: torch.Tensor, value: torch.Tensor, key_valid: torch.Tensor, begin: int, end: int
    ) -> None:
        """Copy positions begin .. end - 1 (at most RING of them) into their ring slots."""
        positions = torch.arange(begin, end, device=key.device)
        slots = positions % self.ring
        self.keys[:, :, slots] = key[:, :, begin:end]
        self.values[:, :, slots] = value[:, :, begin:end]
        self.position[:, slots] = torch.where(key_valid[:, begin:end], positions, -1)

    def _file(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_groups: torch.Tensor,
        key_sink: torch.Tensor,
        key_valid: torch.Tensor,
        begin: int,
        end: int,
    ) -> None:
        """File positions begin .. end - 1 into their owners' pages (the sinks' owner is K; padding goes nowhere),
        allocating pages as owners fill theirs, and empty their ring slots."""
        batch, device = key.shape[0], key.device
        owners = self.num_groups + 1
        scratch_owner = owners  # padding: counted apart, written to the scratch slot
        groups = key_groups[:, begin:end]
        owner = torch.where(key_sink[:, begin:end], self.num_groups, groups)
        owner = torch.where(key_valid[:, begin:end], owner, scratch_owner)
        # Each position's owner as a column of [batch, m, owners + 1]: a comparison (torch's one_hot reads the values'
        # range from the device to check it, except on CUDA).
        one_hot = (owner[..., None] == torch.arange(owners + 1, device=device)).long()
        rank = (one_hot.cumsum(dim=1) * one_hot).sum(dim=-1) - 1  # each position's rank among its owner's
        added = one_hot[..., :owners].sum(dim=1)  # [batch, owners]
        pages_before = -(-self.count // PAGE)
        pages_after = -(-(self.count + added) // PAGE)
        allocated = pages_after - pages_before
        first_page = self.pages_used[:, None] + allocated.cumsum(dim=1) - allocated  # each owner's first new page
        new_pages = -(-(end - begin) // PAGE) + 1
        step = torch.arange(new_pages, device=device)
        column = torch.where(step < allocated[..., None], pages_before[..., None] + step, self.capacity)
        self.page_table.scatter_(2, column, first_page[..., None] + step)
        self.page_table[:, :, self.capacity] = 0  # the scratch column
        in_owner = self.count.gather(1, owner.clamp(max=owners - 1)) + rank
        sample = torch.arange(batch, device=device)[:, None]
        page = self.page_table[sample, owner.clamp(max=owners - 1), in_owner // PAGE]
        slots = self.ring + page * PAGE + in_owner % PAGE
        slots = torch.where(owner < owners, slots, self.slots)  # padding: the scratch slot
        positions = torch.arange(begin, end, device=device)
        self.keys[sample, :, slots] = key[:, :, begin:end].transpose(1, 2)
        self.values[sample, :, slots] = value[:, :, begin:end].transpose(1, 2)
        self.position[sample, slots] = positions.expand(batch, -1)
        self.position[:, self.slots] = -1
        self.count += added
        self.pages_used += allocated.sum(dim=1)
        ring = self.position[:, : self.ring]
        ring.masked_fill_(ring < end, -1)  # filed now: read from the pages

    def decode_blocks(
        self, query_groups: torch.Tensor, key_groups: torch.Tensor, key_sink: torch.Tensor, n: int
    ) -> BlockLists:
        """The block lists of a one-query step over n keys whose query probes `query_groups` [batch, top_k]: the
        ring's pages, the sinks' pages, then each probed group's pages (a slot repeating the first probe, or a group
        -1, lists none)."""
        batch, top_k = query_groups.shape
        device = query_groups.device
        ring_pages = self.ring // PAGE
        probed = query_groups.clamp(min=0)
        listed = torch.ones_like(query_groups, dtype=torch.bool)
        listed[:, 1:] = query_groups[:, 1:] != query_groups[:, :1]
        listed &= query_groups >= 0
        owners = torch.cat([torch.full((batch, 1), self.num_groups, device=device, dtype=probed.dtype), probed], 1)
        pages = -(-self.count.gather(1, owners) // PAGE)  # [batch, 1 + top_k]
        pages[:, 1:] *= listed
        start = ring_pages + pages.cumsum(dim=1) - pages
        width = ring_pages + (1 + top_k) * self.capacity
        step = torch.arange(self.capacity, device=device)
        target = torch.where(step < pages[..., None], start[..., None] + step, width)  # [batch, 1 + top_k, capacity]
        lists = self.page_table.gather(1, owners[..., None].expand(-1, -1, self.capacity + 1))[..., : self.capacity]
        indices = torch.zeros(batch, width + 1, dtype=torch.long, device=device)
        indices[:, :ring_pages] = torch.arange(ring_pages, device=device)
        indices.scatter_(1, target.flatten(1), (lists + ring_pages).flatten(1))
        count = ring_pages + pages.sum(dim=1)
        # The lists cover every key block (FlexAttention's contract) and are contiguous rows.
        kv_len = self.slots + 1
        columns = max(width, blocks_of(kv_len))
        lists = torch.zeros(batch, columns, dtype=torch.int32, device=device)
        lists[:, :width] = indices[:, :width]
        # The mask says everything: a slot's key is visible iff it is filled and within the window, a sink or of a
        # probed group - pages of other groups are not listed, but the mask would hide them too.
        safe = self.position.clamp(min=0)
        rule = make_rule(
            (
                torch.full((batch, 1), n - 1, dtype=torch.long, device=device),
                probed.new_zeros(batch, 1),
                query_groups[:, None, :],
            ),
            (self.position, key_groups.gather(1, safe), key_sink.gather(1, safe)),
            self.window,
            (True, True),
            None,
        )
        return BlockLists(count[:, None].int(), lists[:, None], None, None, rule_mask(rule), 1, kv_len)
