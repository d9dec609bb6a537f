"""The routing record of each cached token, paged like vLLM's KV cache and addressed through the same block table.

For exact routing later, a layer needs each cached token's group as a key, and the causal Sinkhorn state
(`RoutingState.column_lse`: the running log column sums of every iteration) after the token a later call starts
right after - the next chunk of a chunked prefill, a decoding step, a prompt that hits the prefix cache, a request
recomputed after preemption. Both are functions of the tokens up to that one only (routing is causal), so a block
holds the same record whichever request computed it, exactly as its keys and values: a token's group lives in slot
`block_id * block_size + offset`, the slot vLLM writes the token's keys to.

A call always starts right after the last token written to its block: tokens fill a block in order, a chunk or
step continues its request's last one, and a prefix-cache hit ends on a whole block (vLLM caches whole blocks
only). So each block keeps one state, the one after its last token so far (and that token's offset, checked on
resuming): 4 bytes per slot and (1 + iterations x K) x 4 bytes per block, instead of the state of every token.

Sinks need no record: vLLM holds no padding, so a token is a sink iff its position is below `sink_tokens`.
"""

from __future__ import annotations

from typing import Optional

import torch

from focus_hf.attention.cpu.native_decode import route_token
from focus_hf.attention.routing import causal_sinkhorn, token_groups
from focus_hf.errors import FocusRuntimeError


class SideCache:
    """One layer's records: each slot's key group (int32 [slots], which the decoding kernel reads in place, slot by
    slot as it reads the keys) and each block's state after its last token so far (float32 [blocks, 1 + iterations
    * K]: that token's offset in the block, then the column sums by iteration then group)."""

    def __init__(self, num_blocks: int, block_size: int, iterations: int, groups: int, device: torch.device) -> None:
        self.block_size = block_size
        self.iterations = iterations
        self.groups = groups
        self.slot_groups = torch.zeros(num_blocks * block_size, dtype=torch.int32, device=device)
        self.table = torch.full((num_blocks, 1 + iterations * groups), -1.0, device=device)

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in (self.slot_groups, self.table))

    def fits(self, num_blocks: int, block_size: int) -> bool:
        """Whether this cache covers a KV cache of `num_blocks` blocks of `block_size` (vLLM allocates it once)."""
        return self.block_size == block_size and self.table.shape[0] == num_blocks

    def slots(self, block_row: torch.Tensor, end: int, start: int = 0) -> torch.Tensor:
        """Slots [end - start] of positions start .. end - 1 of the request whose block-table row is `block_row`."""
        positions = torch.arange(start, end, device=block_row.device)
        return block_row[positions // self.block_size].long() * self.block_size + positions % self.block_size

    def slot(self, block_row: torch.Tensor, position: int) -> int:
        """The slot of one position (`slots` without tensors: a decoding step's few scalars cost less so)."""
        return int(block_row[position // self.block_size]) * self.block_size + position % self.block_size

    def write(self, block_row: torch.Tensor, start: int, key_groups: torch.Tensor, column_lse: torch.Tensor) -> None:
        """Record the new tokens at positions start, start + 1, ... of the request whose block-table row is
        `block_row`: their key groups [n] and the column sums after each [n, iterations, K] (each block keeps those
        after its last token)."""
        if len(key_groups) == 1:  # a decoding step: scalars, a third of the tensor operations
            slot = self.slot(block_row, start)
            block = slot // self.block_size
            self.slot_groups[slot] = key_groups[0]
            self.table[block, 0] = slot % self.block_size
            self.table[block, 1:] = column_lse.reshape(-1)
            return
        slots = self.slots(block_row, start + len(key_groups), start)
        self.slot_groups[slots] = key_groups.to(torch.int32)
        blocks = slots // self.block_size
        last = torch.ones_like(blocks, dtype=torch.bool)
        last[:-1] = blocks[1:] != blocks[:-1]
        offsets = (slots[last] % self.block_size)[:, None].to(self.table.dtype)
        sums = column_lse[last].reshape(-1, self.iterations * self.groups).to(self.table.dtype)
        self.table[blocks[last]] = torch.cat([offsets, sums], dim=1)

    def route_token(
        self,
        block_row: torch.Tensor,
        position: int,
        key_scores: torch.Tensor,
        query_scores: Optional[torch.Tensor],
        top_k: int,
        probe_mass: Optional[float],
    ) -> torch.Tensor:
        """Route a request's newest token (at `position`, after the one before it) from this cache and record it here:
        the operations `routing.route_tokens` runs on one token, in one C call (`native_decode.route_token`), or in
        torch where the kernel cannot run. Returns the groups it probes [top_k].

        Args:
            key_scores, query_scores: float32 [K] the token's router scores (query_scores None: no query router).
        """
        resume = self.column_lse(block_row, position - 1)
        slot = self.slot(block_row, position)
        record = self.table[slot // self.block_size]
        routed = route_token(key_scores, query_scores, resume.reshape(-1), record[1:], top_k, probe_mass)
        if routed is None:  # no C kernel: the same operations in torch (`resume` is read before `record` is written)
            log_probs, column_lse = causal_sinkhorn(key_scores[None, None], _ONE_VALID_TOKEN, self.iterations, resume)
            scores = None if query_scores is None else query_scores[None, None]
            top_groups, key_groups, _ = token_groups(log_probs, scores, top_k, probe_mass)
            routed = top_groups[0, 0], key_groups[0, 0]
            record[1:] = column_lse.reshape(-1)
        probes, key_group = routed
        self.slot_groups[slot] = key_group
        record[0] = slot % self.block_size
        return probes

    def key_groups(self, slots: torch.Tensor) -> torch.Tensor:
        """Key groups [n] (int64) of the tokens in `slots`."""
        return self.slot_groups[slots].long()

    def column_lse(self, block_row: torch.Tensor, position: int) -> torch.Tensor:
        """[1, iterations, K]: the Sinkhorn column sums after the token at `position` of the request whose
        block-table row is `block_row`, from which routing resumes (the last token written to its block)."""
        slot = self.slot(block_row, position)
        record = self.table[slot // self.block_size]
        if int(record[0]) != slot % self.block_size:
            raise FocusRuntimeError(
                f"focus_hf.vllm: routing should resume after position {position}, but its block's last routed token "
                f"is at offset {int(record[0])}, not {slot % self.block_size}: the engine resumed a request where "
                "Focus keeps no state (a prefix-cache hit inside a block?). Please report this with the vLLM version "
                "and engine options."
            )
        return record[1:].reshape(1, self.iterations, self.groups)


_ONE_VALID_TOKEN = torch.ones(1, 1, dtype=torch.bool)  # the `valid` of one decoding token's routing (read only)
