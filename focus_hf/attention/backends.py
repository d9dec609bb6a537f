"""Attention kernels behind the fast hard-mode path: one call that returns the output and its log-sum-exp.

A kernel is `kernel(query, key, value, causal=..., bias=..., scale=...) -> (output, lse)` with query
[batch, heads, L, dim], key/value [batch, kv_heads, S, dim] (heads a multiple of kv_heads, GQA as in
transformers), `bias` None or a float tensor of the query's dtype broadcastable to [batch, heads, L, S] (0 for
visible keys, finfo.min for hidden ones), output [batch, heads, L, dim] and lse float32 [batch, heads, L] (natural
log). A row without any visible key has lse at finfo(float32).min (up to a log of the key count), so that a
log-sum-exp merge gives it weight 0 and never a NaN, and a finite output; a kernel whose own convention differs is
converted in its wrapper (tested on the CPU against its stand-in in `cpu_standins`). `causal` is top-left aligned (query
slot r sees key slots <= r); the fast path only asks for it with L == S.

Backends (`focus_hf.set_routing(model, "hard", backend=...)`; `paths` lists what each can run):
  - "reference": the dense masked oracle of `reference.py`, in chunks of queries (no kernel here);
  - "sdpa": on CPU the CPU path (`cpu.cpu_path`: torch's flash kernel and the C kernels of `native`); on CUDA the
    GPU path (`gpu.gpu_path`: variable-length flash attention and FlexAttention);
  - "flash": as "sdpa", with flash-attn's variable-length kernel where it is installed (CUDA only);
  - "gpu-path": the GPU path wherever the model is - on CPU through the CPU stand-ins of its CUDA kernels
    (`gpu.cpu_standins`: exact, slow), which shows on any machine what the GPU path computes ("stock", its former
    name, is still accepted, with a DeprecationWarning);
  - "auto": the default. On CPU the pattern as one dense masked call below `crossover.dense_below(...)` keys
    (measured once per machine and shape), the CPU path above it, in the C kernels or in torch operations, whichever
    was measured faster; on CUDA the base model's attention (torch's flash SDPA) for queries with fewer keys than the
    measured crossover, the GPU path (flash-attn's varlen where installed) for the others.
On CUDA no path that needs verifying runs before `verify` has shown it exact on that device and dtype.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F

from focus_hf.attention.cpu.native_prefill import prefill_attention
from focus_hf.errors import BackendUnavailableError, FocusConfigError

FLASH_INSTALL_HINT = "pip install flash-attn"
# Hard-mode backends, each described above; soft mode is always dense.
BACKENDS = ("auto", "reference", "sdpa", "flash", "gpu-path")
# Former names, still accepted with a DeprecationWarning.
RENAMED_BACKENDS = {"stock": "gpu-path"}
# The C kernel's causal calls against torch's, 9 x 64 heads on 3 kv heads (2-core AMD EPYC, alternating): 1.51x /
# 1.50x / 1.31x / 1.30x / 1.06x / 0.97x at 256 / 1K / 2K / 4K / 8K / 16K keys - its key blocks stream from beyond
# the core's cache on long calls, and it packs a copy of every key it is given.
NATIVE_CAUSAL_MAX_KEYS = 8192


class Kernel(Protocol):
    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        causal: bool,
        bias: Optional[torch.Tensor],
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def cpu_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool,
    bias: Optional[torch.Tensor],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash kernel: takes GQA shapes and broadcast (stride-0) biases as they are. Unmasked causal
    float32 calls of up to NATIVE_CAUSAL_MAX_KEYS keys go to the C kernel of `native` where it can run: it skips the
    hidden half in blocks of 128 keys where torch's kernel works in blocks of several hundred."""
    if causal and bias is None and key.shape[2] <= NATIVE_CAUSAL_MAX_KEYS:
        computed = prefill_attention(query, key, value, causal=True, scale=scale)
        if computed is not None:
            return computed
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, causal, attn_mask=bias, scale=scale
    )
    return output, lse


def visible_rows(bias: torch.Tensor, causal: bool) -> torch.Tensor:
    """Bool [..., L]: the rows of a bias [..., L, S] (finfo.min = hidden) that keep at least one visible key, the
    causal flag (top-left aligned) applied."""
    visible = bias > torch.finfo(bias.dtype).min / 2
    if causal:
        length, keys = bias.shape[-2:]
        visible = visible & torch.ones(length, keys, dtype=torch.bool, device=bias.device).tril()
    return visible.any(dim=-1)


