"""The CPU kernels (`csrc/decode.c`, `csrc/prefill.c`, `csrc/segments.c`, `csrc/routing.c`), compiled on first use
with the machine's C compiler.

A decoding step of one query costs a few dozen microseconds of eager tensor operations on CPU (copying the window
next to the group's keys, the attention call, the output's reshapes), as much as dense attention over a 1K cache.
`attend_runs` does the step's attention in one C call that reads the probed groups' keys and the window where they
lie; calls over many keys split them among torch's OpenMP threads. `prefill_attention` runs many queries over many
keys with the Focus pattern evaluated from per-token group bits as it goes (no n x n mask is built or read):
with the pattern, 1.05-1.5x the speed of torch's unmasked causal kernel at 256-2K tokens, where torch's kernel
with the pattern as a bias runs 0.8-0.9x of it. Per visible pair it runs at 1.0-1.1x of torch's kernel on long
non-causal calls (float32 on 2 AVX-512 cores: ~155-165 GFLOP/s for both), and it gains more from skipping
hidden pairs in blocks of 128 keys (torch's CPU kernel skips in blocks of several hundred). `prefill_segments`
runs set A of a block of queries of the fast path in one call, its keys read where they lie through their token
indices (sorted into segments by the counting sorts of csrc/segments.c, `segments.SegmentKeys`), and `sink_pairs`
folds set B's sink pairs into the output. `route_token` routes a decoding token in one call.

The library is built on first use with the machine's C compiler and cached (`build`: compiler, flags, target, the
cache of built libraries); this module loads it and calls it. The prefill kernels take float32, and bfloat16 with
float32 sums: where the processor has bfloat16 dot products (AVX512_BF16) they multiply bfloat16 pairs, twice the
products per instruction of float32 (csrc/prefill.c).

Where it cannot run - no C compiler (`$CC`, else `cc`, `gcc` or `clang` on the PATH), a failed build, a dtype other
than float32, bfloat16 and float16 (float32 and bfloat16 for the prefill kernels), a head shape it does not take -
the functions here return None and the caller runs its torch path, which gives the same result. `FOCUS_HF_NATIVE=0`
turns the kernels off. `build_record` says how the kernels in use were built, for benchmark rows.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from focus_hf.attention.cpu.build import COMPILE_FLAGS, compiler_version, cpu_target, kernels_library, resolved_target

NATIVE_ENV = "FOCUS_HF_NATIVE"
# Keys of a segment that `prefill_segments` packs at once (each slab's entries are folded into their rows before the
# next): the packed copy stays at 1.5 MiB for 3 kv heads of 64 dims however long the segment, and in the cores'
# caches (K=8 top-1 at 64K tokens, segments of 8K keys, alternating: slabs of 256 / 512 / 1K / 2K / 4K / 8K keys
# 5.10 / 4.61 / 4.36 / 4.34 / 4.78 / 5.30 s).
SEGMENT_SLAB_KEYS = 2048
# The kernel's element types (csrc/decode.c): each call reads and writes one of them, accumulating in float32.
ELEMENT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class NativeKernels:
    """The loaded library: `supports(heads, kv_heads, dim)`, `attend(...)`, `copy_row(...)`, `grouped_fill(...)` and
    `grouped_step(...)` (csrc/decode.c),
    `prefill_supports(heads, kv_heads, dim)`, `prefill(...)`, `prefill_segments(...)` and `sink_pairs(...)`
    (csrc/prefill.c),
    `segment_keys(...)` and `segment_entries(...)` (csrc/segments.c)."""

    def __init__(self, library: ctypes.CDLL, path: Path, cc: str, target: tuple[str, ...]) -> None:
        # Built with OpenMP (torch's pool): a prefill call splits its work among torch's threads.
        self.threaded = "-fopenmp" in target
        self.compiler, self.target = cc, target  # what it was built with (`build_record`)
        self.build_id = path.stem  # the sources, compiler, flags and machine (`build.library_path`)
        size, pointer = ctypes.c_int64, ctypes.c_void_p
        self.supports = library.focus_decode_supports
        self.supports.argtypes = [size, size, size, ctypes.c_int]
        self.supports.restype = ctypes.c_int
        self.attend = library.focus_decode
        # query, heads, kv_heads, dim, scale, runs, keys, values, lengths, head_strides, out, element type
        self.attend.argtypes = [pointer, size, size, size, ctypes.c_float, size, *[pointer] * 5, ctypes.c_int]
        self.attend.restype = ctypes.c_int
        self.paged_decode = library.focus_paged_decode
        # query, heads, kv_heads, dim, scale, keys, values, 5 strides, block size, block row, length, groups,
        # groups count, probes, top_k, every key, sink tokens, window, out
        self.paged_decode.argtypes = [pointer, *[size] * 3, ctypes.c_float, pointer, pointer, *[size] * 6]
        self.paged_decode.argtypes += [pointer, size, pointer, size, pointer, size, pointer, size, size, pointer]
        self.paged_decode.restype = ctypes.c_int
        self.copy_row = library.focus_copy_row
        self.copy_row.argtypes = [pointer, pointer, size, pointer, pointer, size, size, size]
        self.grouped_fill = library.focus_grouped_fill
        # buffer keys, buffer values, capacities, counts, keys, values, head stride, row stride, kv heads, row bytes,
        # groups, take, count
        self.grouped_fill.argtypes = [*[pointer] * 6, *[size] * 4, pointer, pointer, size]
        self.grouped_fill.restype = None
        self.grouped_step = library.focus_grouped_step
        # query, heads, kv_heads, dim, scale, buffer keys, buffer values, capacities, counts, groups, sinks, cache
        # keys, cache values, cache head stride, position, width, group, sink, valid, probes, top_k, out, element type
        self.grouped_step.argtypes = [pointer, size, size, size, ctypes.c_float, *[pointer] * 4, size, size]
        self.grouped_step.argtypes += [pointer, pointer, size, size, size, *[pointer] * 4, size, pointer, ctypes.c_int]
        self.grouped_step.restype = ctypes.c_int
        self.prefill_supports = library.focus_prefill_supports
        self.prefill_supports.argtypes = [size, size, size]
        self.prefill_supports.restype = ctypes.c_int
        self.prefill = library.focus_prefill
        # q, k, v, out, lse, B, H, KH, L, S, dim, 5 stride triples, row ends, query bits, key bits, key valid, window,
        # first, causal, local, merge, scale, scratch, scratch words, element type
        flag = ctypes.c_int
        self.prefill.argtypes = [
            *[pointer] * 5,
            *[size] * 6,
            *[pointer] * 9,
            size,
            size,
            flag,
            flag,
            flag,
            ctypes.c_float,
            pointer,
            size,
            flag,
        ]
        self.prefill.restype = ctypes.c_int
        self.prefill_segments = library.focus_prefill_segments
        # q, k, v, out, lse, H, KH, dim, 5 stride triples, q tokens, kv tokens, segments, entry starts, key starts,
        # entry query, key token, row begin, row end, slab keys, scale, scratch, scratch words, element type
        self.prefill_segments.argtypes = [*[pointer] * 5, *[size] * 3, *[pointer] * 5, *[size] * 3, *[pointer] * 6]
        self.prefill_segments.argtypes += [size, ctypes.c_float, pointer, size, flag]
        self.prefill_segments.restype = ctypes.c_int
        self.sink_pairs = library.focus_sink_pairs
        # q, k, v, out, lse, B, H, KH, L, dim, 5 stride triples, sink position, sink group, S, probes, top_k, done,
        # window, first, scale, element type
        self.sink_pairs.argtypes = [*[pointer] * 5, *[size] * 5, *[pointer] * 7, size, pointer, size, pointer]
        self.sink_pairs.argtypes += [size, size, ctypes.c_float, flag]
        self.sink_pairs.restype = ctypes.c_int
        self.packed_words = library.focus_packed_words
        self.packed_words.argtypes = [size, size, flag, flag]
        self.packed_words.restype = size
        self.build_features = library.focus_build_features
        self.build_features.argtypes = []
        self.build_features.restype = flag
        self.vector_floats = library.focus_vector_floats
        self.vector_floats.argtypes = []
        self.vector_floats.restype = flag
        # what a prefill call's per-key arrays are padded to (csrc/prefill.c's KEY_ARRAY_STEP: a multiple of every
        # target's key block, so that blocks read whole vectors)
        step = library.focus_key_array_step
        step.argtypes, step.restype = [], flag
        self.key_array_step = int(step())
        self.segment_keys = library.focus_segment_keys
        # groups, group strides, valid, sinks, batch, kv, K, key token, key starts, riders, last sink
        self.segment_keys.argtypes = [*[pointer] * 4, *[size] * 3, *[pointer] * 4]
        self.segment_keys.restype = ctypes.c_int
        self.segment_entries = library.focus_segment_entries
        # probes, probe strides, groups, group strides, valid, batch, kv, q, K, top_k, first, rows, running, counted,
        # riders, last sink, entry starts, entry query, row begin, row end, rides
        self.segment_entries.argtypes = [*[pointer] * 5, *[size] * 7, pointer, size, *[pointer] * 7]
        self.segment_entries.restype = ctypes.c_int
        self.copy_row.restype = None
        self.route_token = library.focus_route_token
        # key scores, query scores, groups, iterations, columns, new columns, top_k, probe mass, probes, key group
        self.route_token.argtypes = [pointer, pointer, size, size, pointer, pointer, size, ctypes.c_double, pointer]
        self.route_token.argtypes += [pointer]
        self.route_token.restype = ctypes.c_int


def native_disabled() -> bool:
    return os.environ.get(NATIVE_ENV, "").strip().lower() in ("0", "false", "no", "off")


# focus_build_features' bits (csrc/prefill.c): what the compiled kernels use.
BUILD_FEATURES = {
    1: "avx512 vectors",
    2: "avx2+fma",
    4: "avx512_bf16 dot products",
    8: "openmp",
    16: "amx_bf16 tiles",
}


def build_record() -> dict:
    """How the CPU kernels that run were built, for benchmark rows: the compiler and its version, the target flags
    (with `-march=native`, the processor the compiler took it for) and what the compiled code uses
    (BUILD_FEATURES); {"built": False, ...} where they are not in use."""
    kernels = native_kernels()
    if kernels is None:
        return {"built": False, "reason": "FOCUS_HF_NATIVE=0" if native_disabled() else "no compiler or build failed"}
    features = kernels.build_features()
    march = [flag.split("=", 1)[1] for flag in kernels.target if flag.startswith("-march=")]
    return {
        "built": True,
        "target": cpu_target(),
        "compiler": compiler_version(kernels.compiler),
        "flags": " ".join(COMPILE_FLAGS[:-1] + kernels.target),  # without -c
        "march": resolved_target(kernels.compiler, kernels.target) if march == ["native"] else (march or [None])[0],
        "uses": [name for bit, name in BUILD_FEATURES.items() if features & bit],
        "vector_floats": kernels.vector_floats(),
    }


# Set while a call runs its torch path on purpose (`torch_path`): "auto" times and dispatches it beside the kernels'.
_torch_only: contextvars.ContextVar[bool] = contextvars.ContextVar("focus_hf_torch_only", default=False)


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """Within it, every call of this module answers as if the kernels could not run: the callers run their torch
    path (the same result). "auto" uses it to time, and to run, the torch path where it is the faster one."""
    token = _torch_only.set(True)
    try:
        yield
    finally:
        _torch_only.reset(token)


def kernels_identity() -> str:
    """Which CPU kernels this process runs: their build (`library_path`'s digest of the sources, compiler, target and
    machine), or "torch" where none are built. A crossover measured with one build does not hold for another: the
    same sparse path may be twice as fast in one build's C kernels as in torch operations, and half as fast in
    another's (`crossover.Shape`)."""
    kernels = built_kernels()
    return "torch" if kernels is None else kernels.build_id


