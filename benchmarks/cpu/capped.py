"""Run a command as it would run on a processor of one x86-64 level: the C kernels built for that level
(`FOCUS_HF_CPU_TARGET`) and the instruction sets of torch's own kernels, of the BLAS library it calls and of glibc's
libm capped at it, so that dense SDPA, every CPU row's baseline, runs no instruction the build may not use.

    python benchmarks/cpu/capped.py x86-64-v2 -- python benchmarks/cpu/prefill_parts.py --seq-lens 16384

Each variable is read by one library, and each was checked with `perf annotate` on an AMD EPYC (Zen 5) with
AVX-512, by the instructions of dense SDPA's hottest code:

- `ATEN_CPU_CAPABILITY`: torch's dispatched kernels (`default` is its build without AVX);
- `ONEDNN_MAX_CPU_ISA`: oneDNN's;
- `MKL_ENABLE_INSTRUCTIONS`: MKL's, but only on Intel processors. On AMD's, MKL runs its own path for them, whose
  sgemm kernel (`mkl_blas_def_sgemm_kernel_0_zen`) uses 256-bit AVX2 and FMA whatever this variable (or
  `MKL_CBWR=SSE4_2`) says: within `x86-64-v3`, not within `x86-64-v2`. `MKL_CBWR=COMPATIBLE` (MKL's SSE2 code,
  as MKL runs on an AMD processor without AVX2) is the one setting it follows there;
- `GLIBC_TUNABLES` (`glibc.cpu.hwcaps`): which of libm's variants `expf` resolves to (`__expf_fma` unless FMA is
  masked: FMA is not part of `x86-64-v2`).

The native build (`native`) runs uncapped. The rows each benchmark writes record these variables
(`torch_kernels.limits`, `focus_hf.attention.cpu.build.TORCH_ISA_LIMITS`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from focus_hf.attention.cpu.build import cpuinfo_field

# Above x86-64-v3 nothing is capped: torch, MKL and glibc pick AVX-512 code by themselves where the processor has it.
TARGET_CAPS: dict[str, dict[str, str]] = {
    "x86-64-v3": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "x86-64-v2": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX,-AVX2,-FMA,-AVX512F,-AVX512VL,-AVX512BW,-AVX512DQ",
    },
}
# MKL's SSE2 code, the only cap MKL honours on AMD processors (see the module's text)
AMD_CAPS: dict[str, dict[str, str]] = {"x86-64-v2": {"MKL_CBWR": "COMPATIBLE"}}


def processor_vendor() -> str:
    """The processor's vendor as /proc/cpuinfo names it ("AuthenticAMD", "GenuineIntel"; "" where unknown)."""
    return cpuinfo_field("vendor_id") or ""


def caps_for(target: str, vendor: str) -> dict[str, str]:
    """The environment that runs the C kernels' `target` build beside torch's kernels capped at the same level, on a
    processor of `vendor`. Targets without caps of their own (`native`, `x86-64-v4`, an `-march` name) only choose
    the build."""
    caps = {"FOCUS_HF_CPU_TARGET": target, **TARGET_CAPS.get(target, {})}
    if vendor == "AuthenticAMD":
        caps.update(AMD_CAPS.get(target, {}))
    return caps


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="the build: native, x86-64-v3, x86-64-v2 or any -march value")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    options = parser.parse_args(argv)
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    if not command:
        parser.error("name the command to run after --, e.g. `-- python benchmarks/cpu/prefill_parts.py`")
    caps = caps_for(options.target, processor_vendor())
    print(" ".join(f"{name}={value}" for name, value in caps.items()), file=sys.stderr)
    os.execvpe(command[0], command, {**os.environ, **caps})


if __name__ == "__main__":
    main()
