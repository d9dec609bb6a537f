"""Prefill calls in the CPU kernels (`csrc/prefill.c`): many queries over many keys in one C call.

`prefill_attention` runs many queries over many keys with the Focus pattern evaluated from per-token group bits as
it goes (no n x n mask is built or read): with the pattern, 1.05-1.5x the speed of torch's unmasked causal kernel at
256-2K tokens, where torch's kernel with the pattern as a bias runs 0.8-0.9x of it. Per visible pair it runs at
1.0-1.1x of torch's kernel on long non-causal calls (float32 on 2 AVX-512 cores: ~155-165 GFLOP/s for both), and it
gains more from skipping hidden pairs in blocks of 128 keys (torch's CPU kernel skips in blocks of several hundred).
With `local` it runs the window band's window pairs. `prefill_segments` runs the own-group pass of a block of queries
of the CPU path in one call, its keys read where they lie through their token indices (sorted into segments by the
counting sorts of csrc/segments.c, `segments.SegmentKeys`), and `sink_pairs` folds the window band's sink pairs into
the output.

The calls take float32, and bfloat16 with float32 sums; each returns None (or False) where the kernels cannot take
the call (`native`): the caller then runs its torch path, which gives the same result.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
import torch.nn.functional as F

from focus_hf.attention.cpu import native
from focus_hf.attention.cpu.native import NativeKernels

# Keys of a segment that `prefill_segments` packs at once (each slab's entries are folded into their rows before the
# next): the packed copy stays at 1.5 MiB for 3 kv heads of 64 dims however long the segment, and in the cores'
# caches (K=8 top-1 at 64K tokens, segments of 8K keys, alternating: slabs of 256 / 512 / 1K / 2K / 4K / 8K keys
# 5.10 / 4.61 / 4.36 / 4.34 / 4.78 / 5.30 s).
SEGMENT_SLAB_KEYS = 2048

# The element types of the prefill kernels (csrc/prefill.c): queries, keys and values of one of them, float32 sums.
PREFILL_TYPES = {torch.float32: 0, torch.bfloat16: 1}


def prefill_kernels(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *into: torch.Tensor
) -> Optional[NativeKernels]:
    """The kernels, where a prefill call of these tensors can run in them (see `prefill_attention`); else None."""
    kernels = native.native_kernels()
    heads, dim = query.shape[1], query.shape[3]
    if (
        kernels is None
        or query.device.type != "cpu"
        or query.dtype not in PREFILL_TYPES
        or any(
            tensor.dtype != query.dtype or tensor.stride(-1) != 1 or tensor.requires_grad
            for tensor in (query, key, value)
        )
        or any(tensor.dtype != torch.float32 or tensor.device.type != "cpu" for tensor in into)
        or key.shape != value.shape
        or not kernels.prefill_supports(heads, key.shape[1], dim)
        or (not kernels.threaded and torch.get_num_threads() > 1)  # one thread against torch's several
        or query.shape[2] == 0
        or key.shape[2] == 0
    ):
        return None
    return kernels


def strides(tensor: torch.Tensor) -> ctypes.Array:
    """A tensor's first three strides, for the kernel's {batch, head, row} (or {sample, token[, slot]}) stride
    arguments."""
    return (ctypes.c_int64 * 3)(*tensor.stride()[:3])


def address(tensor: Optional[torch.Tensor]) -> Optional[int]:
    return None if tensor is None else tensor.data_ptr()


def addresses(*tensors: torch.Tensor) -> list[int]:
    """The data pointers of a kernel call's tensors, in order."""
    return [tensor.data_ptr() for tensor in tensors]


