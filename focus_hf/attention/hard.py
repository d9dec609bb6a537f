"""Hard-mode Focus attention: which path runs a call (the paths themselves are in `fast` and `stock`).

"auto" asks `crossover.auto_path` (a crossover measured once per machine, shape and path) whether the call is short
enough for one dense masked call to beat the sparse path, and on the CPU whether the sparse path runs faster in the C
kernels or in torch operations (a prefill far longer than those measured runs on both once, timed:
`crossover.race_sparse_paths`); the crossover's measurement times the paths, which is why
the choice lives here and not beside them. Prefills run the sparse path of `fast` on CPU (C kernels, torch's CPU
kernel) and that of `stock` on CUDA (variable-length flash attention and FlexAttention); `backend="stock"` runs the
latter on any device (on CPU its exact twin). On CUDA no fast path runs before `verify` has shown it exact on that
device, dtype and head shape; where it could not, calls take the reference path (exact, in query chunks: slow, never
out of memory), as do calls past torch's recompile limit for FlexAttention (`gpu.flex`), with one printed warning.
`fallback_calls` counts them: a figure measured on a fallback is not a Focus figure.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from typing import Optional

import torch
import torch.nn.functional as F

from focus_hf.attention.backends import select_kernel
from focus_hf.attention.cpu.cpu_path import (
    DECODE_MAX_QUERIES,
    decode_attention,
    masked_attention,
    padding_keys,
    sparse_attention,
)
from focus_hf.attention.cpu.grouped_keys import GroupedKeys
from focus_hf.attention.cpu.native import torch_path
from focus_hf.attention.crossover import RACE, auto_path, race_sparse_paths
from focus_hf.attention.gpu.flex import FlexRecompileLimit, flex_compilations
from focus_hf.attention.gpu.gpu_path import decode_from_paged_keys, gpu_sparse_attention, pattern_attention
from focus_hf.attention.gpu.paged_keys import PagedKeys
from focus_hf.attention.gpu.verify import verdicts, verified_kernels
from focus_hf.attention.pattern import probes_every_group
from focus_hf.attention.reference import chunked_attention, hard_bias
from focus_hf.attention.routing import waiting_keys

# Calls of this process that took the reference path instead of the GPU path, by reason.
_fallbacks: Counter = Counter()
_warned: set[str] = set()


def fallback_calls() -> dict[str, int]:
    """How many hard-mode calls of this process ran the exact reference path instead of the GPU path, by reason:
    "unverified" (`verify` refused the configuration) and "recompile limit" (`gpu.flex.FlexRecompileLimit`)."""
    return dict(_fallbacks)


def path_record() -> dict:
    """What ran this process's hard-mode calls on the GPU path, for benchmark rows: `verify`'s verdicts by
    configuration, the calls that fell back to the reference path (`fallback_calls`: a figure measured on a fallback
    is not a Focus figure), and FlexAttention's compilations by kind of call (`gpu.flex.flex_compilations`)."""
    return {"verdicts": verdicts(), "fallback_calls": fallback_calls(), "flex_compilations": flex_compilations()}


def forget_fallbacks() -> None:
    """Reset `fallback_calls` (benchmarks count per configuration; tests)."""
    _fallbacks.clear()


def _fall_back(reason: str, detail: str = "") -> None:
    _fallbacks[reason] += 1
    if detail and reason not in _warned:
        _warned.add(reason)
        print(f"focus_hf: {detail}; such calls now run the exact reference path (slower).", file=sys.stderr)


def path_kind(
    query_groups: torch.Tensor, key_groups: torch.Tensor, decode: bool, own_group: Optional[bool] = None
) -> str:
    """Which sparse path a call takes (`crossover.KINDS`): "decode", "probe" (a separate query router with
    top_k = 1, `probe_part`), "separate" (one with top_k > 1) or "shared" (queries probe their own key group first;
    `own_group` says so, None: read from the groups)."""
    if decode:
        return "decode"
    if own_group is None:
        own_group = torch.equal(query_groups[..., 0], key_groups[:, key_groups.shape[1] - query_groups.shape[1] :])
    if own_group:
        return "shared"
    return "probe" if query_groups.shape[-1] == 1 else "separate"


