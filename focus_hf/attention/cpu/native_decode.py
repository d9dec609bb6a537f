"""Decoding steps and a decoding token's routing in the CPU kernels (`csrc/decode.c`, `csrc/routing.c`), each in
one C call.

A decoding step of one query costs a few dozen microseconds of eager tensor operations on CPU (copying the window
next to the group's keys, the attention call, the output's reshapes), as much as dense attention over a 1K cache.
`attend_runs` does the step's attention in one C call that reads the probed groups' keys and the window where they
lie; calls over many keys split them among torch's OpenMP threads. `grouped_step` appends the key that leaves the
window to its group's buffers (`grouped_keys.GroupedKeys`) and attends in the same call; `paged_decode` attends
straight from a paged KV cache (vLLM's); `copy_row` and `grouped_fill` fill the group-sorted copy. `route_token`
routes a decoding token in one call.

Each returns None (or False, or a `STEP_` code) where the kernels cannot take the call (`native`): the caller then
runs its torch path, which gives the same result.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional, Sequence, Union

import torch

from focus_hf.attention.cpu import native
from focus_hf.attention.cpu.native import NativeKernels

# The kernel's element types (csrc/decode.c): each call reads and writes one of them, accumulating in float32.
ELEMENT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def serves(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether decoding steps of this dtype and head shape run in the kernel on CPU (building it if needed)."""
    kernel = native.native_kernels()
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
    status = native.native_kernels().attend(
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
    kernels = native.native_kernels()
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
    kernels = native.native_kernels()
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
    kernel = native.native_kernels()
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
    kernel = native.native_kernels()
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
    kernels = native.native_kernels()
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