def packing_scratch(
    dtype: torch.dtype, kv_heads: int, dim: int, *calls: tuple[int, int, bool]
) -> Optional[torch.Tensor]:
    """A float32 buffer for the packed keys (and values) of each of `calls` ((batch, keys, segments): a call of
    element type `dtype` over `keys` keys of `batch` samples of `kv_heads` heads, of `prefill_segments` where
    `segments` is true - it packs at most SEGMENT_SLAB_KEYS keys of one sample, and float32 values too - else of
    `prefill_attention`), to pass to every call of a loop (`prefill_attention`,
    `prefill_segments`): buffers that each call allocates and frees land in different places of the heap and leave
    it larger than any one of them needs (at 128K tokens, a few MiB more resident memory than the call ever held at
    once). None where the kernels do not take the dtype."""
    kernels = native.native_kernels()
    if kernels is None or dtype not in PREFILL_TYPES:
        return None
    words = max(
        batch * kernels.packed_words(keys, dim, PREFILL_TYPES[dtype], segments) for batch, keys, segments in calls
    )
    return torch.empty(kv_heads * words, dtype=torch.float32)


def scratch_arguments(scratch: Optional[torch.Tensor]) -> tuple[Optional[int], int]:
    """(pointer, 32-bit words) of a `packing_scratch` buffer for the C calls; (None, 0): none, the call allocates."""
    if scratch is None or scratch.dtype != torch.float32 or scratch.device.type != "cpu" or not scratch.is_contiguous():
        return None, 0
    return scratch.data_ptr(), scratch.numel()


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    first: int = 0,
    row_end: Optional[torch.Tensor] = None,
    query_bits: Optional[torch.Tensor] = None,
    key_bits: Optional[torch.Tensor] = None,
    key_valid: Optional[torch.Tensor] = None,
    window: int = 0,
    local: bool = False,
    into: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    scratch: Optional[torch.Tensor] = None,
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Queries [batch, heads, L, dim] over keys/values [batch, kv_heads, S, dim] (float32 or bfloat16, sums in
    float32; GQA as in transformers) in one call of the C kernel: output [batch, heads, L, dim] of the inputs' dtype
    (laid out [batch, L, heads, dim], as torch's CPU kernel gives it) and float32 lse [batch, heads, L]; None where
    the kernel cannot take the call.

    Query row r is token `first + r`, key slot j token j. Pair (r, j) is visible iff j <= first + r (with `causal`;
    with `row_end` [batch, L], non-decreasing in r, instead iff j < row_end[r]: a staircase),
    key j is real (`key_valid` [batch, S] bool; None: all are) and, with `query_bits` [batch, L] and `key_bits`
    [batch, S] (int32, `pattern.pattern_bits`; None: no pattern), first + r - j <= window or the two share a bit.
    With `local` (bits required, `pattern.local_bits`): first + r - j <= window and the two share no bit - the
    window pairs of the window band, reading only the keys of each query block's window.
    A row that sees no key comes out 0 with lse finfo.min. With `into` (float32 output [batch, heads, L, dim] and
    lse [batch, heads, L], any strides, holding a partial result over other keys; lse finfo.min where none), each
    row's result is folded into them by log-sum-exp instead, and they are returned. `scratch` (`packing_scratch`)
    holds the packed keys, where it is large enough, instead of a buffer of the call's own."""
    kernels = prefill_kernels(query, key, value, *(into or ()))
    if kernels is None or (local and query_bits is None):
        return None
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    padding = -keys % kernels.key_array_step

    def per_key(flags: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if flags is None else F.pad(flags.to(torch.int32), (0, padding)).contiguous()

    bits = None if query_bits is None else query_bits.to(torch.int32).contiguous()
    ends = None if row_end is None else row_end.to(torch.int32).contiguous()
    key_bits = per_key(key_bits)
    real = None if key_valid is None else per_key(-key_valid.to(torch.int32))  # -1: real, 0: padding
    if into is None:
        output = query.new_empty(batch, length, heads, dim).transpose(1, 2)
        lse = query.new_empty(batch, heads, length, dtype=torch.float32)
    else:
        output, lse = into
    status = kernels.prefill(
        *addresses(query, key, value, output, lse),
        batch,
        heads,
        kv_heads,
        length,
        keys,
        dim,
        *(strides(tensor) for tensor in (query, key, value, output, lse)),
        address(ends),
        address(bits),
        address(key_bits),
        address(real),
        window,
        first,
        int(causal),
        int(local),
        int(into is not None),
        scale,
        *scratch_arguments(scratch),
        PREFILL_TYPES[query.dtype],
    )
    return (output, lse) if status == 0 else None


def prefill_segments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor,
    entry_starts: torch.Tensor,
    key_starts: torch.Tensor,
    entry_query: torch.Tensor,
    key_token: torch.Tensor,
    row_begin: torch.Tensor,
    row_end: torch.Tensor,
    scale: float,
    scratch: Optional[torch.Tensor] = None,
) -> bool:
    """The own-group pass of the CPU path (`segments.SegmentKeys`) in one call of the C kernel, folded into float32
    `output` [batch, heads, q, dim] and `lse` [batch, heads, q] (any strides; lse finfo.min where a row holds nothing
    yet).
    Query entries and keys come sorted into segments (int64 offsets, int32 indices, contiguous): segment s holds
    entries entry_starts[s] .. entry_starts[s + 1] - 1 and keys key_starts[s] .. key_starts[s + 1] - 1; entry e is
    query row entry_query[e] (sample * q + token of query [batch, heads, q, dim]) and sees its segment's keys
    row_begin[e] .. row_end[e] - 1; key i is key_token[i] (sample * kv + token of key/value [batch, kv_heads, kv,
    dim]). A query's entries must lie in distinct segments. `scratch` as in `prefill_attention` (a call packs at
    most SEGMENT_SLAB_KEYS keys at once). False (nothing written) where the kernel cannot take the call."""
    kernels = prefill_kernels(query, key, value, output, lse)
    if kernels is None:
        return False
    longs, ints = (entry_starts, key_starts), (entry_query, key_token, row_begin, row_end)
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in longs) or any(
        t.dtype != torch.int32 or not t.is_contiguous() for t in ints
    ):
        raise ValueError("prefill_segments takes contiguous int64 offsets and int32 indices")
    status = kernels.prefill_segments(
        *addresses(query, key, value, output, lse),
        query.shape[1],
        key.shape[1],
        query.shape[3],
        *(strides(tensor) for tensor in (query, key, value, output, lse)),
        query.shape[2],
        key.shape[2],
        len(entry_starts) - 1,
        *(tensor.data_ptr() for tensor in longs + ints),
        SEGMENT_SLAB_KEYS,
        scale,
        *scratch_arguments(scratch),
        PREFILL_TYPES[query.dtype],
    )
    return status == 0


