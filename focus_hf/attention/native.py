"""The CPU decoding kernel (`csrc/decode.c`), compiled on first use with the machine's C compiler.

A decoding step of one query costs a few dozen microseconds of eager tensor operations on CPU (copying the window
next to the group's keys, the attention call, the output's reshapes), as much as dense attention over a 1K cache.
`attend_runs` does the step's attention in one C call that reads the probed groups' keys and the window where they
lie; calls over many keys split them among torch's OpenMP threads. The library is built once per machine (`cc -O3
-march=native`, well under a second; without `-march=native` where the compiler refuses it, without `-fopenmp` where
torch does not run GNU OpenMP) into `<cache>/kernels/` (`aliases.default_cache_dir`) and loaded with ctypes: no build
step at install, no dependency.

Where it cannot run - no C compiler (`$CC`, else `cc`, `gcc` or `clang` on the PATH), a failed build, a dtype other
than float32, bfloat16 and float16, a head shape it does not take - `attend_runs` returns None and the caller runs
its torch path, which gives the same result. `FOCUS_HF_NATIVE=0` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch

from focus_hf.aliases import default_cache_dir

NATIVE_ENV = "FOCUS_HF_NATIVE"
SOURCE = Path(__file__).with_name("csrc") / "decode.c"
# -ffast-math lets the compiler vectorise the sums and exp; it is given to the compile step only, because linking
# with it adds a start-up routine that sets flush-to-zero for the whole process (denormals would read as 0 in torch,
# numpy and Python floats alike).
COMPILE_FLAGS = ("-O3", "-ffast-math", "-fopenmp-simd", "-fPIC", "-c")
LINK_FLAGS = ("-shared",)
# Tried in turn: this processor's instruction set, else the compiler's default target (vectors of 16 floats are
# then split into what the target has); each with OpenMP first where torch runs on GNU OpenMP (`openmp_flags`).
TARGETS = (("-march=native",), ())
BUILD_TIMEOUT_S = 120
# The kernel's element types (csrc/decode.c): each call reads and writes one of them, accumulating in float32.
ELEMENT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class DecodeKernel:
    """The loaded library: `supports(heads, kv_heads, dim)`, `attend(...)` and `copy_row(...)` (csrc/decode.c)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        size, pointer = ctypes.c_int64, ctypes.c_void_p
        self.supports = library.focus_decode_supports
        self.supports.argtypes = [size, size, size, ctypes.c_int]
        self.supports.restype = ctypes.c_int
        self.attend = library.focus_decode
        # query, heads, kv_heads, dim, scale, runs, keys, values, lengths, head_strides, out, element type
        self.attend.argtypes = [pointer, size, size, size, ctypes.c_float, size, *[pointer] * 5, ctypes.c_int]
        self.attend.restype = ctypes.c_int
        self.copy_row = library.focus_copy_row
        self.copy_row.argtypes = [pointer, pointer, size, pointer, pointer, size, size, size]
        self.copy_row.restype = None


def native_disabled() -> bool:
    return os.environ.get(NATIVE_ENV, "").strip().lower() in ("0", "false", "no", "off")


def compiler() -> Optional[str]:
    """The C compiler to build with: `$CC`, else the first of cc, gcc, clang on the PATH; None if there is none."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def machine_tag() -> str:
    """What a `-march=native` build depends on: the processor's name and instruction-set flags."""
    tag = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                tag += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        tag += platform.processor()
    return tag


def openmp_flags() -> tuple[tuple[str, ...], ...]:
    """(("-fopenmp",), ()) where this process already runs GNU OpenMP (torch's pip wheels bundle libgomp.so.1, and a
    library linked with -fopenmp then shares torch's thread pool instead of starting a second one); else ((),)."""
    try:
        shared = any("libgomp" in line for line in Path("/proc/self/maps").read_text().splitlines())
    except OSError:
        shared = False
    return (("-fopenmp",), ()) if shared else ((),)


def library_path(source: bytes, cc: str, target: tuple[str, ...]) -> Path:
    parts = [source, cc, " ".join(COMPILE_FLAGS + LINK_FLAGS + target), machine_tag()]
    digest = hashlib.sha256(b"\0".join(part if isinstance(part, bytes) else part.encode() for part in parts))
    return default_cache_dir() / "kernels" / f"focus-decode-{digest.hexdigest()[:16]}.so"


