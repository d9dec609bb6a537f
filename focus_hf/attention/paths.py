"""The table of hard-mode attention paths: every implementation of the Focus pattern, what it applies to and how it
runs.

A path is one way to compute a call's attention (`PathCall`): the CPU path's own-group pass and window band on the C
kernels (`cpu_path`), the same in torch operations (the torch path), one dense masked call, the GPU path on CUDA's
kernels (`gpu_path`), the reference oracle - and the base model's own attention, which is not the pattern and which
"auto" takes on CUDA where the GPU path is measured slower. Every entry of `PATHS` says which platform it belongs to,
which calls it can run exactly, what it needs, whether it runs only on kernels that `gpu.verify` has shown exact on
the device, and which side of a measured crossover it stands for (`measured_as`). `hard.hard_attention` picks one
entry per call: a backend's default is the first entry of its platform that applies (`default_path`); "auto" looks
the measured side up in `crossover` and takes that side's entry (`measured_path`).

Platforms: "cpu" (the C kernels and torch's CPU kernels) and "gpu" (FlexAttention and variable-length flash
attention on CUDA - or, with `backend="gpu-path"` on a CPU model, their CPU stand-ins of `gpu.cpu_standins`); "any"
entries run on both.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from focus_hf.attention.backends import cpu_kernel
from focus_hf.attention.cpu.cpu_path import (
    DECODE_MAX_QUERIES,
    decode_attention,
    masked_attention,
    sparse_attention,
)
from focus_hf.attention.cpu.grouped_keys import GroupedKeys
from focus_hf.attention.cpu.native import torch_path
from focus_hf.attention.gpu.gpu_path import decode_from_paged_keys, gpu_sparse_attention, pattern_attention
from focus_hf.attention.gpu.kernels import GpuKernels
from focus_hf.attention.gpu.paged_keys import PagedKeys
from focus_hf.attention.pattern import FocusPattern
from focus_hf.attention.reference import reference_hard_attention

# Device types whose calls take the GPU path (tests add "cpu" to run CUDA's decisions on the kernels' stand-ins).
GPU_PATH_DEVICES = ("cuda",)
# The backend that runs the GPU path wherever the model is (on the CPU through the kernels' stand-ins).
GPU_PATH_BACKEND = "gpu-path"


def path_platform(device: torch.device, backend: str) -> str:
    """The platform whose paths run a call on `device` under `backend`: "gpu" on CUDA or for `backend="gpu-path"`,
    else "cpu"."""
    return "gpu" if device.type in GPU_PATH_DEVICES or backend == GPU_PATH_BACKEND else "cpu"


@dataclass(frozen=True, eq=False)
class PathCall:
    """One hard-mode call as the paths take it: states, the pattern (its keys brought to the call's key count), the
    score scale, the GPU path's kernels once shown exact on this device (`gpu.verify`; None on the CPU path), and the
    layer's copy of the distant keys that a one-query decoding step reads (the CPU path's group-sorted copies, one per
    sample, or the GPU path's paged copy; None: gather)."""

    query: torch.Tensor  # [batch, heads, q, dim], the last q of the kv tokens
    key: torch.Tensor  # [batch, kv_heads, kv, dim]
    value: torch.Tensor
    pattern: FocusPattern
    scaling: float
    kernels: Optional[GpuKernels] = None
    key_copy: Optional[Union[list[GroupedKeys], PagedKeys]] = None

    @property
    def q_len(self) -> int:
        return self.query.shape[2]

    @property
    def kv_len(self) -> int:
        return self.key.shape[2]

    @property
    def decode(self) -> bool:
        """A decoding call: a few queries after a longer cache."""
        return self.q_len <= DECODE_MAX_QUERIES and self.q_len < self.kv_len


def _always(call: PathCall) -> bool:
    return True


@dataclass(frozen=True)
class AttentionPath:
    """One implementation in the table of paths.

    Attributes:
        name: how backends, benchmark rows and `hard_attention(path=...)` name it.
        summary: what it runs, in a line.
        platform: "cpu", "gpu" or "any" (`path_platform`).
        calls: "prefill" and / or "decode" (a few queries after a longer cache, `PathCall.decode`).
        run: the call's output [batch, q, heads, dim].
        applies: whether it can run a call exactly (shape limits, masks, copies).
        needs: what it needs beyond torch, as words for readers (the C kernels, a CUDA device...).
        verified: whether it runs only on kernels `gpu.verify` has shown exact on the call's device, dtype and heads.
        exact: whether it computes the Focus pattern; False for the base model's attention.
        measured_as: the side of a measured crossover it stands for ("dense": short calls, "sparse" / "sparse-torch":
            long ones; `crossover`), or None where no measurement chooses it.
    """

    name: str
    summary: str
    platform: str
    calls: tuple[str, ...]
    run: Callable[[PathCall], torch.Tensor]
    applies: Callable[[PathCall], bool] = _always
    needs: tuple[str, ...] = ()
    verified: bool = False
    exact: bool = True
    measured_as: Optional[str] = None

    def takes(self, call: PathCall) -> bool:
        """Whether this entry runs `call`: its kind of call, and its own conditions."""
        return ("decode" if call.decode else "prefill") in self.calls and self.applies(call)


def _padding_mask(call: PathCall) -> bool:
    """The model's mask hides no more than future and padding keys, which the sparse paths read from its last row."""
    return not call.pattern.general_mask


def _routing(call: PathCall) -> tuple:
    pattern = call.pattern
    return pattern.query_groups, pattern.key_groups, pattern.key_sink


def run_reference(call: PathCall) -> torch.Tensor:
    """The reference path (`reference.reference_hard_attention`): exact, dense, in chunks of queries."""
    pattern = call.pattern
    routing = (*_routing(call), pattern.window, call.scaling)
    return reference_hard_attention(call.query, call.key, call.value, pattern.model_mask, *routing)


def _causal_applies(call: PathCall) -> bool:
    # Reading the groups is a device sync, which would break a torch.compile graph.
    return (
        call.pattern.model_mask is None
        and call.q_len in (1, call.kv_len)
        and not torch.compiler.is_compiling()
        and call.pattern.probes_every_group()
    )


def _run_causal(call: PathCall) -> torch.Tensor:
    """Every query probes every group: the pattern is causal attention (on CPU the kernel's, which takes short causal
    calls in the C kernel of `native`)."""
    if call.query.device.type == "cpu" and call.q_len > 1:
        output, _ = cpu_kernel(call.query, call.key, call.value, causal=True, bias=None, scale=call.scaling)
    else:
        output = F.scaled_dot_product_attention(
            call.query, call.key, call.value, is_causal=call.q_len > 1, scale=call.scaling, enable_gqa=True
        )
    return output.transpose(1, 2).contiguous()


def run_base(call: PathCall) -> torch.Tensor:
    """The base model's attention over the call (causal, the model's mask applied in full), not the pattern: torch's
    SDPA, which on CUDA takes its flash kernel where no mask is needed."""
    query, key, value = call.query, call.key, call.value
    q_len, kv_len = call.q_len, call.kv_len
    mask = call.pattern.model_mask
    causal = mask is None and q_len == kv_len
    if mask is None and 1 < q_len < kv_len:  # the queries are the last of the keys: causal from the bottom right
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=causal, scale=call.scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous()


def _run_masked(call: PathCall) -> torch.Tensor:
    pattern = call.pattern.keys_up_to(call.kv_len)
    return masked_attention(
        call.query,
        call.key,
        call.value,
        pattern.model_mask,
        pattern.query_groups,
        pattern.key_groups,
        pattern.key_sink,
        pattern.window,
        call.scaling,
        cpu_kernel,
        pattern.num_groups,
        pattern.mask_is_padding,
    )


def _cpu_sparse(*, in_torch: bool) -> Callable[[PathCall], torch.Tensor]:
    def run(call: PathCall) -> torch.Tensor:
        pattern = call.pattern
        key_valid = pattern.key_valid(call.query.shape[0])
        with torch_path() if in_torch else contextlib.nullcontext():
            return sparse_attention(
                call.query,
                call.key,
                call.value,
                key_valid,
                *_routing(call),
                pattern.num_groups,
                pattern.window,
                call.scaling,
                cpu_kernel,
            )

    return run


def _cpu_decode(*, in_torch: bool) -> Callable[[PathCall], torch.Tensor]:
    def run(call: PathCall) -> torch.Tensor:
        pattern = call.pattern
        grouped = call.key_copy if isinstance(call.key_copy, list) else None
        with torch_path() if in_torch else contextlib.nullcontext():
            return decode_attention(
                call.query,
                call.key,
                call.value,
                pattern.key_valid(call.query.shape[0]),
                *_routing(call),
                pattern.window,
                call.scaling,
                cpu_kernel,
                grouped=grouped,
            )

    return run


def _gpu_masks(call: PathCall) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(padding keys, the model's mask for the kernels to read pair by pair): a mask that may hide more than future
    and padding keys is read in full, else only its padding."""
    pattern = call.pattern
    if pattern.general_mask:
        return None, pattern.model_mask
    return pattern.key_valid(call.query.shape[0]), None


def _run_gpu_sparse(call: PathCall) -> torch.Tensor:
    pattern = call.pattern
    key_valid, lookup = _gpu_masks(call)
    return gpu_sparse_attention(
        call.query,
        call.key,
        call.value,
        key_valid,
        *_routing(call),
        pattern.num_groups,
        pattern.window,
        call.scaling,
        call.kernels,
        pattern.own_group,
        lookup,
        sink_slots=pattern.sink_tokens,
    )


def _run_gpu_pattern(call: PathCall) -> torch.Tensor:
    key_valid, lookup = _gpu_masks(call)
    pattern = call.pattern
    return pattern_attention(
        call.query, call.key, call.value, key_valid, *_routing(call), pattern.window, call.scaling, call.kernels, lookup
    )


def _paged_applies(call: PathCall) -> bool:
    return call.q_len == 1 and isinstance(call.key_copy, PagedKeys) and not call.pattern.general_mask


def _run_paged(call: PathCall) -> torch.Tensor:
    key_valid, _ = _gpu_masks(call)
    pattern = call.pattern
    return decode_from_paged_keys(
        call.query,
        call.key,
        call.value,
        key_valid,
        *_routing(call),
        pattern.window,
        call.scaling,
        call.key_copy,
        call.kernels,
    )


BOTH = ("prefill", "decode")
C_KERNELS = "the C kernels (built on first use; torch operations where they cannot be)"
GPU_KERNELS = "FlexAttention (compiled) and variable-length flash attention (torch's, or flash-attn's where installed)"
# Registry order is preference order: a backend other than "auto" runs the first entry of its platform that takes the
# call (`default_path`), so each platform's entries go from the most specific to the most general.
_ENTRIES = (
    AttentionPath(
        name="causal",
        summary="every query probes every group: the pattern is causal attention, one causal call",
        platform="any",
        calls=BOTH,
        run=_run_causal,
        applies=_causal_applies,
    ),
    AttentionPath(
        name="cpu-decode",
        summary="few queries after a cache: the keys they reach gathered (or read from the group-sorted copy)",
        platform="cpu",
        calls=("decode",),
        run=_cpu_decode(in_torch=False),
        needs=(C_KERNELS,),
        measured_as="sparse",
        applies=_padding_mask,
    ),
    AttentionPath(
        name="cpu-sparse",
        summary="the own-group pass and the window band merged by log-sum-exp, on the C kernels and torch's kernel",
        platform="cpu",
        calls=("prefill",),
        run=_cpu_sparse(in_torch=False),
        needs=(C_KERNELS,),
        measured_as="sparse",
        applies=_padding_mask,
    ),
    AttentionPath(
        name="cpu-masked",
        summary="the pattern as one dense masked call (the C kernel reads it from group bits; elsewhere a bias)",
        platform="cpu",
        calls=BOTH,
        run=_run_masked,
        measured_as="dense",
    ),
    AttentionPath(
        name="cpu-decode-torch",
        summary="cpu-decode in torch operations alone (the torch path)",
        platform="cpu",
        calls=("decode",),
        run=_cpu_decode(in_torch=True),
        measured_as="sparse-torch",
        applies=_padding_mask,
    ),
    AttentionPath(
        name="cpu-sparse-torch",
        summary="cpu-sparse in torch operations alone (the torch path)",
        platform="cpu",
        calls=("prefill",),
        run=_cpu_sparse(in_torch=True),
        measured_as="sparse-torch",
        applies=_padding_mask,
    ),
    AttentionPath(
        name="gpu-paged-decode",
        summary="a one-query step: one FlexAttention call over the layer's paged copy of the distant keys",
        platform="gpu",
        calls=("decode",),
        run=_run_paged,
        needs=(GPU_KERNELS,),
        verified=True,
        measured_as="sparse",
        applies=_paged_applies,
    ),
    AttentionPath(
        name="gpu-sparse",
        summary="the own-group pass (varlen flash or FlexAttention) and the window band (one sliding-window call)",
        platform="gpu",
        calls=("prefill",),
        run=_run_gpu_sparse,
        needs=(GPU_KERNELS,),
        verified=True,
        measured_as="sparse",
    ),
    AttentionPath(
        name="gpu-pattern",
        summary="the whole pattern in one FlexAttention call over every causal key block (steps without a paged copy)",
        platform="gpu",
        calls=BOTH,
        run=_run_gpu_pattern,
        needs=(GPU_KERNELS,),
        verified=True,
    ),
    AttentionPath(
        name="base",
        summary="the base model's attention (torch's SDPA, flash on CUDA), not the pattern: 'auto' below its crossover",
        platform="gpu",
        calls=BOTH,
        run=run_base,
        exact=False,
        measured_as="dense",
    ),
    AttentionPath(
        name="reference",
        summary="the dense masked oracle in chunks of queries: exact and slow; where the GPU path is not shown exact",
        platform="any",
        calls=BOTH,
        run=run_reference,
    ),
)
PATHS: dict[str, AttentionPath] = {entry.name: entry for entry in _ENTRIES}
# Taken by a backend's choice only where named: by a measurement ("auto"), as a fallback, or as the base attention.
_NOT_DEFAULT = {"cpu-decode-torch", "cpu-sparse-torch", "base", "reference"}


def default_path(call: PathCall, platform_name: str) -> AttentionPath:
    """The entry a backend other than "auto" runs `call` on: the first of `platform_name`'s (or any platform's) that
    takes it."""
    for entry in _ENTRIES:
        if entry.name not in _NOT_DEFAULT and entry.platform in (platform_name, "any") and entry.takes(call):
            return entry
    return PATHS["reference"]


def measured_paths(platform_name: str, decode: bool) -> dict[str, AttentionPath]:
    """The entries a crossover of `platform_name` times, by the side they stand for: {"dense": ..., "sparse": ...,
    and on the CPU "sparse-torch": ...}."""
    kind = "decode" if decode else "prefill"
    return {
        entry.measured_as: entry
        for entry in _ENTRIES
        if entry.measured_as is not None and entry.platform == platform_name and kind in entry.calls
    }


def measured_path(call: PathCall, platform_name: str, side: str) -> AttentionPath:
    """The entry that stands for `side` of a crossover for `call`, where it takes the call; else `default_path`'s
    (a step without a paged copy, a mask the sparse paths cannot read)."""
    entry = measured_paths(platform_name, call.decode).get(side)
    if entry is not None and entry.takes(call):
        return entry
    return default_path(call, platform_name)
