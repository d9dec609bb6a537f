"""FlexAttention block masks as the GPU path builds them, and the contract every one of them keeps.

A FlexAttention call reads, for each block of BLOCK queries, the key blocks its block mask lists: those listed as
partial with `mask_mod` applied pair by pair, those listed as full without it. The kernels take these lists on trust:
torch's compiled CUDA kernel indexes them with strides it assumes, and a list outside the rules below returned wrong
numbers in float32 and an illegal memory access in float16 (which ends every later CUDA call of the process), where
torch's compiled CPU kernel refuses the narrow ones at compile time. So the rules are stated once, here, and every
block mask the path builds is held to them before any kernel sees it: rules 1-2 checked on the host
(`check_block_lists(values=False)` in `GpuKernels.flex`, shapes only), rules 3-4 enforced on the device by clamping the
values into range before the CUDA kernel's call (`enforce_block_lists` in `flex.cuda_flex`) - reading them would wait
for the device, a sync per call that no CUDA graph can capture. A list that broke rule 3 or 4 would then read other
blocks (wrong numbers, never a fault), which the tests and `verify` see: they check every rule's values on the lists
as built (`check_block_lists`, `full_blocks_visible`, `mask_outside_lists`).

1. **shape**: counts [batch, q_blocks] and indices [batch, q_blocks, width] with q_blocks = ceil(q_len / BLOCK)
   (the query-block dimension covers the queries) and width >= ceil(kv_len / BLOCK) (the key-block dimension covers
   the keys: torch's kernels derive the number of key blocks from the width);
2. **dtype and layout**: int32 and contiguous (the kernels read rows by strides of a contiguous tensor);
3. **counts**: 0 <= count <= min(width, ceil(kv_len / BLOCK)) (a count past the key blocks reads beyond the keys);
4. **indices**: every entry, listed or not, in [0, ceil(kv_len / BLOCK)) (the kernels prefetch the entry after
   the last listed one);
5. **full blocks**: listed as full only where every pair of the block is visible (`full_blocks_visible`, which
   evaluates `mask_mod` over each full block: run in the tests and by `verify`, not on every call);
6. **mask_mod says everything**: the block lists are a sparsity hint only - a pair outside them is never one the
   pattern allows - so that FlexAttention run eagerly (which ignores the lists and applies `mask_mod` to every pair)
   gives the same answer as the compiled kernel. Rule 6 is kept by construction (`pair_rule`) and tested.

A violation is a `BlockMaskContractError` naming its rule; nothing half-run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from focus_hf.errors import FocusRuntimeError

BLOCK = 128  # FlexAttention's block of queries and of keys


class BlockMaskContractError(FocusRuntimeError):
    """A block mask the GPU path built breaks FlexAttention's contract (a bug in focus_hf: please report it)."""


@dataclass(frozen=True)
class BlockLists:
    """A FlexAttention block mask by its block lists: query block r reads key blocks `kv_indices[b, r, :n]`, n =
    `kv_num_blocks[b, r]`, applying `mask_mod(b, h, q_index, kv_index) -> bool` there, and key blocks
    `full_indices[b, r, :full_num_blocks[b, r]]` whole (None: none). Int32, contiguous, and as wide as the key blocks
    (`check_block_lists`)."""

    kv_num_blocks: torch.Tensor  # [batch, q_blocks]
    kv_indices: torch.Tensor  # [batch, q_blocks, width >= key blocks]
    full_num_blocks: Optional[torch.Tensor]
    full_indices: Optional[torch.Tensor]
    mask_mod: Callable
    q_len: int
    kv_len: int

    @property
    def q_blocks(self) -> int:
        return blocks_of(self.q_len)

    @property
    def kv_blocks(self) -> int:
        return blocks_of(self.kv_len)


