"""The own-group pass of the CPU path in the C kernel, one block of query rows at a time (CPU, float32 and bfloat16).

`partials.probe_part` sorts keys and query entries into segments (sample, group) with tensor operations and holds every
query's partial result and log-sum-exp at once. Here the sorts are counting sorts in C (csrc/segments.c) that write only
their int32 results, and the own-group pass is folded into the output one block of queries at a time
(`native_prefill.prefill_segments`), so that beside its output a call holds the sorted keys (4 bytes per token), one
block's entries and one block's log-sum-exp: a 128K prefill then adds no more to the output than dense SDPA does (whose
kernel holds a log-sum-exp of every query). `cpu_path.sparse_attention` folds the window band into each block before the
next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from focus_hf.attention.cpu.native import NativeKernels
from focus_hf.attention.cpu.native_prefill import address, prefill_kernels, prefill_segments, strides


@dataclass
class SegmentKeys:
    """Keys sorted into segments (s = sample * K + group) for `native_prefill.prefill_segments`, and what the query
    blocks need from them; `fold` runs the blocks in order.

    Attributes:
        key_token: int32 token (sample * kv + position) of each sorted key; a segment's riders come first (with
            top_k = 1 and sinks: its sample's sinks of other groups, which the entries after the sample's last
            sink read, so that their window band sink pairs are done here).
        key_starts: [segments + 1] int64 offsets of each segment's keys.
        riders: [segments] int64 riders in front of each segment's keys, or None: none ride.
        last_sink: [batch] int64 each sample's last sink position (-1: none), or None.
        running: [segments] int64 each segment's valid keys before position `counted`.
        entry_buffers: int32 entry query, row begin and row end of one block, each [batch * block rows * top_k]
            (allocated once: blocks that allocated their own left the heap more fragmented, raising the peak).
        counted: the position the next block's keys are counted from.
        next_row: the first query row of the next block.
    """

    kernels: NativeKernels
    probe_groups: torch.Tensor
    key_groups: torch.Tensor
    key_valid: torch.Tensor
    num_groups: int
    key_token: torch.Tensor
    key_starts: torch.Tensor
    riders: Optional[torch.Tensor]
    last_sink: Optional[torch.Tensor]
    running: torch.Tensor
    entry_buffers: torch.Tensor
    counted: int = 0
    next_row: int = 0

    @classmethod
    def build(
        cls,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        probe_groups: torch.Tensor,
        key_groups: torch.Tensor,
        key_valid: torch.Tensor,
        key_sink: Optional[torch.Tensor],
        num_groups: int,
        block_rows: int,
    ) -> Optional["SegmentKeys"]:
        """Sort the keys of `key_groups` / `key_valid` / `key_sink` [batch, kv] for queries [batch, heads, q, dim]
        probing `probe_groups` [batch, q, top_k] (`probe_part` describes them), in blocks of at most `block_rows`
        queries; `key_sink` given, sinks ride. None where the kernel cannot take the call (its torch path then runs)."""
        kernels = prefill_kernels(query, key, value)
        batch, kv_len = key_groups.shape
        if kernels is None or batch * kv_len >= 2**31:  # int32 tokens
            return None
        segments = batch * num_groups
        key_groups, key_valid = key_groups.long(), key_valid.contiguous()  # groups are read through their strides
        sinks = None if key_sink is None else key_sink.contiguous()
        riders = sinks is not None
        key_starts = torch.empty(segments + 1, dtype=torch.long)
        rider_counts, last_sink = torch.empty(segments, dtype=torch.long), torch.empty(batch, dtype=torch.long)
        key_token = None
        for _ in range(2):  # the first call counts each segment's keys, the second files them
            status = kernels.segment_keys(
                key_groups.data_ptr(),
                strides(key_groups),
                key_valid.data_ptr(),
                address(sinks),
                batch,
                kv_len,
                num_groups,
                address(key_token),
                key_starts.data_ptr(),
                rider_counts.data_ptr(),
                last_sink.data_ptr(),
            )
            if status:
                raise ValueError(f"key groups must lie in 0 .. {num_groups - 1} (the layer's num_groups)")
            if key_token is None:
                key_token = torch.empty(int(key_starts[-1]), dtype=torch.int32)
        return cls(
            kernels=kernels,
            probe_groups=probe_groups.long(),
            key_groups=key_groups,
            key_valid=key_valid,
            num_groups=num_groups,
            key_token=key_token,
            key_starts=key_starts,
            riders=rider_counts if riders else None,
            last_sink=last_sink if riders else None,
            running=torch.zeros(segments, dtype=torch.long),
            entry_buffers=torch.empty(3, batch * block_rows * probe_groups.shape[2], dtype=torch.int32),
        )

    def fold(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        start: int,
        end: int,
        output: torch.Tensor,
        lse: torch.Tensor,
        scaling: float,
        scratch: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """Fold the own-group pass of query rows start .. end - 1 (of query [batch, heads, q, dim]; blocks in order)
        into float32 `output` [batch, end - start, heads, dim] and `lse` [batch, end - start, heads] (`scratch`:
        `native_prefill.packing_scratch`). Returns bool [batch, end - start] marking the queries whose sink pairs rode
        here, or None where no sink rides."""
        batch, kv_len = self.key_groups.shape
        q_len, top_k = self.probe_groups.shape[1], self.probe_groups.shape[2]
        rows = end - start
        if start != self.next_row or not 0 < rows <= self.entry_buffers.shape[1] // (batch * top_k):
            raise ValueError(
                f"blocks of the own-group pass run in order, at most the rows they were built for: got {start}..{end}"
            )
        entry_starts = torch.empty(batch * self.num_groups + 1, dtype=torch.long)
        entry_query, row_begin, row_end = self.entry_buffers
        rides = None if self.riders is None else torch.empty(batch, rows, dtype=torch.bool)
        status = self.kernels.segment_entries(
            self.probe_groups.data_ptr(),
            strides(self.probe_groups),
            self.key_groups.data_ptr(),
            strides(self.key_groups),
            self.key_valid.data_ptr(),
            batch,
            kv_len,
            q_len,
            self.num_groups,
            top_k,
            start,
            rows,
            self.running.data_ptr(),
            self.counted,
            address(self.riders),
            address(self.last_sink),
            entry_starts.data_ptr(),
            entry_query.data_ptr(),
            row_begin.data_ptr(),
            row_end.data_ptr(),
            address(rides),
        )
        if status:
            raise ValueError(f"probed groups must lie in 0 .. {self.num_groups - 1} (the layer's num_groups)")
        self.counted, self.next_row = kv_len - q_len + end, end
        count = int(entry_starts[-1])
        done = prefill_segments(
            query[:, :, start:end],
            key,
            value,
            output.transpose(1, 2),
            lse.transpose(1, 2),
            entry_starts,
            self.key_starts,
            entry_query[:count],
            self.key_token,
            row_begin[:count],
            row_end[:count],
            scaling,
            scratch,
        )
        if not done:  # `build` asked the same kernels; a call they refuse here is a bug, not a fallback
            raise RuntimeError("the C kernel refused a call of the own-group pass that it had accepted")
        return rides
