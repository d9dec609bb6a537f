"""The CPU decoding kernel (`focus_hf.attention.cpu.native`): one query over several runs of keys against a float64
softmax, the torch path it stands in for, and what happens where it cannot be built or used."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import focus_hf.attention.cpu.build as build
import focus_hf.attention.cpu.grouped_keys as grouped_keys
import focus_hf.attention.cpu.native as native
import focus_hf.attention.cpu.native_decode as native_decode
import focus_hf.attention.cpu.native_prefill as native_prefill
from focus_hf.attention.cpu.grouped_keys import GroupedKeys

needs_kernel = pytest.mark.skipif(native.native_kernels() is None, reason="no C compiler to build the kernel with")


def oracle(query, runs, scale):
    """float64 softmax over the concatenated runs, query head h reading kv head h // (heads // kv_heads)."""
    keys = torch.cat([keys for keys, _ in runs], dim=1).double()
    values = torch.cat([values for _, values in runs], dim=1).double()
    sharing = query.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(sharing, 0), values.repeat_interleave(sharing, 0)
    weights = torch.softmax(torch.einsum("hd,hnd->hn", query.double(), keys) * scale, dim=-1)
    return torch.einsum("hn,hnd->hd", weights, values)


def cache_slice(generator, kv_heads, length, dim, offset, dtype=torch.float32):
    """Keys and values [kv_heads, length, dim] as a slice of a longer head-major cache (a KV cache's window)."""
    keys = torch.randn(kv_heads, offset + length + 3, dim, generator=generator).to(dtype)
    values = torch.randn(kv_heads, offset + length + 3, dim, generator=generator).to(dtype)
    return keys.narrow(1, offset, length), values.narrow(1, offset, length)


# Output tolerance per dtype: the kernel sums in float32 and rounds the output once to the call's dtype.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@needs_kernel
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kv_heads=st.integers(1, 4),
    sharing=st.sampled_from([1, 2, 3, 4, 7, 16]),
    dim=st.sampled_from([16, 32, 64, 80, 128]),
    lengths=st.lists(st.sampled_from([0, 1, 2, 17, 63, 64, 65, 130, 300]), min_size=1, max_size=4),
    offset=st.integers(0, 5),
    magnitude=st.sampled_from([0.1, 1.0, 30.0]),
    dtype=st.sampled_from(list(TOLERANCE)),
    spans=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_runs_equal_a_float64_softmax(kv_heads, sharing, dim, lengths, offset, magnitude, dtype, spans, seed):
    if sum(lengths) == 0:
        lengths = [*lengths[:-1], 1]
    generator = torch.Generator().manual_seed(seed)
    # Large magnitudes give peaked softmaxes: the running maximum must rescale what came before it.
    query = (torch.randn(kv_heads * sharing, dim, generator=generator) * magnitude).to(dtype)
    runs = [cache_slice(generator, kv_heads, length, dim, offset, dtype) for length in lengths]
    scale = dim**-0.5
    # The same rows as views, or as spans of the buffers they lie in (read in place)
    given = [(keys._base, values._base, offset, keys.shape[1]) for keys, values in runs] if spans else runs
    output = native_decode.attend_runs(query, given, scale)
    assert output is not None and output.shape == query.shape and output.dtype == dtype
    # Float32 rounds a logit to ~1e-7 of its size: at magnitude 30 (logits near 100) any float32 softmax is off by
    # ~1e-5 (torch's own: 1.4e-5 on one drawn case, where this kernel's AVX2 build gave 2.3e-5).
    tolerance = TOLERANCE[dtype] * max(1.0, magnitude / 10) if dtype == torch.float32 else TOLERANCE[dtype]
    torch.testing.assert_close(output.double(), oracle(query, runs, scale), atol=tolerance, rtol=tolerance)