def blocks_of(length: int) -> int:
    """How many blocks of BLOCK cover `length` positions."""
    return -(-length // BLOCK)


def _broken(rule: str, detail: str) -> BlockMaskContractError:
    return BlockMaskContractError(
        f"FlexAttention block mask breaks the rule '{rule}': {detail}. This is a bug in focus_hf's GPU path: please "
        "report it with the call's shapes; set_routing(model, 'hard', backend='reference') runs the exact reference."
    )


def _check_lists(name: str, counts: torch.Tensor, indices: torch.Tensor, blocks: BlockLists, values: bool) -> None:
    batch = counts.shape[0] if counts.dim() == 2 else None
    if counts.dim() != 2 or indices.dim() != 3 or indices.shape[:2] != counts.shape:
        raise _broken(
            "shape",
            f"{name} counts {tuple(counts.shape)} and indices {tuple(indices.shape)} are not "
            "[batch, q_blocks] and [batch, q_blocks, width]",
        )
    if counts.shape[1] != blocks.q_blocks:
        raise _broken(
            "shape",
            f"{name} lists {counts.shape[1]} query blocks for {blocks.q_len} queries "
            f"({blocks.q_blocks} blocks of {BLOCK})",
        )
    if indices.shape[2] < blocks.kv_blocks:
        raise _broken(
            "shape",
            f"{name} indices are {indices.shape[2]} wide for {blocks.kv_len} keys: the key-block "
            f"dimension must cover the keys (width >= {blocks.kv_blocks})",
        )
    for tensor, what in ((counts, "counts"), (indices, "indices")):
        if tensor.dtype != torch.int32:
            raise _broken("dtype and layout", f"{name} {what} are {tensor.dtype}, not torch.int32")
        if not tensor.is_contiguous():
            raise _broken("dtype and layout", f"{name} {what} are not contiguous (strides {tensor.stride()})")
    if not values or batch == 0:
        return
    # One read of the device for both rules (each read waits for every queued kernel); which rule broke, on a breach.
    counts_out = (counts < 0).any() | (counts > blocks.kv_blocks).any()
    indices_out = (indices < 0).any() | (indices >= blocks.kv_blocks).any() if indices.numel() else counts_out & False
    broken = torch.stack([counts_out, indices_out]).tolist()
    if broken[0]:
        raise _broken(
            "counts",
            f"{name} counts range over [{int(counts.min())}, {int(counts.max())}], outside "
            f"[0, {blocks.kv_blocks}] key blocks",
        )
    if broken[1]:
        raise _broken(
            "indices",
            f"{name} indices range over [{int(indices.min())}, {int(indices.max())}], outside "
            f"[0, {blocks.kv_blocks}) key blocks",
        )


def check_block_lists(blocks: BlockLists, *, values: bool = True) -> None:
    """Raise `BlockMaskContractError` naming the first rule of the module's contract that `blocks` breaks (rules 1-4;
    rule 5 is `full_blocks_visible`'s). `values=False` checks the shapes, dtypes and layouts only, which reads no
    data (no device sync)."""
    _check_lists("partial", blocks.kv_num_blocks, blocks.kv_indices, blocks, values)
    if (blocks.full_num_blocks is None) != (blocks.full_indices is None):
        raise _broken("shape", "full counts and full indices must be given together")
    if blocks.full_num_blocks is not None:
        _check_lists("full", blocks.full_num_blocks, blocks.full_indices, blocks, values)


def enforce_block_lists(blocks: BlockLists) -> None:
    """Rules 3-4 on the device, in place and without reading it: counts clamped to [0, min(width, key blocks)],
    indices to [0, key blocks)."""
    last = max(blocks.kv_blocks - 1, 0)
    lists = [(blocks.kv_num_blocks, blocks.kv_indices), (blocks.full_num_blocks, blocks.full_indices)]
    for counts, indices in lists:
        if counts is not None:
            counts.clamp_(0, min(indices.shape[-1], blocks.kv_blocks))
            indices.clamp_(0, last)


def listed_blocks(counts: torch.Tensor, indices: torch.Tensor, kv_blocks: int) -> torch.Tensor:
    """Bool [batch, q_blocks, kv_blocks]: which key blocks each query block lists (the first `counts` indices)."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < counts[..., None]
    table = torch.zeros(*counts.shape, kv_blocks + 1, dtype=torch.bool, device=indices.device)
    table.scatter_(-1, torch.where(listed, indices.long().clamp(0, kv_blocks - 1), kv_blocks), True)
    return table[..., :kv_blocks]


def _mask_against(blocks: BlockLists, table: torch.Tensor):
    """For each sample: (its pairs inside the blocks `table` [batch, q_blocks, kv_blocks] marks, those `mask_mod`
    allows), both bool [q_len, kv_len]."""
    device = table.device
    q_index = torch.arange(blocks.q_len, device=device)[:, None]
    kv_index = torch.arange(blocks.kv_len, device=device)[None, :]
    h = torch.zeros((), dtype=torch.long, device=device)
    for sample in range(table.shape[0]):
        pairs = table[sample].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: blocks.q_len, : blocks.kv_len]
        b = torch.full((), sample, dtype=torch.long, device=device)
        yield sample, pairs, blocks.mask_mod(b, h, q_index, kv_index).expand(blocks.q_len, blocks.kv_len)


def _first_pair(pairs: torch.Tensor) -> tuple[int, int]:
    row, column = pairs.nonzero()[0]
    return int(row), int(column)


def full_blocks_visible(blocks: BlockLists) -> Optional[str]:
    """Rule 5: None when `mask_mod` allows every pair of every block listed as full, else where it does not.
    Evaluates `mask_mod` over every pair: for tests and `verify`."""
    if blocks.full_num_blocks is None:
        return None
    for sample, pairs, visible in _mask_against(
        blocks, listed_blocks(blocks.full_num_blocks, blocks.full_indices, blocks.kv_blocks)
    ):
        hidden = pairs & ~visible
        if bool(hidden.any()):
            row, column = _first_pair(hidden)
            return f"sample {sample}: key {column} is listed as full for query {row} but its mask hides it"
    return None


def mask_outside_lists(blocks: BlockLists) -> Optional[str]:
    """Rule 6: None when every pair `mask_mod` allows lies in a block the lists name (partial or full), else the first
    pair that does not - a pair whose meaning the lists alone carry, which FlexAttention run eagerly would see.
    Evaluates `mask_mod` over every pair: for tests and `verify`."""
    listed = listed_blocks(blocks.kv_num_blocks, blocks.kv_indices, blocks.kv_blocks)
    if blocks.full_num_blocks is not None:
        listed = listed | listed_blocks(blocks.full_num_blocks, blocks.full_indices, blocks.kv_blocks)
    for sample, pairs, visible in _mask_against(blocks, listed):
        outside = visible & ~pairs
        if bool(outside.any()):
            row, column = _first_pair(outside)
            return f"sample {sample}: the mask allows key {column} for query {row}, in a block the lists leave out"
    return None


def run_lists(runs: list[tuple[torch.Tensor, torch.Tensor]], kv_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block lists made of runs of consecutive key blocks: for each query block, run i starts at block `start_i` and
    holds `count_i` blocks (tensors broadcastable to [batch, q_blocks]), the runs listed one after the other.
    Returns (counts [batch, q_blocks], indices [batch, q_blocks, kv_blocks]): int32, contiguous, as wide as the key
    blocks, and the entries past each count clamped into range (rules 1-4)."""
    slot = torch.arange(kv_blocks, device=runs[0][0].device, dtype=torch.int32)
    listed = torch.zeros((), dtype=torch.int32, device=slot.device)  # blocks the runs before listed
    indices = None
    for start, count in runs:
        before = listed[..., None]
        following = start.to(torch.int32)[..., None] + slot - before
        indices = following if indices is None else torch.where(slot < before, indices, following)
        listed = listed + count.to(torch.int32)
    indices = indices.clamp_(0, max(kv_blocks - 1, 0)).contiguous()
    return listed.expand(indices.shape[:-1]).contiguous(), indices