def hard_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    model_mask: Optional[torch.Tensor],
    *,
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    num_groups: int,
    window: int,
    scaling: float,
    backend: str,
    mask_is_padding: Optional[bool] = True,
    grouped: Optional[list[GroupedKeys]] = None,
    paged: Optional[PagedKeys] = None,
    own_group: Optional[bool] = None,
    path: Optional[str] = None,
    sink_tokens: Optional[int] = None,
) -> torch.Tensor:
    """Hard-mode Focus attention on backend "sdpa", "flash", "stock" or "auto" (see `backends`).

    Args:
        query: [batch, heads, q, dim], the last q of the kv tokens.
        key: [batch, kv_heads, kv, dim].
        value: [batch, kv_heads, kv, dim].
        model_mask: the model's boolean mask [batch or 1, 1, q, kv] (True = may attend), or None (causal, no padding).
        query_groups: [batch, q, top_k] groups each query probes.
        key_groups: [batch, kv] each key's group.
        key_sink: [batch, kv] whether each key is a sink. Both may end before the last keys, whose decoding steps
            wait in their state's list (`routing.note_step`): those are in no group yet and not sinks
            (`routing.waiting_keys`).
        num_groups: K.
        window: local window w.
        scaling: multiplier of q.k.
        backend: "sdpa", "flash", "stock" or "auto".
        mask_is_padding: False when the model's mask may hide more than future and padding keys (sliding-window
            layers); the pattern then runs as one dense masked call that applies the model's mask in full - or, on the
            GPU path, the kernels read the mask pair by pair. None: not known (under torch.compile, where checking
            would break the graph): the GPU path reads the mask; the CPU path needs to know.
        grouped: the group-sorted copies of each sample's distant keys that a one-query decoding step reads
            instead of gathering (`grouped_keys`), one per sample; None: gather.
        paged: the paged copy of the batch's keys that a one-query decoding step on the GPU path reads
            (`paged_keys`); None: gather.
        own_group: whether each query's first probe is its own key group (no separate query router), as the routing
            knows; None: read from the groups (a device sync).
        path: "dense" (the pattern as one dense masked call), "sparse", or "sparse-torch" (the sparse path in torch
            operations, the C kernels aside: `native.torch_path`): the choice "auto" makes from the measured
            crossover (`crossover.auto_path`), made here instead. The crossover's measurement times this function
            so (`crossover.measure`), so that what it times is what runs. None: "auto" asks the crossover, other
            backends run sparse.
        sink_tokens: the most sinks a sample has (the adapter's `sink_tokens`), or None: the GPU path then reads
            the count from the flags (one device read, and a graph break under torch.compile).

    Returns:
        [batch, q, heads, dim]; rows of padding queries are finite and meaningless.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    if grouped is None or q_len != 1:  # only a step with the group-sorted copies reads the settled groups alone
        key_groups, key_sink = waiting_keys(key_groups, key_sink, kv_len)
    kernel = select_kernel(backend, query.device)
    arguments = (query_groups, key_groups, key_sink, window, scaling, kernel)
    stock = None
    if query.device.type == "cuda" or backend == "stock":
        stock = verified_kernels(query, key, backend=backend)
        if stock is None:
            _fall_back("unverified")
            return reference_hard_attention(query, key, value, model_mask, *arguments[:-1])
    compiling = torch.compiler.is_compiling()
    if model_mask is None and q_len in (1, kv_len) and not compiling and probes_every_group(query_groups, num_groups):
        # Every key's group is probed: the pattern is plain causal attention (on CPU the kernel's, which takes short
        # causal calls in the C kernel of `native`).
        if paged is not None:
            paged.invalidate()  # it missed this step's key
        if query.device.type == "cpu" and q_len > 1:
            output, _ = kernel(query, key, value, causal=True, bias=None, scale=scaling)
        else:
            output = F.scaled_dot_product_attention(
                query, key, value, is_causal=q_len > 1, scale=scaling, enable_gqa=True
            )
        return output.transpose(1, 2).contiguous()
    decode = q_len <= DECODE_MAX_QUERIES and q_len < kv_len
    kind = None
    if path is None and backend == "auto":
        kind = path_kind(query_groups, key_groups, decode, own_group)
        path = auto_path(query, key, query_groups.shape[-1], num_groups, window, kind, hard_attention)
    short = path == "dense"
    if stock is not None:
        try:
            calls = (mask_is_padding, paged, own_group, decode, short, sink_tokens)  # what decides among its calls
            return _gpu_path(query, key, value, model_mask, arguments[:-1], num_groups, stock, *calls)
        except FlexRecompileLimit as error:
            if paged is not None:
                paged.invalidate()
            _fall_back("recompile limit", str(error))
            return reference_hard_attention(query, key, value, model_mask, *arguments[:-1])
    key_valid = padding_keys(model_mask, query.shape[0])
    if short or (model_mask is not None and not mask_is_padding):
        key_groups, key_sink = waiting_keys(key_groups, key_sink, kv_len)
        arguments = (query_groups, key_groups, key_sink, window, scaling, kernel)
        return masked_attention(query, key, value, model_mask, *arguments, num_groups, mask_is_padding)

    def sparse(path: str) -> torch.Tensor:
        # "sparse-torch": the sparse path in torch operations, where they beat the C kernels here (`crossover`)
        with torch_path() if path == "sparse-torch" else contextlib.nullcontext():
            if decode:
                return decode_attention(query, key, value, key_valid, *arguments, grouped=grouped)
            return sparse_attention(
                query, key, value, key_valid, query_groups, key_groups, key_sink, num_groups, window, scaling, kernel
            )

    if path == RACE:
        return race_sparse_paths(query, key, query_groups.shape[-1], num_groups, window, kind, sparse)
    return sparse(path)


def _gpu_path(
    query,
    key,
    value,
    model_mask,
    routing,
    num_groups,
    stock,
    mask_is_padding,
    paged,
    own_group,
    decode,
    short,
    sink_tokens=None,
) -> torch.Tensor:
    """The GPU path's choice among its calls (`gpu.stock`): [batch, q, heads, dim]."""
    query_groups, key_groups, key_sink, window, scaling = routing
    q_len = query.shape[2]
    general = model_mask is not None and mask_is_padding is not True
    key_valid = None if general else padding_keys(model_mask, query.shape[0])
    lookup = model_mask if general else None  # read by the kernels' masks, pair by pair
    if decode and q_len == 1 and paged is not None and not general and not short:
        return decode_from_paged_keys(query, key, value, key_valid, *routing, paged, stock)
    if paged is not None:
        paged.invalidate()  # it misses this step's key: rebuilt when a step reads it again
    if short or decode:  # few queries without a paged copy: one call over every causal block
        return pattern_attention(query, key, value, key_valid, *routing, stock, lookup)
    sparse = (query_groups, key_groups, key_sink, num_groups, window, scaling, stock, own_group, lookup)
    return gpu_sparse_attention(query, key, value, key_valid, *sparse, sink_slots=sink_tokens)


def reference_hard_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    model_mask: Optional[torch.Tensor],
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    window: int,
    scaling: float,
) -> torch.Tensor:
    """The pattern and the model's mask applied to dense attention in chunks of queries (`reference.chunked_attention`):
    exact wherever it runs, memory growing with one chunk x kv. [batch, q, heads, dim]."""
    bias = hard_bias(query_groups, key_groups, key_sink, window, model_mask)
    return chunked_attention(query, key, value, bias, scaling=scaling)[0]
