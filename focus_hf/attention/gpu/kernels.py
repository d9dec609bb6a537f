"""The GPU path's kernels - FlexAttention and variable-length flash attention - behind one convention.

`GpuKernels.flex(query [B, H, L, D], key/value [B, KV, S, D], blocks, scale)` and `GpuKernels.varlen(query
[T, H, D], key/value [T', KV, D], cu_seq_q, cu_seq_k, max_q, max_k, scale, window)` (causal within each sequence,
aligned to the bottom right, optionally within a sliding window) return the output in the query's dtype and a
float32 log-sum-exp - natural log, [B, H, L] and [T, H] - where a row without any visible key has output 0 and
log-sum-exp `NEG` (finite, so that a log-sum-exp merge gives it weight 0 and never a NaN). What each kernel returns
raw differs (flex: -inf for empty rows; varlen: [H, T]; flash-attn 2 and 3: tuples of different lengths); the
conversion is here, once, and `verify` checks it on every CUDA device and dtype before the path is used.

On CUDA: FlexAttention compiled (`flex`) and torch's `varlen_attn` (flash-attn's `flash_attn_varlen_func` when
installed). On CPU: their CPU stand-ins (`cpu_standins`) - the same decomposition, exact and slow, for tests and
`backend="gpu-path"`. Every block mask is held to FlexAttention's contract (`block_masks`) before a kernel sees it,
without reading the device.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from focus_hf.attention.backends import flash_attn_callable
from focus_hf.attention.gpu.block_masks import BLOCK, BlockLists, check_block_lists
from focus_hf.attention.gpu.cpu_standins import flex_attention_standin, varlen_attention_op
from focus_hf.attention.gpu.flex import cuda_flex

NEG = torch.finfo(torch.float32).min  # log-sum-exp of a row without a visible key


RawFlex = Callable[..., tuple[torch.Tensor, torch.Tensor]]
RawVarlen = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class GpuKernels:
    """One device's FlexAttention and variable-length attention, normalised to the module's convention.

    Attributes:
        name: what runs ("cuda: flex + torch varlen", "CPU stand-ins", ...), for messages and benchmark rows.
        raw_flex: (query, key, value, blocks, scale) -> (output, lse) as the kernel returns them.
        raw_varlen: (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window) -> (output [T, H, D],
            lse [H, T]), causal, and with window >= 0 each query seeing its own key and the `window` before it (flash
            attention's `window_size=(window, 0)`); None where no variable-length kernel is available.
        varlen_gqa: whether raw_varlen takes fewer kv heads than query heads.
        varlen_dtypes: the dtypes raw_varlen runs (flash attention: half precision only).
        head_dims: rounds a head dim up to one the kernels take (keys and queries are padded with zeros).
        varlen_window: whether raw_varlen's sliding window may be used (`verify` clears it where the windowed call
            is not exact on a device; the window band then takes `bands`).
    """

    name: str
    raw_flex: RawFlex
    raw_varlen: Optional[RawVarlen]
    varlen_gqa: bool
    varlen_dtypes: tuple[torch.dtype, ...]
    head_dims: Callable[[int], int]
    varlen_window: bool = True

    def runs_varlen(self, dtype: torch.dtype) -> bool:
        return self.raw_varlen is not None and dtype in self.varlen_dtypes

    def runs_window(self, dtype: torch.dtype) -> bool:
        return self.varlen_window and self.runs_varlen(dtype)

    def flex(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: BlockLists, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block-sparse attention: output [B, H, L, D] (query dtype) and lse [B, H, L] (float32, NEG if empty).
        `blocks` is held to FlexAttention's contract first (`block_masks`): its shapes, dtypes and layout here, on the
        host; its values by the CUDA kernel's call, which brings them into range without reading them
        (`flex.cuda_flex`)."""
        dim = query.shape[-1]
        padded = self.head_dims(dim)
        if padded != dim:
            query, key, value = (F.pad(states, (0, padded - dim)) for states in (query, key, value))
        check_block_lists(blocks, values=False)
        output, lse = self.raw_flex(query, key, value, blocks, scale)
        return output[..., :dim], lse.float().clamp_min(NEG)

    def varlen(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seq_q: torch.Tensor,
        cu_seq_k: torch.Tensor,
        max_q: int,
        max_k: int,
        scale: float,
        window: int = -1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention within each packed sequence: output [T, H, D] (query dtype) and lse [T, H] (float32);
        with `window` >= 0 a query sees only its own key and the `window` keys before it.

        GQA (query head h reads kv head h // (H // KV)) where the kernel takes none: one call per run of
        `varlen_calls` - no expanded copy of the keys."""
        if self.raw_varlen is None:
            raise RuntimeError(f"{self.name} has no variable-length attention kernel")
        dim = query.shape[-1]
        padded = self.head_dims(dim)
        if padded != dim:
            query, key, value = (F.pad(states, (0, padded - dim)) for states in (query, key, value))
        heads, kv_heads = query.shape[1], key.shape[1]
        arguments = (cu_seq_q, cu_seq_k, max_q, max_k, scale, window)
        runs = self.varlen_calls(heads, kv_heads)
        if len(runs) == 1:
            output, lse = self.raw_varlen(query, key, value, *arguments)
            return output[..., :dim], lse.float().transpose(0, 1)
        output = query.new_empty(query.shape[0], heads, dim)
        lse = torch.empty(query.shape[0], heads, dtype=torch.float32, device=query.device)
        for heads_run in runs:
            part, part_lse = self.raw_varlen(query[:, heads_run], key, value, *arguments)
            output[:, heads_run] = part[..., :dim]
            lse[:, heads_run] = part_lse.float().transpose(0, 1)
        return output, lse

    def varlen_calls(self, heads: int, kv_heads: int) -> list[slice]:
        """The query heads of each variable-length call over `kv_heads` kv heads: all at once where the kernel takes
        GQA (or the heads match); else one call per position p in a kv head's run of query heads - query heads p,
        p + H / KV, ... against kv heads 0, 1, ..."""
        if heads == kv_heads or self.varlen_gqa:
            return [slice(None)]
        per_kv = heads // kv_heads
        return [slice(position, None, per_kv) for position in range(per_kv)]


def _power_of_two_from_16(dim: int) -> int:
    """A head dim both kernels take: FlexAttention's Triton kernel needs a power of two of at least 16, flash
    attention a multiple of 8."""
    return max(16, 1 << (dim - 1).bit_length())


def standin_flex(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: BlockLists, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's CPU stand-in (`cpu_standins.flex_attention_standin`)."""
    return flex_attention_standin(
        query,
        key,
        value,
        kv_num_blocks=blocks.kv_num_blocks[:, None],
        kv_indices=blocks.kv_indices[:, None],
        full_kv_num_blocks=None if blocks.full_num_blocks is None else blocks.full_num_blocks[:, None],
        full_kv_indices=None if blocks.full_indices is None else blocks.full_indices[:, None],
        mask_mod=blocks.mask_mod,
        block_size=BLOCK,
        scale=scale,
    )


def torch_varlen_function() -> Optional[tuple[Callable, bool]]:
    """torch's `varlen_attn` and whether it takes GQA (`enable_gqa`, torch >= 2.12), or None before torch 2.10."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def _torch_varlen(function: Callable, gqa: bool) -> RawVarlen:
    from torch.nn.attention.varlen import AuxRequest

    def varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window=-1):
        options = {"enable_gqa": True} if gqa and query.shape[1] != key.shape[1] else {}
        return function(
            query,
            key,
            value,
            cu_seq_q,
            cu_seq_k,
            max_q,
            max_k,
            return_aux=AuxRequest(lse=True),
            scale=scale,
            window_size=(window, 0),
            **options,
        )

    return varlen


def _flash_attn_varlen(function: Callable) -> RawVarlen:
    def varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window=-1):
        result = function(
            query,
            key,
            value,
            cu_seq_q,
            cu_seq_k,
            max_q,
            max_k,
            softmax_scale=scale,
            causal=True,
            window_size=(window, 0),
            return_attn_probs=True,
        )
        return result[0], result[1]  # flash-attn 2: (out, lse, probs); 3: (out, lse)

    return varlen


def cuda_kernels(prefer_flash_attn: bool = True) -> GpuKernels:
    """The CUDA kernels: compiled FlexAttention, and flash-attn's varlen (when installed and preferred) or torch's."""
    flash = flash_attn_callable("flash_attn_varlen_func") if prefer_flash_attn else None
    if flash is not None:
        return GpuKernels(
            "cuda: FlexAttention + flash-attn varlen",
            cuda_flex,
            _flash_attn_varlen(flash),
            True,
            (torch.float16, torch.bfloat16),
            _power_of_two_from_16,
        )
    found = torch_varlen_function()
    raw_varlen, gqa = (None, False) if found is None else (_torch_varlen(*found), found[1])
    name = "cuda: FlexAttention" + ("" if found is None else " + torch varlen_attn")
    return GpuKernels(name, cuda_flex, raw_varlen, gqa, (torch.float16, torch.bfloat16), _power_of_two_from_16)


def standin_kernels(varlen_gqa: bool = False) -> GpuKernels:
    """The CPU stand-ins of FlexAttention and varlen, in every dtype. Without `varlen_gqa` the varlen stand-in
    refuses GQA as torch 2.11's kernel does, so that the per-position calls run."""

    def varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window=-1):
        return varlen_attention_op(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, varlen_gqa, window)

    dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    return GpuKernels("CPU stand-ins", standin_flex, varlen, varlen_gqa, dtypes, _power_of_two_from_16)


def gpu_kernels(device: torch.device, backend: str = "auto") -> GpuKernels:
    """The kernels of the GPU path on `device` for `backend`: CUDA's (flash-attn's varlen for "flash", and for
    "auto" where it is installed; torch's otherwise), or the CPU stand-ins elsewhere."""
    if device.type == "cuda":
        return cuda_kernels(prefer_flash_attn=backend in ("auto", "flash"))
    return standin_kernels()