def native_kernels() -> Optional[NativeKernels]:
    """The compiled kernels (built now if this machine has none yet), or None where they cannot be had (the reason
    is printed once) or inside `torch_path`."""
    return None if _torch_only.get() else built_kernels()


@functools.lru_cache(maxsize=1)
def built_kernels() -> Optional[NativeKernels]:
    """The compiled kernels for FOCUS_HF_CPU_TARGET (built now where this machine has none yet), or None where they
    cannot be had (the reason is printed once)."""
    if native_disabled() or sys.platform == "win32":
        return None
    return kernels_library(NativeKernels)


def serves(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether decoding steps of this dtype and head shape run in the kernel on CPU (building it if needed)."""
    kernel = native_kernels()
    return kernel is not None and _supports(kernel, dtype, heads, kv_heads, head_dim)


@functools.lru_cache(maxsize=64)
def _supports(kernel: "NativeKernels", dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """`serves` for a built library, asked of it once per shape (every decoding step of every layer asks)."""
    element_type = ELEMENT_TYPES.get(dtype)
    return element_type is not None and bool(kernel.supports(heads, kv_heads, head_dim, element_type))


def rows_contiguous(tensor: torch.Tensor) -> bool:
    """Whether [kv_heads, n, dim] has contiguous rows one after another within each head."""
    return tensor.stride(2) == 1 and (tensor.shape[1] <= 1 or tensor.stride(1) == tensor.shape[2])


# A run of keys and values for `attend_runs`: (keys, values) [kv_heads, n, dim], or (keys, values, start, length):
# their rows start .. start + length - 1, read in place.
Run = Union[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, int, int]]


def attend_runs(query: torch.Tensor, runs: Sequence[Run], scale: float) -> Optional[torch.Tensor]:
    """One query [heads, dim] over the concatenation of `runs` (`Run`: keys and values [kv_heads, n_r, dim], whole or
    a span of their rows - a decoding step's slices cost more as tensor views than the kernel's work on them), with
    one softmax: [heads, dim]. Query head h reads kv head h // (heads // kv_heads), as in transformers' GQA. None
    where the kernel cannot take the call (see the module docstring): the caller then computes it with torch."""
    heads, dim = query.shape
    kv_heads = runs[0][0].shape[0]
    if not query.is_cpu or query.requires_grad or not serves(query.dtype, heads, kv_heads, dim):
        return None
    count = len(runs)
    key_pointers, value_pointers = (ctypes.c_void_p * count)(), (ctypes.c_void_p * count)()
    lengths, head_strides = (ctypes.c_int64 * count)(), (ctypes.c_int64 * count)()
    size = query.element_size()
    for index, run in enumerate(runs):
        keys, values = run[0], run[1]
        start, length = (run[2], run[3]) if len(run) == 4 else (0, keys.shape[1])
        if (
            keys.dtype != query.dtype
            or not keys.is_cpu
            or keys.shape != values.shape
            or keys.shape[0] != kv_heads
            or keys.shape[2] != dim
            or keys.stride() != values.stride()
            or not rows_contiguous(keys)
            or not 0 <= start <= start + length <= keys.shape[1]
        ):
            return None
        offset = start * keys.stride(1) * size
        key_pointers[index] = keys.data_ptr() + offset
        value_pointers[index] = values.data_ptr() + offset
        lengths[index], head_strides[index] = length, keys.stride(0)
    query = query.contiguous()
    output = torch.empty_like(query)
    status = native_kernels().attend(
        query.data_ptr(),
        heads,
        kv_heads,
        dim,
        scale,
        count,
        key_pointers,
        value_pointers,
        lengths,
        head_strides,
        output.data_ptr(),
        ELEMENT_TYPES[query.dtype],
    )
    return output if status == 0 else None


def route_token(
    key_scores: torch.Tensor,
    query_scores: Optional[torch.Tensor],
    columns: torch.Tensor,
    new_columns: torch.Tensor,
    top_k: int,
    probe_mass: Optional[float],
) -> Optional[tuple[torch.Tensor, int]]:
    """Route one decoding token in one C call (csrc/routing.c): the causal Sinkhorn step of `routing.causal_sinkhorn`
    and the groups of `routing.token_groups`, the same values within float32 rounding.

    Args:
        key_scores, query_scores: float32 [K] the token's router scores (query_scores None: no query router).
        columns: float32 [iterations * K] the running log column sums before the token.
        new_columns: float32 [iterations * K], written with the sums after it (may be `columns` itself).

    Returns:
        (the groups it probes, int64 [top_k]; its group as a key), or None where the kernel cannot run (nothing is
        written then): the caller runs the torch operations.
    """
    kernels = native_kernels()
    tensors = (key_scores, columns, new_columns) + (() if query_scores is None else (query_scores,))
    if kernels is None or any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() for t in tensors):
        return None
    groups = key_scores.shape[0]
    if (query_scores is not None and query_scores.shape != key_scores.shape) or columns.shape != new_columns.shape:
        return None
    probes = torch.empty(top_k, dtype=torch.int64)
    key_group = ctypes.c_int64()
    status = kernels.route_token(
        key_scores.data_ptr(),
        None if query_scores is None else query_scores.data_ptr(),
        groups,
        columns.shape[0] // groups,
        columns.data_ptr(),
        new_columns.data_ptr(),
        top_k,
        -1.0 if probe_mass is None else probe_mass,
        probes.data_ptr(),
        ctypes.byref(key_group),
    )
    return (probes, key_group.value) if status == 0 else None


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_row: torch.Tensor,
    length: int,
    slot_groups: torch.Tensor,
    num_groups: int,
    probes: torch.Tensor,
    every_key: torch.Tensor,
    sink_tokens: int,
    window: int,
    scale: float,
) -> Optional[torch.Tensor]:
    """One decoding query [heads, dim] of a request whose `length` tokens lie in a paged KV cache, attending with the
    Focus pattern straight from the cache (csrc/decode.c, `focus_paged_decode`): no key is gathered or copied.

    Args:
        key_cache, value_cache: [num_blocks, kv_heads, block_size, dim] views of the cache (any strides; values'
            elements of a row side by side).
        block_row: int32 [>= blocks of the request]: the cache block of each of the request's blocks.
        slot_groups: int32 [num_blocks * block_size]: the group of the key in each slot of the cache.
        probes: int64 [top_k]: the groups the query probes, of `num_groups`.
        every_key: bool or uint8 [kv_heads]: kv heads that see every key (dense heads; all of them where the pattern
            hides nothing). The others see the sinks, the window and the keys of the probed groups.

    Returns:
        [heads, dim], or None where the kernel cannot take the call (no kernels, a dtype other than float32, a head
        shape or block size it does not take): the caller then gathers the keys and runs its torch path.
    """
    kernels = native_kernels()
    heads, dim = query.shape
    num_blocks, kv_heads, block_size, _ = key_cache.shape
    if (
        kernels is None
        or any(t.dtype != torch.float32 or not t.is_cpu for t in (query, key_cache, value_cache))
        or query.requires_grad
        or value_cache.stride(3) != 1
        or key_cache.stride()[:2] != value_cache.stride()[:2]
        or block_row.dtype != torch.int32
        or slot_groups.dtype != torch.int32
        or not (block_row.is_contiguous() and slot_groups.is_contiguous())
        or slot_groups.shape[0] < num_blocks * block_size
        or block_row.shape[0] * block_size < length
    ):
        return None
    query = query.contiguous()
    probes = probes.to(torch.int64).contiguous()
    flags = every_key.to(torch.uint8).contiguous()
    output = torch.empty_like(query)
    status = kernels.paged_decode(
        query.data_ptr(),
        heads,
        kv_heads,
        dim,
        scale,
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        key_cache.stride(3),
        value_cache.stride(2),
        block_size,
        block_row.data_ptr(),
        length,
        slot_groups.data_ptr(),
        num_groups,
        probes.data_ptr(),
        probes.numel(),
        flags.data_ptr(),
        sink_tokens,
        window,
        output.data_ptr(),
    )
    return output if status == 0 else None


def copy_row(
    keys: torch.Tensor, values: torch.Tensor, slot: int, new_keys: torch.Tensor, new_values: torch.Tensor, position: int
) -> bool:
    """Write row `position` of new_keys/new_values [kv_heads, n, dim] into row `slot` of keys/values (same dtype,
    rows contiguous, keys and values strided alike): one call instead of four tensor operations. False (nothing
    written) where the kernel is not available or the layouts differ; the caller then copies with torch."""
    kernel = native_kernels()
    if (
        kernel is None
        or keys.device.type != "cpu"
        or new_keys.device != keys.device
        or new_keys.dtype != keys.dtype
        or keys.stride() != values.stride()
        or new_keys.stride() != new_values.stride()
        or keys.stride(2) != 1
        or new_keys.stride(2) != 1
    ):
        return False
    size = keys.element_size()
    kernel.copy_row(
        keys.data_ptr() + slot * keys.stride(1) * size,
        values.data_ptr() + slot * values.stride(1) * size,
        keys.stride(0) * size,
        new_keys.data_ptr() + position * new_keys.stride(1) * size,
        new_values.data_ptr() + position * new_values.stride(1) * size,
        new_keys.stride(0) * size,
        keys.shape[0],
        keys.shape[2] * size,
    )
    return True


def grouped_fill(
    tables: "GroupTables", keys: torch.Tensor, values: torch.Tensor, groups: torch.Tensor, take: torch.Tensor
) -> bool:
    """Append each row j of keys/values [kv_heads, n, dim] with take[j] to group groups[j]'s buffers in `tables`, in
    position order, in one pass (csrc/decode.c, `focus_grouped_fill`): the buffers must already hold them, and
    every taken row's group lie in 0 .. K - 1. False (nothing written) where the kernel is not available or the
    layouts differ; the caller then sorts and copies with torch."""
    kernel = native_kernels()
    if (
        kernel is None
        or keys.device.type != "cpu"
        or values.dtype != keys.dtype
        or keys.stride() != values.stride()
        or keys.stride(2) != 1
    ):
        return False
    groups = groups.to(torch.int64).contiguous()
    take = take.to(torch.uint8).contiguous()
    size = keys.element_size()
    kernel.grouped_fill(
        tables.keys, tables.values, tables.capacities, tables.counts, keys.data_ptr(), values.data_ptr(),
        keys.stride(0) * size, keys.stride(1) * size, keys.shape[0], keys.shape[2] * size,
        groups.data_ptr(), take.data_ptr(), keys.shape[1],
    )  # fmt: skip
    return True


class GroupTables:
    """The buffers of a group-sorted copy (`grouped_keys.GroupedKeys`) as `grouped_step` hands them to the kernel:
    per group, the addresses of its key and value buffers, their capacity (slots) and the slots filled. Arrays kept
    across steps and brought up to date where a buffer grows, so that a step passes four addresses."""

    def __init__(self, num_groups: int) -> None:
        self.keys = (ctypes.c_void_p * num_groups)()
        self.values = (ctypes.c_void_p * num_groups)()
        self.capacities = (ctypes.c_int64 * num_groups)()
        self.counts = (ctypes.c_int64 * num_groups)()

    def hold(self, group: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Group `group`'s buffers are now keys / values [kv_heads, capacity, dim] (contiguous)."""
        self.keys[group], self.values[group] = keys.data_ptr(), values.data_ptr()
        self.capacities[group] = keys.shape[1]


# What `grouped_step` reports besides an output (csrc/decode.c, focus_grouped_step): nothing was changed, and the
# caller takes the step another way - the kernel cannot take it (REFUSED), the key's group has no free slot (FULL),
# the key is a sink (SINK), or a probe or the key is in no group yet (UNROUTED); or the key was appended but the
# attention failed (APPENDED).
STEP_REFUSED, STEP_FULL, STEP_SINK, STEP_UNROUTED, STEP_APPENDED = 1, 2, 3, 4, 5


def element_address(tensor: torch.Tensor, *index: int) -> int:
    """The address of `tensor[index]` (a CPU tensor; no view is made)."""
    return tensor.data_ptr() + sum(i * stride for i, stride in zip(index, tensor.stride())) * tensor.element_size()


def grouped_step(
    query: torch.Tensor,
    tables: GroupTables,
    sinks: int,
    key: torch.Tensor,
    value: torch.Tensor,
    sample: int,
    position: int,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    key_valid: Optional[torch.Tensor],
    query_groups: torch.Tensor,
    scale: float,
) -> Union[torch.Tensor, int]:
    """A decoding step of sample `sample` over its group-sorted copy, in one call (csrc/decode.c,
    `focus_grouped_step`): the key at `position` of its keys/values (key/value [batch, kv_heads, n, dim], the cache:
    read in place, no view per sample) - the one that has just left the window - appended to its group's buffers in
    `tables` (which `sinks` slots of each begin with), then the query [heads, dim] attended to its probed groups
    (query_groups [batch, 1, top_k]) and the window (rows position + 1 .. n - 1). The key's group, sink flag and
    validity are read from key_groups / key_sink / key_valid [batch, n] (None: every key real). Returns [heads, dim],
    or one of the STEP_ codes."""
    heads, dim = query.shape
    kv_heads = key.shape[1]
    kernels = native_kernels()
    if (
        kernels is None
        or query.requires_grad
        or not query.is_contiguous()
        or key.dtype != query.dtype
        or key.shape[3] != dim
        or key.stride() != value.stride()
        or key.stride(3) != 1
        or (key.shape[2] > 1 and key.stride(2) != dim)
        or key_groups.dtype != torch.int64
        or key_sink.dtype != torch.bool  # the kernel reads one byte per flag
        or (key_valid is not None and key_valid.dtype != torch.bool)
        or query_groups.dtype != torch.int64
        or query_groups.stride(-1) != 1
        or not serves(query.dtype, heads, kv_heads, dim)
    ):
        return STEP_REFUSED
    output = torch.empty_like(query)
    status = kernels.grouped_step(
        query.data_ptr(),
        heads,
        kv_heads,
        dim,
        scale,
        tables.keys,
        tables.values,
        tables.capacities,
        tables.counts,
        len(tables.counts),
        sinks,
        element_address(key, sample),
        element_address(value, sample),
        key.stride(1),
        position,
        key.shape[2] - position - 1,
        element_address(key_groups, sample, position),
        element_address(key_sink, sample, position),
        None if key_valid is None else element_address(key_valid, sample, position),
        element_address(query_groups, sample, 0, 0),
        query_groups.shape[-1],
        output.data_ptr(),
        ELEMENT_TYPES[query.dtype],
    )
    return output if status == 0 else status


# The element types of the prefill kernels (csrc/prefill.c): queries, keys and values of one of them, float32 sums.
PREFILL_TYPES = {torch.float32: 0, torch.bfloat16: 1}


def prefill_kernels(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *into: torch.Tensor
) -> Optional[NativeKernels]:
    """The kernels, where a prefill call of these tensors can run in them (see `prefill_attention`); else None."""
    kernels = native_kernels()
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
    kernels = native_kernels()
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
    local part of the fast path, reading only the keys of each query block's window.
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
    """Set A of the fast path (`segments.SegmentKeys`) in one call of the C kernel, folded into float32 `output`
    [batch, heads, q, dim] and `lse` [batch, heads, q] (any strides; lse finfo.min where a row holds nothing yet).
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
    """Set B's sink pairs (`partials.sink_part`) of queries [batch, heads, L, dim] (the last L of the keys) in one
    call of the C kernel, folded into float32 `output` [batch, heads, L, dim] and `lse` [batch, heads, L] (any
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