def cuda_sdpa_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool,
    bias: Optional[torch.Tensor],
    scale: float,
    efficient: Optional[Callable] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's memory-efficient CUDA kernel, the one that both takes a bias and returns the log-sum-exp.

    Measured on an H100 (torch 2.11): for a row whose keys are all hidden the kernel returns output 0 and
    log-sum-exp 0.0 - a real weight in a log-sum-exp merge - and its log-sum-exp comes padded to 32 queries; it
    refused ("no kernel found") inputs it could not align. So the inputs go contiguous with the head dim padded to a
    multiple of 8 (zeros change no score), and rows without a visible key get the convention of `Kernel`: output 0,
    log-sum-exp finfo(float32).min. `efficient`: the kernel to call (tests pass its CPU stand-in,
    `cpu_standins.efficient_attention_standin`)."""
    efficient = efficient or torch.ops.aten._scaled_dot_product_efficient_attention
    repeats = query.shape[1] // key.shape[1]
    if repeats > 1:  # this kernel has no GQA; causal calls rule out folding query heads into the sequence
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    dim = query.shape[-1]
    padding = -dim % 8
    query, key, value = (F.pad(states, (0, padding)).contiguous() for states in (query, key, value))
    rows = None
    if bias is not None:
        rows = visible_rows(bias, causal)
        # The kernel wants the bias's last dimension 16-aligned in memory; broadcast dims may stay stride 0.
        length = bias.shape[-1]
        bias = F.pad(bias, (0, -length % 16))[..., :length]
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], length)
    output, lse, _, _ = efficient(query, key, value, bias, True, 0.0, causal, scale=scale)
    output, lse = output[..., :dim], lse[..., : query.shape[2]].float()  # lse comes padded to 32 queries
    if rows is not None:
        output = output.masked_fill(~rows.unsqueeze(-1), 0.0)
        lse = lse.masked_fill(~rows, torch.finfo(torch.float32).min)
    return output, lse


@functools.lru_cache(maxsize=None)
def flash_attn_callable(name: str) -> Optional[Callable]:
    """flash-attn's function `name` (version 3 preferred), or None when neither version is installed."""
    for module_name in ("flash_attn_interface", "flash_attn"):
        try:
            return getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
    return None


def flash_attn_function() -> Optional[Callable]:
    """flash-attn's `flash_attn_func`, or None when flash-attn is not installed."""
    return flash_attn_callable("flash_attn_func")


def canonical_backend(backend: Optional[str], warn: bool = True, stacklevel: int = 2) -> str:
    """The backend `backend` names (None: "auto"); "stock", the former name of "gpu-path", with a DeprecationWarning.

    Raises:
        FocusConfigError: an unknown backend.
    """
    if backend is None:
        return "auto"
    if backend in RENAMED_BACKENDS:
        current = RENAMED_BACKENDS[backend]
        if warn:
            warnings.warn(
                f"backend={backend!r} is now called {current!r}; the old name will be removed in a later release.",
                DeprecationWarning,
                stacklevel=stacklevel + 1,
            )
        return current
    if backend not in BACKENDS:
        raise FocusConfigError(f"Unknown attention backend {backend!r}; expected one of {BACKENDS}.")
    return backend


def check_backend(backend: str, device: torch.device) -> None:
    """Raise `BackendUnavailableError` if `backend` cannot run on `device` (and `FocusConfigError` for an unknown
    backend)."""
    backend = canonical_backend(backend, stacklevel=3)  # the warning names the caller's caller: set_routing's
    if backend != "flash":
        return
    missing = [
        name
        for name, absent in (("a CUDA device", device.type != "cuda"), ("flash-attn", flash_attn_function() is None))
        if absent
    ]
    if missing:
        raise BackendUnavailableError(
            f"The 'flash' backend needs {' and '.join(missing)} (`{FLASH_INSTALL_HINT}`, CUDA builds only); the model "
            f"is on {device}. Use backend='sdpa' or 'auto' instead."
        )


def check_device(device: torch.device) -> None:
    """Raise `BackendUnavailableError` where the fast paths cannot run: on devices other than CPU and CUDA."""
    if device.type not in ("cpu", "cuda"):
        raise BackendUnavailableError(
            f"Fast Focus attention runs on CPU and CUDA, not {device.type}; use backend='reference'."
        )