@needs_kernel
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("dim", [64, 128])
def test_long_calls_split_among_threads_equal_a_float64_softmax(dim, dtype):
    """Past PARALLEL_ROWS key rows a call goes in pieces of PIECE_ROWS keys, merged in order (csrc/decode.c)."""
    generator = torch.Generator().manual_seed(dim)
    query = torch.randn(9, dim, generator=generator).to(dtype) * 3
    runs = [cache_slice(generator, 3, length, dim, 2, dtype) for length in (2000, 1, 1024, 700)]
    output = native_decode.attend_runs(query, runs, dim**-0.5)
    assert output is not None
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(output.double(), oracle(query, runs, dim**-0.5), atol=tolerance, rtol=tolerance)


@needs_kernel
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_a_grouped_step_equals_the_torch_path(monkeypatch, dtype):
    """The same `GroupedKeys.attend` calls with the kernel and with it turned off (top-1 and top-3, sinks)."""
    generator = torch.Generator().manual_seed(3)
    kv_heads, heads, dim, groups = 3, 9, 64, 5
    keys = torch.randn(kv_heads, 700, dim, generator=generator).to(dtype)
    values = torch.randn(kv_heads, 700, dim, generator=generator).to(dtype)
    key_groups = torch.randint(0, groups, (700,), generator=generator)
    sink = torch.arange(700) < 4
    query = torch.randn(heads, dim, generator=generator).to(dtype)
    outputs = {}
    for enabled in (True, False):
        monkeypatch.setattr(native, "native_kernels", native.native_kernels if enabled else lambda: None)
        copy = GroupedKeys(groups)
        assert copy.extend(keys, values, key_groups, sink, None, 560)
        outputs[enabled] = [copy.attend(query, keys, values, 560, probed, 0.125) for probed in ([2], [4, 0, 1])]
    tolerance = TOLERANCE[dtype] if dtype == torch.float32 else 2 * TOLERANCE[dtype]  # both paths round
    for with_kernel, without in zip(outputs[True], outputs[False]):
        torch.testing.assert_close(with_kernel.float(), without.float(), atol=tolerance, rtol=tolerance)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_key_appends_equal_the_torch_copy(monkeypatch, dtype):
    """Decoding steps append one key at a time (`copy_row`), through buffer growth; any dtype."""
    generator = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 400, 24, generator=generator).to(dtype)
    values = torch.randn(2, 400, 24, generator=generator).to(dtype)
    key_groups = torch.randint(0, 3, (400,), generator=generator)
    sink = torch.arange(400) < 2
    copies = {}
    for enabled in (True, False):
        monkeypatch.setattr(native, "native_kernels", native.native_kernels if enabled else lambda: None)
        copy = GroupedKeys(3)
        for upto in [5, *range(6, 400)]:  # a prompt's keys at once, then one at a time
            assert copy.extend(keys, values, key_groups, sink, None, upto)
        copies[enabled] = copy
    assert list(copies[True].counts) == list(copies[False].counts)
    for group, count in enumerate(copies[True].counts):
        for store in ("keys", "values"):
            assert torch.equal(
                getattr(copies[True], store)[group][:, :count], getattr(copies[False], store)[group][:, :count]
            )


