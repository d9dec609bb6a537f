"""The CPU kernels' library (`csrc/decode.c`, `csrc/prefill.c`, `csrc/segments.c`, `csrc/routing.c`), loaded:
its C functions with their argument types (`NativeKernels`), whether they run in this process (`native_kernels`,
`torch_path`) and how they were built (`build_record`).

The library is built on first use with the machine's C compiler and cached (`build`: compiler, flags, target, the
cache of built libraries); this module loads it, and `native_decode` (decoding steps, a decoding token's routing) and
`native_prefill` (prefill calls: the own-group pass, the window band, whole causal or masked calls) call it. The
prefill kernels take float32, and bfloat16 with float32 sums: where the processor has bfloat16 dot products
(AVX512_BF16) they multiply bfloat16 pairs, twice the products per instruction of float32 (csrc/prefill.c).

Where it cannot run - no C compiler (`$CC`, else `cc`, `gcc` or `clang` on the PATH), a failed build, a dtype other
than float32, bfloat16 and float16 (float32 and bfloat16 for the prefill kernels), a head shape it does not take -
the calls return None and the caller runs its torch path, which gives the same result. `FOCUS_HF_NATIVE=0` turns the
kernels off. `build_record` says how the kernels in use were built, for benchmark rows.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os
import sys
from pathlib import Path
from typing import Iterator, Optional

from focus_hf.attention.cpu.build import COMPILE_FLAGS, compiler_version, cpu_target, kernels_library, resolved_target

NATIVE_ENV = "FOCUS_HF_NATIVE"


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
