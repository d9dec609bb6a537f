"""Building the CPU kernels (`csrc/`): the C compiler and its flags, what this processor has, and the cache of built
libraries that `native` loads.

The library is built once per machine and target (`cc -O3 -march=native`, the four sources side by side: a few
seconds of CPU each; without `-march=native` where the compiler refuses it, without `-fopenmp` where torch does not
run GNU OpenMP) into `<cache>/kernels/` (`aliases.default_cache_dir`) and loaded with ctypes: no build step at
install, no dependency. `FOCUS_HF_CPU_TARGET` builds for another target instead (any -march value: `x86-64-v2`,
`x86-64-v3`, `x86-64-v4`, ...; one this processor cannot run is refused with `CpuTargetError`): csrc/vectors.h sizes
the kernels' vectors and register tiles to the instruction set of the target, so each build is fast on its own.

Processes that start together with an empty cache build each library once: the first takes a lock beside it
(`cached_library`) and the others wait, then load what it built. A build is written to a temporary file and renamed into
place, so that no process ever loads half a library; its digest, kept beside it, is checked before every load, and a
file that does not match it (damaged, or another program's) is built again, with a warning.
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
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, TypeVar

import torch

from focus_hf.aliases import default_cache_dir
from focus_hf.errors import CpuTargetError
from focus_hf.files import file_lock, write_atomically

Bound = TypeVar("Bound")

SOURCES = tuple(
    Path(__file__).with_name("csrc") / name for name in ("decode.c", "prefill.c", "segments.c", "routing.c")
)
# Included by the sources: part of what a build is made of (`library_path`).
HEADERS = (Path(__file__).with_name("csrc") / "vectors.h",)
# -ffast-math lets the compiler vectorise the sums and exp; it is given to the compile step only, because linking
# with it adds a start-up routine that sets flush-to-zero for the whole process (denormals would read as 0 in torch,
# numpy and Python floats alike).
COMPILE_FLAGS = ("-O3", "-ffast-math", "-fopenmp-simd", "-fPIC", "-c")
LINK_FLAGS = ("-shared",)
# FOCUS_HF_CPU_TARGET: the processor the kernels are built for, as the compiler's -march names it: "native" (the
# default: this processor), or a level such as "x86-64-v2", "x86-64-v3", "x86-64-v4", "armv8-a", or a model
# ("znver3", "skylake-avx512"). Each target's build is cached apart; csrc/vectors.h sizes vectors and tiles to it.
CPU_TARGET_ENV = "FOCUS_HF_CPU_TARGET"
# The instruction sets a target's predefined macros promise, as /proc/cpuinfo names them: a build whose target
# promises one this processor lacks would stop the process at its first such instruction, so it is refused.
TARGET_MACROS = {
    "__SSE4_2__": "sse4_2",
    "__POPCNT__": "popcnt",
    "__AVX__": "avx",
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__F16C__": "f16c",
    "__BMI2__": "bmi2",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl",
    "__AVX512BF16__": "avx512_bf16",
    "__AVX512FP16__": "avx512_fp16",
    "__AMX_TILE__": "amx_tile",
    "__AMX_BF16__": "amx_bf16",
}
# A compiler call that takes longer is taken for hung (the slowest, decode.c for the compiler's default target, takes
# about half a minute of CPU on a 2-core AMD EPYC).
BUILD_TIMEOUT_S = 600


def cpu_target() -> str:
    """The processor the kernels are built for (FOCUS_HF_CPU_TARGET, default "native")."""
    return os.environ.get(CPU_TARGET_ENV, "").strip() or "native"


def target_flag_sets(target: str) -> tuple[tuple[str, ...], ...]:
    """The -march flags to try in turn: for "native", this processor's, else the compiler's default target; for a
    named target, only its own (a target asked for by name is built as asked, or not at all)."""
    return (("-march=native",), ()) if target == "native" else ((f"-march={target}",),)


def missing_instruction_sets(cc: str, target: str) -> list[str]:
    """The instruction sets that a build for `target` would use and this processor lacks (by the compiler's
    predefined macros for it and /proc/cpuinfo's flags; [] where either cannot be read). Raises CpuTargetError where
    the compiler does not know the target."""
    if target == "native":
        return []

    def macros(*flags: str) -> Optional[subprocess.CompletedProcess]:
        try:
            command = [cc, *flags, "-dM", "-E", "-x", "c", os.devnull]
            return subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None

    answer = macros(f"-march={target}")
    if answer is None:
        return []
    if answer.returncode != 0:
        baseline = macros()
        if baseline is None or baseline.returncode != 0:
            return []  # the compiler fails whatever the target: the build fails, and says so (`built_kernels`)
        reason = (answer.stderr.strip().splitlines() or ["refused"])[0]
        raise CpuTargetError(
            f"{CPU_TARGET_ENV}={target}: the C compiler {cc} does not know this target ({reason}). Use an -march value "
            "it knows (x86-64-v2, x86-64-v3, x86-64-v4, armv8-a, ...), or unset it to build for this processor."
        )
    flags = set(cpu_flags())
    if not flags:
        return []
    promised = {name.split()[1] for name in answer.stdout.splitlines() if name.startswith("#define __")}
    return [flag for macro, flag in TARGET_MACROS.items() if macro in promised and flag not in flags]


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


# The instruction sets that decide how fast attention runs on a CPU (as /proc/cpuinfo names them), for benchmark
# rows: vector widths, fused multiply-add, and the bfloat16 / float16 / int8 dot products and tile units.
INSTRUCTION_SETS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512dq",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "sve2",
    "bf16",
    "i8mm",
)


@functools.lru_cache(maxsize=8)
def cpuinfo_field(*names: str) -> Optional[str]:
    """The value of the first line of /proc/cpuinfo that names one of `names` ("model name", "vendor_id", "flags"),
    or None where there is none or the file cannot be read (not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(names):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> tuple[str, ...]:
    """This processor's instruction-set flags as /proc/cpuinfo lists them (() where it cannot be read)."""
    return tuple((cpuinfo_field("flags", "Features") or "").split())


def instruction_sets() -> list[str]:
    """Which of INSTRUCTION_SETS this processor has (from /proc/cpuinfo's flags; [] where it cannot be read)."""
    flags = set(cpu_flags())
    return [name for name in INSTRUCTION_SETS if name in flags]


# Variables that cap the instruction sets of torch's own CPU kernels, of the BLAS libraries it calls and of libm's
# variants: set on a processor that has more, they make dense SDPA run as it would on a processor that has only those
# (benchmarks/cpu/capped.py sets them per build target; MKL follows MKL_CBWR alone on AMD processors).
TORCH_ISA_LIMITS = (
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
    "ONEDNN_MAX_CPU_ISA",
    "GLIBC_TUNABLES",
)


def torch_kernels() -> dict:
    """Which of its CPU kernels torch dispatches to (its `get_cpu_capability()`: DEFAULT, AVX2, AVX512, ...) and the
    limits set on them by environment variables: dense SDPA's speed, the baseline of every CPU row and one side of
    every crossover, depends on it as much as the C kernels' speed depends on their build."""
    limits = {name: os.environ[name] for name in TORCH_ISA_LIMITS if name in os.environ}
    return {"capability": torch.backends.cpu.get_cpu_capability(), "limits": limits}


@functools.lru_cache(maxsize=4)
def resolved_target(cc: str, target: tuple[str, ...]) -> Optional[str]:
    """The processor `-march=native` stands for with this compiler (gcc's `-Q --help=target`, clang's `-###`), or
    None where it cannot say (or the build has no -march)."""
    if "-march=native" not in target:
        return None
    for command, marker in (
        ([cc, "-march=native", "-Q", "--help=target"], "-march="),
        ([cc, "-march=native", "-###", "-x", "c", "-c", os.devnull], '"-target-cpu"'),
    ):
        try:
            answer = subprocess.run(command, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        for line in (answer.stdout + answer.stderr).splitlines():
            words = line.replace('" "', " ").replace('"', "").split() if marker.startswith('"') else line.split()
            if marker.startswith('"') and "-target-cpu" in words:
                return words[words.index("-target-cpu") + 1]
            if not marker.startswith('"') and len(words) == 2 and words[0] == marker:
                return words[1]
    return None


@functools.lru_cache(maxsize=4)
def compiler_version(cc: str) -> str:
    """The first line of `cc --version` (`cc` itself where it does not say)."""
    try:
        answer = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return cc
    return answer.stdout.splitlines()[0] if answer.stdout.strip() else cc


def openmp_flags() -> tuple[tuple[str, ...], ...]:
    """(("-fopenmp",), ()) where this process already runs GNU OpenMP (torch's pip wheels bundle libgomp.so.1, and a
    library linked with -fopenmp then shares torch's thread pool instead of starting a second one); else ((),)."""
    try:
        shared = any("libgomp" in line for line in Path("/proc/self/maps").read_text().splitlines())
    except OSError:
        shared = False
    return (("-fopenmp",), ()) if shared else ((),)


def library_path(source: bytes, cc: str, target: tuple[str, ...]) -> Path:
    """Where the library built from `source` (the sources' bytes, joined) with `cc` and `target` is kept."""
    parts = [source, cc, " ".join(COMPILE_FLAGS + LINK_FLAGS + target), machine_tag()]
    digest = hashlib.sha256(b"\0".join(part if isinstance(part, bytes) else part.encode() for part in parts))
    return default_cache_dir() / "kernels" / f"focus-kernels-{digest.hexdigest()[:16]}.so"


def compile_step(command: list[str]) -> subprocess.CompletedProcess:
    """One compiler call, its output captured (a timeout raises subprocess.TimeoutExpired)."""
    return subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)


def build(cc: str, target: tuple[str, ...], path: Path) -> None:
    """Compile the kernel to `path` (into a temporary file first, so that a concurrent process never loads half),
    its digest written beside it first (`digest_path`, `intact`). `target` goes to both steps: -fopenmp at the link
    step links the OpenMP runtime."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".build-", suffix=".so")
    os.close(handle)
    objects = [f"{temporary}.{number}.o" for number in range(len(SOURCES))]
    try:
        # The sources compile side by side (decode.c alone takes about half a minute of one core for the compiler's
        # default target, whose vectors of 16 floats are split), then link.
        compiles = [[cc, *COMPILE_FLAGS, *target, str(source), "-o", out] for source, out in zip(SOURCES, objects)]
        with ThreadPoolExecutor(max_workers=len(compiles)) as pool:
            for finished in pool.map(compile_step, compiles):
                finished.check_returncode()
        compile_step([cc, *LINK_FLAGS, *target, *objects, "-o", temporary, "-lm"]).check_returncode()
        write_atomically(digest_path(path), file_digest(Path(temporary)))
        os.replace(temporary, path)
    finally:
        for leftover in (temporary, *objects):
            if os.path.exists(leftover):
                os.remove(leftover)


def digest_path(path: Path) -> Path:
    """Where the digest of the library at `path` is kept: written by `build` before the library is renamed into
    place, so that a library there always has its own beside it."""
    return path.with_name(path.name + ".sha256")


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def intact(path: Path) -> bool:
    """Whether the library at `path` is the one `build` wrote there: its digest matches the one kept beside it. A
    truncated library would stop the process when loaded (the loader maps pages the file no longer has), a foreign
    one would run code that is not the kernels: neither is loaded."""
    try:
        return digest_path(path).read_text().strip() == file_digest(path)
    except OSError:
        return False


def cached_library(path: Path, make: Callable[[Path], None], bind: Callable[[ctypes.CDLL], Bound]) -> Bound:
    """The library at `path`, loaded and handed to `bind`; made first by `make(path)` where it is not there yet, by one
    process while the others wait (a lock file beside it, `files.file_lock`). A file there that is not the one built
    (`intact`: damaged, left by an older version, or foreign) is made again, with a warning, before anything loads
    it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not intact(path):
        with file_lock(path.with_name(path.name + ".lock")):
            if not intact(path):  # another process may have built it meanwhile
                if path.exists():
                    warnings.warn(
                        f"focus_hf: the cached CPU kernels {path} are not the library built there (damaged, left by an "
                        "older version, or another program's file): building them again",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                make(path)
    return bind(ctypes.CDLL(str(path)))


def kernels_library(bind: Callable[[ctypes.CDLL, Path, str, tuple[str, ...]], Bound]) -> Optional[Bound]:
    """The kernels for FOCUS_HF_CPU_TARGET, built now where this machine has none yet (`cached_library`), handed to
    `bind(library, path, compiler, target flags)`; None where they cannot be had (the reason is printed)."""
    cc = compiler()
    if cc is None:
        print("focus_hf: no C compiler found (set $CC); attention runs in torch operations", file=sys.stderr)
        return None
    source = b"\0".join(path.read_bytes() for path in SOURCES + HEADERS)
    failure: object = None
    target_name = cpu_target()
    missing = missing_instruction_sets(cc, target_name)
    if missing:
        raise CpuTargetError(
            f"{CPU_TARGET_ENV}={target_name}: a build for this target uses {', '.join(missing)}, which this "
            f"processor ({platform.processor() or platform.machine()}) does not have; it would stop at its first such "
            "instruction. Choose a lower target (x86-64-v3 for AVX2, x86-64-v2 for SSE4.2) or unset it to build for "
            "this processor."
        )
    for target in (arch + openmp for arch in target_flag_sets(target_name) for openmp in openmp_flags()):
        path = library_path(source, cc, target)
        try:
            return cached_library(
                path, functools.partial(build, cc, target), lambda library: bind(library, path, cc, target)
            )
        except (OSError, AttributeError, subprocess.SubprocessError) as error:  # AttributeError: a function missing
            failure = getattr(error, "stderr", None) or error
    print(f"focus_hf: could not build the CPU kernels ({failure}); using torch operations", file=sys.stderr)
    return None
