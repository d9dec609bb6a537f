"""The CPU kernels built for a processor this machine is not: the four sources compiled for aarch64 (NEON: 4-float
vectors and its own register tiles in csrc/vectors.h) with the flags of the library's build, then linked into the C
driver csrc/kernel_driver.c - focus_prefill and focus_decode against a float64 softmax - and run under qemu-aarch64.
The same driver is built for this machine and run too.

Needs aarch64-linux-gnu-gcc and qemu-aarch64 (Debian: gcc-aarch64-linux-gnu, qemu-user; `.ci/run` installs them).
Without them these tests skip, except under CI (the `CI` variable set), where a missing tool fails them.

decode.c is compiled at -O1 here, the others at the library's -O3: decode.c's 16-float generic vectors take GCC
minutes at -O3 for targets whose registers hold 4 floats (aarch64, plain x86-64), and a compile error or an
instruction set's intrinsic outside its `#if` shows at any level."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from focus_hf.attention.cpu import build

CROSS_COMPILER = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
DRIVER = Path(__file__).with_name("csrc") / "kernel_driver.c"
TOLERANCE = 1e-4  # the driver's own (TOLERANCE in kernel_driver.c)
CASES = 9  # lines the driver prints, one per call it checks


def require(tool: str, package: str) -> str:
    """The tool's path; where it is missing, a failure under CI, else a skip that names the package."""
    found = shutil.which(tool)
    if found is None:
        reason = f"{tool} not found (Debian package {package})"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}: CI must check the aarch64 build (.ci/run installs it)")
        pytest.skip(reason)
    return found


def kernel_flags(source: Path) -> list[str]:
    """The library's compile flags (build.COMPILE_FLAGS), decode.c at -O1 (see the module's comment)."""
    level = "-O1" if source.name == "decode.c" else "-O3"
    return [level if flag == "-O3" else flag for flag in build.COMPILE_FLAGS]


def compile_kernels(cc: str, target: list[str], folder: Path) -> tuple[list[Path], dict[str, str]]:
    """The four sources compiled side by side with -fopenmp (as the library is built where torch runs GNU OpenMP);
    the objects and each source's compiler messages. A failed compile fails the test."""
    folder.mkdir(parents=True, exist_ok=True)

    def compile_one(source: Path) -> tuple[Path, str]:
        obj = folder / f"{source.stem}.o"
        command = [cc, *kernel_flags(source), *target, "-fopenmp", str(source), "-o", str(obj)]
        answer = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert answer.returncode == 0, f"{' '.join(command)}\n{answer.stderr}"
        return obj, answer.stderr

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        built = list(pool.map(compile_one, build.SOURCES))
    return [obj for obj, _ in built], {source.name: messages for source, (_, messages) in zip(build.SOURCES, built)}


def link_driver(cc: str, objects: list[Path], folder: Path, extra: list[str]) -> Path:
    """kernel_driver.c linked with the kernels' objects (all four: a symbol none defines fails the link)."""
    program = folder / "kernel_driver"
    command = [
        cc,
        "-O2",
        "-Wall",
        "-Wextra",
        "-Werror",
        str(DRIVER),
        *map(str, objects),
        *extra,
        "-fopenmp",
        "-lm",
        "-o",
        str(program),
    ]
    answer = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert answer.returncode == 0, f"{' '.join(command)}\n{answer.stderr}"
    return program


def check_driver_output(answer: subprocess.CompletedProcess, vector_floats: int | None) -> None:
    """The driver passed: exit 0, every case within TOLERANCE, the build's vector width as expected."""
    report = answer.stdout + answer.stderr
    assert answer.returncode == 0, report
    width = re.search(r"^vector floats (\d+)$", answer.stdout, re.M)
    assert width, report
    if vector_floats is not None:
        assert int(width.group(1)) == vector_floats, report
    cases = re.findall(r"^(?:prefill|decode) .* output (\S+)  lse (\S+)", answer.stdout, re.M)
    assert len(cases) == CASES, report
    assert all(float(output) <= TOLERANCE and float(lse) <= TOLERANCE for output, lse in cases), report
    assert re.search(r"^max error \S+ \(tolerance 1e-04\): ok$", answer.stdout, re.M), report


@pytest.fixture(scope="module")
def aarch64_build(tmp_path_factory) -> tuple[list[Path], dict[str, str], Path]:
    cc = require(CROSS_COMPILER, "gcc-aarch64-linux-gnu")
    folder = tmp_path_factory.mktemp("aarch64")
    objects, messages = compile_kernels(cc, ["-march=armv8-a"], folder)
    # static: qemu then needs no aarch64 libraries at run time
    return objects, messages, link_driver(cc, objects, folder, ["-static"])


def test_kernels_compile_for_aarch64_without_warnings(aarch64_build):
    # An x86 intrinsic outside its `#if` is only an implicit-declaration warning for GCC 12 (and a failed load later)
    _, messages, _ = aarch64_build
    assert messages == {source.name: "" for source in build.SOURCES}


def test_aarch64_kernels_match_a_float64_softmax_under_qemu(aarch64_build):
    qemu = require(QEMU, "qemu-user")
    _, _, program = aarch64_build
    answer = subprocess.run(
        [qemu, str(program)], capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"}
    )
    check_driver_output(answer, vector_floats=4)  # NEON's 4-float vectors (vectors.h)


def test_host_kernels_match_a_float64_softmax(tmp_path):
    cc = build.compiler() or require("cc", "gcc")
    # the library's own target for this machine (FOCUS_HF_CPU_TARGET, else -march=native)
    target = list(build.target_flag_sets(build.cpu_target())[0])
    objects, _ = compile_kernels(cc, target, tmp_path)
    program = link_driver(cc, objects, tmp_path, [])
    answer = subprocess.run([str(program)], capture_output=True, text=True, timeout=300)
    check_driver_output(answer, vector_floats=None)
