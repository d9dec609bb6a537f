"""torch's FlexAttention, compiled the way the GPU path needs it: contract checked, recompilations bounded, never eager.

`flex_attention` outside torch.compile is a dense reference (it applies `mask_mod` to every pair and ignores the
block lists); compiled, it runs the block-sparse kernel. Three things go wrong with a plain
`torch.compile(flex_attention)`: a block mask outside the kernel's contract gives wrong numbers or faults the GPU
(held to it first: `block_masks`); every new captured number or mask function compiles again
(`pair_rule` keeps one mask function whose closure holds only tensors, and lengths are dynamic here); and past
torch's recompile limit (8 by default) torch.compile silently runs the function uncompiled. Compiled here with
`fullgraph=True`, that last case raises for these functions alone, with no process-wide setting: a call then raises
`FlexRecompileLimit`, and `hard` runs it on the bounded exact path with one printed warning.

torch keeps its compilations, and counts them against the limit, per function: one function per kind of call
(`FLEX_CALLS`) keeps the kinds from crowding each other out - partial blocks only, partial and full blocks (the
own-group pass, the whole pattern), a decoding step (one query, batch and heads kept static so that torch picks its
split-key decoding kernel) and the output alone (torch's CPU kernel, which has no log-sum-exp in torch 2.13).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from focus_hf.attention.gpu.block_masks import BLOCK, BlockLists, enforce_block_lists
from focus_hf.errors import FocusRuntimeError


class FlexRecompileLimit(FocusRuntimeError):
    """torch.compile reached its recompile limit for one kind of FlexAttention call of the GPU path (one more
    configuration - dtype, head shape, probe count - than it compiles); `hard` runs the call on the exact path."""


def block_mask(blocks: BlockLists, q_len: Optional[int] = None, kv_len: Optional[int] = None):
    """torch's `BlockMask` of `blocks` (for states padded to q_len / kv_len positions where given)."""
    from torch.nn.attention.flex_attention import BlockMask

    full = (None, None)
    if blocks.full_num_blocks is not None:
        full = (blocks.full_num_blocks[:, None], blocks.full_indices[:, None])
    return BlockMask.from_kv_blocks(
        blocks.kv_num_blocks[:, None],
        blocks.kv_indices[:, None],
        *full,
        BLOCK_SIZE=BLOCK,
        mask_mod=blocks.mask_mod,
        seq_lengths=(q_len or blocks.q_len, kv_len or blocks.kv_len),
        compute_q_blocks=False,
    )


def _lse_request() -> dict:
    """The keyword that asks flex_attention for the log-sum-exp (return_aux from torch 2.9, return_lse before)."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def attend(query, key, value, block_mask, scale, with_lse: bool = True):
    """flex_attention with GQA, and its natural-log log-sum-exp when `with_lse`: (output, lse) or the output.
    Uncompiled, this is torch's dense reference of the kernel."""
    from torch.nn.attention.flex_attention import flex_attention

    if not with_lse:
        return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True)
    output, aux = flex_attention(
        query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True, **_lse_request()
    )
    return output, getattr(aux, "lse", aux)


def _flex_partial(query, key, value, block_mask, scale):
    return attend(query, key, value, block_mask, scale)


def _flex_full(query, key, value, block_mask, scale):
    return attend(query, key, value, block_mask, scale)


def _flex_decode(query, key, value, block_mask, scale):
    return attend(query, key, value, block_mask, scale)


def _flex_output(query, key, value, block_mask, scale):
    return attend(query, key, value, block_mask, scale, with_lse=False)


FLEX_CALLS: dict[str, Callable] = {
    "partial": _flex_partial,
    "full": _flex_full,
    "decode": _flex_decode,
    "output": _flex_output,
}


@functools.lru_cache(maxsize=None)
def compiled_flex(kind: str, backend: str = "inductor") -> Callable:
    """The compiled function of one kind of call (`FLEX_CALLS`): fullgraph; lengths dynamic from the first
    compilation, except for the CPU kernel ("output"), whose code generation for dynamic shapes is broken in torch 2.13
    (it renames the split sizes by a plain text replacement that also hits longer size names): it compiles per shape,
    its lengths rounded up to whole blocks (`flex_output`). `backend`: torch.compile's ("eager" traces and guards as
    the GPU does but runs FlexAttention's reference: the CPU tests count compilations with it)."""
    return torch.compile(FLEX_CALLS[kind], fullgraph=True, dynamic=kind != "output", backend=backend)


