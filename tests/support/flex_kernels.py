"""Kernel sets of the GPU path for the CPU tests: each runs the path's FlexAttention calls somewhere else than the
double alone, so that what the path builds is held to what torch's own FlexAttention does with it.

- `strict_twin`: the CPU twin, every block mask first held to the whole contract of `block_masks` (rules 1-6).
- `compiled_cpu_kernels`: torch's compiled CPU FlexAttention kernel - the real kernel, which enforces the contract at
  compile time - for the output, compared call by call with the double; the double's log-sum-exp (torch 2.13
  compiles no log-sum-exp on the CPU).
- `eager_kernels`: FlexAttention uncompiled, which ignores the block lists and applies `mask_mod` to every pair:
  the path equals the reference with it only if every mask says everything.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from focus_hf.attention.gpu.block_masks import (
    BlockLists,
    check_block_lists,
    full_blocks_visible,
    mask_outside_lists,
)
from focus_hf.attention.gpu.flex import attend, block_mask, call_kind, flex_output, run_compiled
from focus_hf.attention.gpu.kernels import GpuKernels, standin_flex, standin_kernels

# The compiled CPU kernel against the float64 double, by dtype (it accumulates in float32).
COMPILED_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def hold_to_contract(blocks: BlockLists) -> None:
    """Every rule of `block_masks`' contract, or AssertionError naming what broke."""
    check_block_lists(blocks)
    for rule in (full_blocks_visible, mask_outside_lists):
        failure = rule(blocks)
        assert failure is None, f"{rule.__name__}: {failure}"


def strict_twin(varlen_gqa: bool = False) -> GpuKernels:
    twin = standin_kernels(varlen_gqa)

    def flex(query, key, value, blocks, scale):
        hold_to_contract(blocks)
        return twin.raw_flex(query, key, value, blocks, scale)

    return replace(twin, name="strict twin", raw_flex=flex)


class CompiledCalls:
    """`compiled_cpu_kernels`' record: how many calls ran, and the largest difference from the double."""

    def __init__(self) -> None:
        self.calls = 0
        self.worst = 0.0


def compiled_cpu_kernels(record: CompiledCalls | None = None, strict: bool = True) -> GpuKernels:
    twin = standin_kernels()

    def flex(query, key, value, blocks, scale):
        if strict:
            hold_to_contract(blocks)
        output = flex_output(query, key, value, blocks, scale)
        expected, lse = standin_flex(query, key, value, blocks, scale)
        worst = float((output.double() - expected.double()).abs().max()) if output.numel() else 0.0
        assert worst <= COMPILED_TOLERANCE[query.dtype], f"compiled CPU FlexAttention differs by {worst:.3g}"
        if record is not None:
            record.calls += 1
            record.worst = max(record.worst, worst)
        return output, lse

    return replace(twin, name="compiled cpu flex", raw_flex=flex)


def eager_flex(query, key, value, blocks, scale):
    """FlexAttention uncompiled (torch warns that this is its slow reference: expected here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        output, lse = attend(query, key, value, block_mask(blocks), scale)
    return output, lse


def eager_kernels() -> GpuKernels:
    return replace(standin_kernels(), name="eager flex", raw_flex=eager_flex)


def dynamo_kernels() -> GpuKernels:
    """The GPU path's own compiled FlexAttention calls (`flex.run_compiled`: one function per kind of call,
    fullgraph, dynamic lengths), traced and guarded by torch.compile as on the GPU, run by its "eager" backend
    (FlexAttention's reference, with the log-sum-exp): what recompiles, and when, is torch.compile's decision,
    whatever backend runs the graph."""

    def flex(query, key, value, blocks, scale):
        return run_compiled(call_kind(blocks), query, key, value, blocks, scale, backend="eager")

    return replace(standin_kernels(), name="dynamo flex", raw_flex=flex)
