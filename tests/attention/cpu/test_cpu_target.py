"""The build the CPU kernels run (`FOCUS_HF_CPU_TARGET`): the target asked for is the one built, vectors are sized
to it (csrc/vectors.h), and a target that this processor cannot run, or that the compiler does not know, is refused
with an error that names it. CI runs the kernels' tests once per x86 target (`.ci/run`), with this file among them."""

from __future__ import annotations

import subprocess

import pytest

from focus_hf.attention.cpu import build, native

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler to build the kernels with")


def predefined_macros(flags: tuple[str, ...]) -> set[str]:
    """The macros the compiler predefines for a build with these flags."""
    answer = subprocess.run(
        [build.compiler(), *flags, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True, check=True
    )
    return {line.split()[1] for line in answer.stdout.splitlines() if line.startswith("#define")}


@needs_compiler
def test_the_kernels_in_use_are_built_for_the_requested_target():
    record = native.build_record()
    assert record["built"], record
    target = build.cpu_target()
    assert record["target"] == target
    if target != "native":
        assert f"-march={target}" in record["flags"].split() and record["march"] == target


@needs_compiler
def test_vectors_are_sized_to_the_build_target():
    kernels = native.native_kernels()
    macros = predefined_macros(tuple(flag for flag in kernels.target if flag.startswith("-march")))
    expected = 16 if "__AVX512F__" in macros else 8 if "__AVX__" in macros else 4
    assert kernels.vector_floats() == expected


@needs_compiler
def test_a_target_the_compiler_does_not_know_is_refused_by_name():
    with pytest.raises(build.CpuTargetError, match="no-such-cpu.*does not know this target"):
        build.missing_instruction_sets(build.compiler(), "no-such-cpu")


@needs_compiler
def test_a_target_this_processor_cannot_run_is_refused(monkeypatch):
    flags = set(build.cpu_flags())
    if "sse4_2" not in flags:
        pytest.skip("not an x86-64 processor with /proc/cpuinfo flags")
    if "avx512f" in flags:
        pytest.skip("this processor runs x86-64-v4 builds")
    assert "avx512f" in build.missing_instruction_sets(build.compiler(), "x86-64-v4")
    assert build.missing_instruction_sets(build.compiler(), "x86-64-v2") == []
    monkeypatch.setenv(build.CPU_TARGET_ENV, "x86-64-v4")
    native.built_kernels.cache_clear()
    try:
        with pytest.raises(build.CpuTargetError, match="avx512f.*lower target"):
            native.built_kernels()
    finally:
        monkeypatch.undo()
        native.built_kernels.cache_clear()
    assert native.native_kernels() is not None  # the requested build again, from its cache


@needs_compiler
def test_bfloat16_products_take_the_tiles_where_the_processor_has_them():
    """A native build on a processor with AMX (Intel, Sapphire Rapids and later) takes bfloat16 products in tiles,
    where torch's dense attention does: vectors there ran Focus slower than dense attention (at 1K tokens, a third)."""
    if build.cpu_target() != "native" or "amx_bf16" not in build.cpu_flags():
        pytest.skip("needs a native build on a processor with amx_bf16 (this one: no AMX, or another target)")
    if "__AMX_BF16__" not in predefined_macros(("-march=native",)):
        pytest.skip("this C compiler does not build AMX code for -march=native")
    assert "amx_bf16 tiles" in native.build_record()["uses"]
