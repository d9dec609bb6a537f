"""The routing record of each cached token, paged like vLLM's KV cache and addressed through the same block table.

For exact routing later, a layer needs two things per cached token: its group as a key, and the causal Sinkhorn
state after it (`RoutingState.column_lse`: the running log column sums of every iteration), from which routing
resumes when a later call starts right after that token - the next chunk of a chunked prefill, a decoding step, a
prompt that hits the prefix cache, a request recomputed after preemption. Both are functions of the tokens up to
that one only (routing is causal), so a block holds the same record whichever request computed it, exactly as its
keys and values: the record lives in slot `block_id * block_size + offset`, the slot vLLM writes the token's keys to.

Sinks need no record: vLLM holds no padding, so a token is a sink iff its position is below `sink_tokens`.
"""

from __future__ import annotations

import torch


class SideCache:
    """One layer's records: a float32 table [slots, 1 + iterations * K]: column 0 the token's key group (small
    integers are exact in float32), then its column sums after it, by iteration then group."""

    def __init__(self, num_blocks: int, block_size: int, iterations: int, groups: int, device: torch.device) -> None:
        self.block_size = block_size
        self.iterations = iterations
        self.groups = groups
        self.table = torch.zeros(num_blocks * block_size, 1 + iterations * groups, device=device)

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def fits(self, num_blocks: int, block_size: int) -> bool:
        """Whether this cache covers a KV cache of `num_blocks` blocks of `block_size` (vLLM allocates it once)."""
        return self.block_size == block_size and self.table.shape[0] == num_blocks * block_size

    def slots(self, block_row: torch.Tensor, length: int) -> torch.Tensor:
        """Slots [length] of positions 0 .. length - 1 of the request whose block-table row is `block_row`."""
        positions = torch.arange(length, device=block_row.device)
        return block_row[positions // self.block_size].long() * self.block_size + positions % self.block_size

    def write(self, slots: torch.Tensor, key_groups: torch.Tensor, column_lse: torch.Tensor) -> None:
        """Record new tokens: slots [n], their key groups [n], their column sums [n, iterations, K]."""
        self.table[slots, 0] = key_groups.to(self.table.dtype)
        self.table[slots, 1:] = column_lse.reshape(len(slots), -1).to(self.table.dtype)

    def key_groups(self, slots: torch.Tensor) -> torch.Tensor:
        """Key groups [n] (int64) of the tokens in `slots`."""
        return self.table[slots, 0].long()

    def column_lse(self, slot: torch.Tensor) -> torch.Tensor:
        """[1, iterations, K]: the Sinkhorn column sums after the token in `slot` (where routing resumes)."""
        return self.table[slot, 1:].reshape(1, self.iterations, self.groups)