def build(cc: str, target: tuple[str, ...], path: Path) -> None:
    """Compile the kernel to `path` (into a temporary file first, so that a concurrent process never loads half).
    `target` goes to both steps: -fopenmp at the link step links the OpenMP runtime."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".build-", suffix=".so")
    os.close(handle)
    objects = temporary + ".o"
    try:
        for command in (
            [cc, *COMPILE_FLAGS, *target, str(SOURCE), "-o", objects],
            [cc, *LINK_FLAGS, *target, objects, "-o", temporary, "-lm"],
        ):
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        os.replace(temporary, path)
    finally:
        for leftover in (temporary, objects):
            if os.path.exists(leftover):
                os.remove(leftover)


@functools.lru_cache(maxsize=1)
def decode_kernel() -> Optional[DecodeKernel]:
    """The compiled kernel (built now if this machine has none yet), or None where it cannot be had (the reason is
    printed once)."""
    if native_disabled() or sys.platform == "win32":
        return None
    cc = compiler()
    if cc is None:
        print("focus_hf: no C compiler found (set $CC); decoding steps use torch operations", file=sys.stderr)
        return None
    source = SOURCE.read_bytes()
    failure: object = None
    for target in (arch + openmp for arch in TARGETS for openmp in openmp_flags()):
        path = library_path(source, cc, target)
        try:
            if not path.exists():
                build(cc, target, path)
            return DecodeKernel(ctypes.CDLL(str(path)))
        except (OSError, subprocess.SubprocessError) as error:
            failure = getattr(error, "stderr", None) or error
    print(f"focus_hf: could not build the CPU decoding kernel ({failure}); using torch operations", file=sys.stderr)
    return None


def serves(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether decoding steps of this dtype and head shape run in the kernel on CPU (building it if needed)."""
    kernel = decode_kernel()
    element_type = ELEMENT_TYPES.get(dtype)
    return (
        kernel is not None
        and element_type is not None
        and bool(kernel.supports(heads, kv_heads, head_dim, element_type))
    )


def rows_contiguous(tensor: torch.Tensor) -> bool:
    """Whether [kv_heads, n, dim] has contiguous rows one after another within each head."""
    return tensor.stride(2) == 1 and (tensor.shape[1] <= 1 or tensor.stride(1) == tensor.shape[2])


def attend_runs(
    query: torch.Tensor, runs: Sequence[tuple[torch.Tensor, torch.Tensor]], scale: float
) -> Optional[torch.Tensor]:
    """One query [heads, dim] over the concatenation of `runs` of (keys, values) [kv_heads, n_r, dim], with one
    softmax: [heads, dim]. Query head h reads kv head h // (heads // kv_heads), as in transformers' GQA. None where
    the kernel cannot take the call (see the module docstring): the caller then computes it with torch."""
    heads, dim = query.shape
    kv_heads = runs[0][0].shape[0]
    if query.device.type != "cpu" or query.requires_grad or not serves(query.dtype, heads, kv_heads, dim):
        return None
    for keys, values in runs:
        if (
            keys.dtype != query.dtype
            or keys.device != query.device
            or keys.shape[0] != kv_heads
            or keys.shape[2] != dim
            or keys.stride() != values.stride()
            or not rows_contiguous(keys)
            or keys.shape != values.shape
        ):
            return None
    query = query.contiguous()
    output = torch.empty_like(query)
    count = len(runs)
    kernel = decode_kernel()
    pointers, sizes = ctypes.c_void_p * count, ctypes.c_int64 * count
    status = kernel.attend(
        query.data_ptr(),
        heads,
        kv_heads,
        dim,
        scale,
        count,
        pointers(*(keys.data_ptr() for keys, _ in runs)),
        pointers(*(values.data_ptr() for _, values in runs)),
        sizes(*(keys.shape[1] for keys, _ in runs)),
        sizes(*(keys.stride(0) for keys, _ in runs)),
        output.data_ptr(),
        ELEMENT_TYPES[query.dtype],
    )
    return output if status == 0 else None


def copy_row(
    keys: torch.Tensor, values: torch.Tensor, slot: int, new_keys: torch.Tensor, new_values: torch.Tensor, position: int
) -> bool:
    """Write row `position` of new_keys/new_values [kv_heads, n, dim] into row `slot` of keys/values (same dtype,
    rows contiguous, keys and values strided alike): one call instead of four tensor operations. False (nothing
    written) where the kernel is not available or the layouts differ; the caller then copies with torch."""
    kernel = decode_kernel()
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