@needs_kernel
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    length=st.integers(1, 200),
    split=st.floats(0.0, 1.0),
    kv_heads=st.integers(1, 3),
    dim=st.sampled_from([4, 24, 64]),
    groups=st.integers(1, 8),
    sinks=st.integers(0, 3),
    padded=st.booleans(),
    heads_outer=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_a_prompts_keys_filled_in_one_pass_equal_the_sorted_copy(
    monkeypatch, length, split, kv_heads, dim, groups, sinks, padded, heads_outer, dtype, seed
):
    """`extend` over many keys at once (`grouped_fill`: each row to its group's buffers in one pass) against the
    sort, gather and copy of the torch path: the same buffers, counts and sinks, with padding left out and the
    cache's heads inner or outer."""
    generator = torch.Generator().manual_seed(seed)
    shape = (kv_heads, length, dim) if heads_outer else (length, kv_heads, dim)
    keys, values = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
    if not heads_outer:
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)
    key_groups = torch.randint(0, groups, (length,), generator=generator)
    sink = torch.arange(length) < sinks
    valid = torch.rand(length, generator=generator) > 0.25 if padded else None
    first = int(split * length)
    copies = {}
    for enabled in (True, False):
        with monkeypatch.context() as patch:  # undone after each example: hypothesis runs many in one test call
            if not enabled:
                patch.setattr(native, "native_kernels", lambda: None)
            copy = GroupedKeys(groups)
            taken = [copy.extend(keys, values, key_groups, sink, valid, upto) for upto in (first, length)]
        copies[enabled] = (copy, taken)
    (fast, fast_taken), (slow, slow_taken) = copies[True], copies[False]
    assert fast_taken == slow_taken
    assert (fast.filled, fast.sinks, list(fast.counts)) == (slow.filled, slow.sinks, list(slow.counts))
    for group, count in enumerate(fast.counts):
        for store in ("keys", "values"):
            if count:
                assert torch.equal(getattr(fast, store)[group][:, :count], getattr(slow, store)[group][:, :count])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_steps_equal_the_python_steps(monkeypatch, dtype):
    """`GroupedKeys.step` in one C call (`grouped_step`: the append and the attention) against the same steps in
    Python (`take`, then `attend` in torch), step after step on one copy: through buffer growth, sinks, padding
    keys, repeated probes and a probe not routed yet; the buffers and the outputs agree."""
    generator = torch.Generator().manual_seed(9)
    kv_heads, sharing, dim, n, window, groups = 2, 3, 32, 1100, 20, 3
    keys = torch.randn(1, kv_heads, n, dim, generator=generator).to(dtype)
    values = torch.randn(1, kv_heads, n, dim, generator=generator).to(dtype)
    query = torch.randn(kv_heads * sharing, dim, generator=generator).to(dtype)
    key_groups = torch.randint(0, groups, (1, n), generator=generator)
    valid = torch.rand(1, n, generator=generator) > 0.1
    sink = valid & (valid.cumsum(dim=1) <= 2)
    probes = torch.randint(0, groups, (1, 1, 2), generator=generator)
    results, copies, fused = {}, {}, []

    def counted(*args):
        status = native_decode.grouped_step(*args)
        fused.append(isinstance(status, torch.Tensor))
        return status

    monkeypatch.setattr(grouped_keys, "grouped_step", counted)
    for enabled in (True, False):
        monkeypatch.setattr(native, "native_kernels", native.native_kernels if enabled else lambda: None)
        copy, outputs = GroupedKeys(groups), []
        for position in range(n - window):  # the sinks first: they go in every buffer
            cache = (keys[:, :, : position + window + 1], values[:, :, : position + window + 1])
            step_probes = probes if position % 7 else probes[..., :1].expand(1, 1, 2).contiguous()  # a repeat
            if position == 500:  # a probe not routed yet: nothing taken in
                assert copy.step(query, *cache, 0, key_groups, sink, valid, torch.full_like(probes, -1), 0.125) is None
                assert copy.filled == position
            outputs.append(copy.step(query, *cache, 0, key_groups, sink, valid, step_probes, 0.125))
            assert copy.filled == position + 1
        results[enabled], copies[enabled] = torch.stack(outputs).float(), copy
        if enabled:  # every step in one call but the sinks' (3: two, and a padding key before them), growth's
            assert sum(fused) >= len(outputs) - 3 - 2 * groups and len(fused) > len(outputs)
    assert max(copies[True].counts) > 256  # grown past the first capacity
    assert list(copies[True].counts) == list(copies[False].counts) and copies[True].sinks == 2
    for group, count in enumerate(copies[True].counts):
        for store in ("keys", "values"):
            assert torch.equal(
                getattr(copies[True], store)[group][:, :count], getattr(copies[False], store)[group][:, :count]
            )
    tolerance = TOLERANCE[dtype] if dtype == torch.float32 else 2 * TOLERANCE[dtype]  # both paths round
    torch.testing.assert_close(results[True], results[False], atol=tolerance, rtol=tolerance)