def sink_pairs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor,
    sink_position: torch.Tensor,
    sink_group: torch.Tensor,
    probes: torch.Tensor,
    done: Optional[torch.Tensor],
    window: int,
    scale: float,
) -> bool:
    """The window band's sink pairs (`partials.sink_part`) of queries [batch, heads, L, dim] (the last L of the keys)
    in one call of the C kernel, folded into float32 `output` [batch, heads, L, dim] and `lse` [batch, heads, L] (any
    strides) by log-sum-exp. Sink t of sample b lies at sink_position[b, t] (-1: none) in group sink_group[b, t]; a
    query sees the sinks more than `window` before it whose group is none of its `probes` [batch, L, top_k], unless
    `done` [batch, L] marks it. False (nothing written) where the kernel cannot take the call."""
    kernels = prefill_kernels(query, key, value, output, lse)
    if kernels is None:
        return False
    batch, heads, length, dim = query.shape
    positions, groups, probes = (t.long().contiguous() for t in (sink_position, sink_group, probes))
    done = None if done is None else done.to(torch.uint8).contiguous()
    status = kernels.sink_pairs(
        *addresses(query, key, value, output, lse),
        batch,
        heads,
        key.shape[1],
        length,
        dim,
        *(strides(tensor) for tensor in (query, key, value, output, lse)),
        positions.data_ptr(),
        groups.data_ptr(),
        positions.shape[1],
        probes.data_ptr(),
        probes.shape[2],
        address(done),
        window,
        key.shape[2] - length,
        scale,
        PREFILL_TYPES[query.dtype],
    )
    return status == 0