def flex_compilations() -> dict[str, int]:
    """How many compiled versions of each kind of call this process holds (torch's cache entries of each
    function): what the recompile limit counts."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # a private helper of torch's: a release without it leaves the count unknown
        return {}
    return {kind: len(_debug_get_cache_entry_list(function.__code__)) for kind, function in FLEX_CALLS.items()}


def call_kind(blocks: BlockLists) -> str:
    """The kind of call that runs `blocks` with its log-sum-exp: "decode", "full" or "partial"."""
    if blocks.q_len == 1:
        return "decode"
    return "partial" if blocks.full_num_blocks is None else "full"


def run_compiled(
    kind: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    blocks: BlockLists,
    scale: float,
    lengths: tuple[Optional[int], Optional[int]] = (None, None),
    backend: str = "inductor",
):
    """One call of the compiled function of `kind` (`compiled_flex`); torch's recompile limit becomes
    `FlexRecompileLimit`."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    if torch.compiler.is_compiling():
        return _outside_the_model_graph(kind, query, key, value, blocks, scale, lengths, backend)
    mask = block_mask(blocks, *lengths)
    # Lengths change from call to call: sizes from the first compilation, not constants. A decoding step keeps its
    # batch and heads static, which torch's split-key decoding kernel needs.
    for states in (query, key, value):
        torch._dynamo.maybe_mark_dynamic(states, 2)
        if kind == "decode":
            torch._dynamo.mark_static(states, 0)
            torch._dynamo.mark_static(states, 1)
        else:
            torch._dynamo.maybe_mark_dynamic(states, 0)
    for lists in (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices):
        if lists is not None:  # [batch, 1, query blocks, key blocks]
            for dim in (0, 2, 3)[: lists.dim() - 1]:
                torch._dynamo.maybe_mark_dynamic(lists, dim)
    try:
        return compiled_flex(kind, backend)(query, key, value, mask, scale)
    except FailOnRecompileLimitHit as error:
        raise FlexRecompileLimit(
            f"torch.compile reached its recompile limit ({torch._dynamo.config.recompile_limit}) for FlexAttention "
            f"calls of kind '{kind}' ({query.dtype}, {query.shape[1]} query heads on {key.shape[1]} kv heads)"
        ) from error


@torch.compiler.disable
def _outside_the_model_graph(kind, query, key, value, blocks, scale, lengths, backend):
    """`run_compiled` for a call inside a compiled model, which leaves the model's graph (one graph break) and runs this
    module's compiled function of `kind`. Traced into the model's graph instead, torch 2.11's inductor failed to lower
    the decoding step's FlexAttention on an H200 ("LoweringException: AttributeError: 'function' object has no
    attribute 'graph'", the mask's closure holding tensors made inside the graph), and the model's graph would also
    escape this module's bounds on recompilations."""
    return run_compiled(kind, query, key, value, blocks, scale, lengths, backend)


def cuda_flex(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: BlockLists, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled FlexAttention kernel: raw output and log-sum-exp (-inf for rows without a visible key). The lists'
    values are brought into the contract's range first, on the device (`block_masks.enforce_block_lists`)."""
    enforce_block_lists(blocks)
    return run_compiled(call_kind(blocks), query, key, value, blocks, scale)


def flex_output(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: BlockLists, scale: float
) -> torch.Tensor:
    """The output alone of the compiled kernel of the query's device. On the CPU that is torch's compiled CPU kernel,
    which enforces the contract a CPU stand-in cannot (tests). It compiles per shape (`compiled_flex`), so the states
    are padded to whole blocks first - lengths within a block share a compilation; the masks cover whole blocks already
    and hide the padding."""
    if query.device.type != "cpu":
        return cuda_flex(query, key, value, blocks, scale)[0]
    q_len, kv_len = query.shape[2], key.shape[2]
    q_span, kv_span = blocks.q_blocks * BLOCK, blocks.kv_blocks * BLOCK
    query = F.pad(query, (0, 0, 0, q_span - q_len))
    key, value = (F.pad(states, (0, 0, 0, kv_span - kv_len)) for states in (key, value))
    return run_compiled("output", query, key, value, blocks, scale, (q_span, kv_span))[:, :, :q_len]