@needs_kernel
@pytest.mark.parametrize("flags", ["sink", "valid", "groups", "probes"])
def test_a_fused_step_refuses_flags_it_would_misread(flags):
    """The kernel reads a byte per sink or validity flag and an int64 per group: other element types are refused (the
    caller then takes the step in Python), never read as something else."""
    n, groups = 40, 3
    key = torch.randn(1, 1, n, 16)
    arguments = {
        "key_groups": torch.zeros(1, n, dtype=torch.int64),
        "key_sink": torch.zeros(1, n, dtype=torch.bool),
        "key_valid": torch.ones(1, n, dtype=torch.bool),
        "query_groups": torch.zeros(1, 1, 1, dtype=torch.int64),
    }

    def status():
        return native_decode.grouped_step(
            torch.randn(2, 16), native_decode.GroupTables(groups), 0, key, key.clone(), 0, 5, **arguments, scale=0.25
        )

    assert status() == native_decode.STEP_FULL  # read: group 0 of a copy with no buffers yet
    name = {"sink": "key_sink", "valid": "key_valid", "groups": "key_groups", "probes": "query_groups"}[flags]
    arguments[name] = arguments[name].to(torch.int32)
    assert status() == native_decode.STEP_REFUSED


@needs_kernel
@pytest.mark.parametrize(
    "change",
    [
        {"dim": 40},  # not a multiple of 16
        {"dim": 144},  # beyond 128
        {"sharing": 17},  # more query heads per kv head than the kernel holds
        {"dtype": torch.float64},
        {"strided_rows": True},  # rows not contiguous
        {"mixed_dtypes": True},  # keys of another dtype than the query
        {"mismatched_runs": True},  # a run with another kv head count or head size than the first
    ],
    ids=lambda change: next(iter(change)),
)
def test_calls_it_does_not_take_return_none(change):
    dim, sharing, dtype = change.get("dim", 64), change.get("sharing", 2), change.get("dtype", torch.float32)
    query = torch.randn(2 * sharing, dim).to(dtype)
    keys = torch.randn(2, 10, dim).to(dtype)
    if change.get("strided_rows"):
        keys = torch.randn(2, 10, dim * 2)[..., ::2]
    if change.get("mixed_dtypes"):
        keys = keys.to(torch.bfloat16)
    runs = [(keys, keys)]
    if change.get("mismatched_runs"):
        runs += [(torch.randn(1, 10, dim), torch.randn(1, 10, dim)), (torch.randn(2, 4, dim // 2),) * 2]
        assert native_decode.attend_runs(query, runs[::2], 0.1) is None
    assert native_decode.attend_runs(query, runs, 0.1) is None


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    native.built_kernels.cache_clear()
    try:
        assert native.native_kernels() is None
        assert (
            native_decode.attend_runs(torch.randn(2, 16), [(torch.randn(1, 3, 16), torch.randn(1, 3, 16))], 0.25)
            is None
        )
    finally:
        monkeypatch.delenv(native.NATIVE_ENV)
        native.built_kernels.cache_clear()


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"], ids=["missing", "failing"])
def test_no_compiler_or_a_failed_build_falls_back_with_a_message(cc, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("FOCUS_HF_CACHE", str(tmp_path))
    native.built_kernels.cache_clear()
    try:
        assert native.native_kernels() is None
    finally:
        native.built_kernels.cache_clear()
    message = capsys.readouterr().err
    assert "using torch operations" in message or "no C compiler found" in message
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob(".build-*"))


def prefill_oracle(query, key, value, scale):
    """float64 causal softmax of queries [batch, heads, L, dim] over keys/values [batch, kv_heads, L, dim]."""
    sharing = query.shape[1] // key.shape[1]
    key, value = (tensor.double().repeat_interleave(sharing, 1) for tensor in (key, value))
    scores = torch.einsum("bhld,bhsd->bhls", query.double(), key) * scale
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    return torch.einsum("bhls,bhsd->bhld", torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1), value)


def build_through(tmp_path, monkeypatch, script: str) -> None:
    """Make the kernels build (again, in a cache of their own) through a compiler wrapper running `script` before it
    calls the real compiler with its arguments; at -O0 - what is tested is what the build is given, and an -O3
    build for the compiler's default target takes most of a minute of CPU (vectors of 16 floats split for a narrower
    one)."""
    real = build.compiler()
    if real is None:
        pytest.skip("no C compiler to build the kernel with")
    wrapper = tmp_path / "cc"
    wrapper.write_text(
        "#!/bin/sh\n"
        + script
        + 'for a in "$@"; do shift; [ "$a" = -O3 ] && a=-O0; set -- "$@" "$a"; done\n'
        + f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("FOCUS_HF_CACHE", str(tmp_path / "cache"))
    native.built_kernels.cache_clear()


# Compiler wrappers' scripts (`build_through`): `-march=native` is not taken by every compiler (some ARM toolchains),
# and the build retries without it - its generic vector code (no AVX-512) runs; AVX-512 without bfloat16 dot products
# (Skylake-SP to Ice Lake): bfloat16 calls widen to float32 as they pack.
REFUSE_NATIVE = 'for a in "$@"; do [ "$a" = -march=native ] && exit 1; done\n'
NO_BF16_DOT = (
    'for a in "$@"; do shift; [ "$a" = -march=native ] && a="-march=native -mno-avx512bf16"; set -- "$@" $a; done\n'
)
# AVX-512 with bfloat16 dot products but no AMX tiles (Cooper Lake, AMD's Zen 4 and 5): bfloat16 products in vectors.
NO_AMX = 'for a in "$@"; do shift; [ "$a" = -march=native ] && a="-march=native -mno-amx-tile"; set -- "$@" $a; done\n'


@pytest.mark.parametrize(
    "script, absent",
    [(REFUSE_NATIVE, "avx512 vectors"), (NO_BF16_DOT, "avx512_bf16 dot products"), (NO_AMX, "amx_bf16 tiles")],
    ids=["default-target", "no-bf16-dot", "no-amx"],
)
def test_other_build_targets_give_the_same_results(monkeypatch, tmp_path, script, absent):
    build_through(tmp_path, monkeypatch, script)
    generator = torch.Generator().manual_seed(4)
    try:
        query, keys = torch.randn(4, 32), torch.randn(2, 70, 32)
        output = native_decode.attend_runs(query, [(keys, keys)], 0.2)
        prefills = {}
        for dtype in (torch.float32, torch.bfloat16):
            states = [torch.randn(2, heads, 150, 32, generator=generator).to(dtype) for heads in (6, 2, 2)]
            prefills[dtype] = states, native_prefill.prefill_attention(*states, causal=True, scale=0.2)
        record = native.build_record()
    finally:
        native.built_kernels.cache_clear()
    assert output is not None
    torch.testing.assert_close(output.double(), oracle(query, [(keys, keys)], 0.2), atol=2e-5, rtol=2e-5)
    for dtype, (states, (prefill, _)) in prefills.items():
        atol = 2e-5 if dtype == torch.float32 else 2**-8 * 4  # bfloat16: the output's rounding (|values| < 4 here)
        torch.testing.assert_close(prefill.double(), prefill_oracle(*states, 0.2), atol=atol, rtol=0)
    assert len(list((tmp_path / "cache" / "kernels").glob("*.so"))) == 1
    assert record["built"] and absent not in record["uses"]


@needs_kernel
def test_loading_the_kernel_keeps_subnormal_floats():
    """A library linked with -ffast-math would set flush-to-zero for the whole process on load."""
    code = (
        "import sys, torch\n"
        "from focus_hf.attention.cpu.native import native_kernels\n"
        "assert native_kernels() is not None\n"
        "assert sys.float_info.min / 2 > 0 and float(torch.tensor(1e-40) * 1) > 0\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
