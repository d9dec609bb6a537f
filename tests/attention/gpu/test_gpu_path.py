"""The GPU path (`focus_hf.attention.gpu.gpu_path`), run on the CPU through the CPU stand-ins of its CUDA kernels
(`cpu_standins`), whose conventions are those of the CUDA kernels - checked here against torch's own kernels where
they run on the CPU, and on CUDA by tests/attention/gpu/test_cuda.py and `verify`."""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch
from attention_cases import ATOL, BASE_CASE, SCALING, cases, focus_llama, random_routing, run_case
from gpu_path_cases import allowed_of, sparse_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import VOCAB

import focus_hf
import focus_hf.attention.cpu.cpu_path as cpu_path
import focus_hf.attention.gpu.bands as bands
import focus_hf.attention.gpu.budget as budget
import focus_hf.attention.gpu.gpu_path as gpu_path
import focus_hf.attention.gpu.paged_keys as paged_keys_module
import focus_hf.attention.gpu.verify as verify
import focus_hf.attention.gpu.window as window_module
import focus_hf.attention.hard as hard
from focus_hf.attention.backends import cuda_sdpa_kernel
from focus_hf.attention.gpu.block_masks import BLOCK, BlockLists
from focus_hf.attention.gpu.cpu_standins import (
    block_visibility,
    efficient_attention_standin,
    flex_attention_standin,
    varlen_attention_standin,
)
from focus_hf.attention.gpu.kernels import NEG, GpuKernels, standin_kernels
from focus_hf.attention.reference import dense_attention


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    verify.forget_verdicts()
    yield
    verify.forget_verdicts()


# --- the path against the dense oracle ---


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.booleans())
def test_gpu_path_equals_dense_oracle(case, varlen_gqa):
    with pytest.MonkeyPatch.context() as patch:
        # Runs of one query head, of a few, or every head at once; the window band's rows in chunks of 3 to 4096.
        use_budget(patch, {2: 1, 16: 1 << 13, 8192: 1 << 40}[case["own_group_rows"]])
        patch.setattr(window_module, "MIN_CHUNK_ROWS", case["stream_rows"])
        patch.setattr(verify, "gpu_kernels", lambda device, backend="auto": standin_kernels(varlen_gqa))
        output, reference, rows = run_case(case, backend="gpu-path")
    assert output.shape == reference.shape
    assert torch.isfinite(output).all()
    torch.testing.assert_close(output[rows], reference[rows], atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("top_k, separate", [(1, False), (2, False), (1, True), (3, True)])
def test_every_routing_and_dtype(dtype, top_k, separate):
    arguments, _, rows = sparse_case(top_k=top_k, separate=separate)
    query, key, value, *rest = arguments
    states = tuple(state.to(dtype) for state in (query, key, value))
    output = gpu_path.gpu_sparse_attention(*states, *rest, standin_kernels())
    assert output.dtype == dtype
    # The oracle on the same rounded inputs: only the kernels' own rounding differs.
    expected = dense_attention(*(state.float() for state in states), allowed_of(arguments), scaling=SCALING)
    tolerance = ATOL if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(output.float()[rows], expected[rows], atol=tolerance, rtol=0)


def test_own_group_top_1_runs_one_varlen_call_per_kv_head_run(monkeypatch):
    calls = []
    twin = standin_kernels()

    def counting(query, key, value, *rest):
        if rest[-1] < 0 and rest[3] == 300:  # the own-group pass's calls: bounded by the call's 300 keys
            calls.append((query.shape[1], key.shape[1]))
        return twin.raw_varlen(query, key, value, *rest)

    kernels = GpuKernels("counting", twin.raw_flex, counting, False, twin.varlen_dtypes, twin.head_dims)
    arguments, expected, rows = sparse_case()
    use_budget(monkeypatch, 1)  # one query head per run
    output = gpu_path.gpu_sparse_attention(*arguments, kernels, own_group=True)
    torch.testing.assert_close(output[rows], expected[rows], atol=ATOL, rtol=0)
    # 2 kv heads x 3 query heads each, no GQA in the kernel: one call per query head, one kv head each.
    assert calls == [(1, 1)] * 6
    calls.clear()
    use_budget(monkeypatch, 1 << 40)
    gpu_path.gpu_sparse_attention(*arguments, kernels, own_group=True)
    assert calls == [(2, 2)] * 3  # both kv heads per call, one call per position in a kv head's run


def test_a_kv_head_past_the_budget_takes_its_query_heads_in_runs(monkeypatch):
    calls = []
    twin = standin_kernels(varlen_gqa=True)

    def counting(query, key, value, *rest):
        if rest[-1] < 0 and rest[3] == 300:  # the own-group pass's calls: bounded by the call's 300 keys
            calls.append((query.shape[1], key.shape[1]))
        return twin.raw_varlen(query, key, value, *rest)

    kernels = GpuKernels("counting", twin.raw_flex, counting, True, twin.varlen_dtypes, twin.head_dims)
    arguments, expected, rows = sparse_case()  # batch 2, 6 / 2 heads, dim 8, 300 tokens, float32
    element = 2 * 8 * 4
    one_kv_head, one_query_head = 2 * 300 * element, 3 * 300 * element
    # Runs of one size, dividing a kv head's 3 query heads: a budget for 2 of them takes them one at a time.
    use_budget(monkeypatch, one_kv_head + 2 * one_query_head)
    output = gpu_path.gpu_sparse_attention(*arguments, kernels, own_group=True)
    torch.testing.assert_close(output[rows], expected[rows], atol=ATOL, rtol=0)
    assert calls == [(1, 1)] * 6
    calls.clear()
    use_budget(monkeypatch, one_kv_head + 3 * one_query_head)  # one whole kv head
    gpu_path.gpu_sparse_attention(*arguments, kernels, own_group=True)
    assert calls == [(3, 1)] * 2
    calls.clear()
    use_budget(monkeypatch, 2 * (one_kv_head + 3 * one_query_head))  # every head at once
    gpu_path.gpu_sparse_attention(*arguments, kernels, own_group=True)
    assert calls == [(6, 2)]


def use_budget(monkeypatch, size):
    """Every part of the GPU path gets `size` bytes of temporaries, whatever the call's size."""
    monkeypatch.setattr(budget, "temporary_bytes", lambda query: size)


def test_probed_routing_never_calls_varlen_for_the_own_group_pass():
    twin = standin_kernels()

    def refuse_causal(*args):
        if args[-1] < 0 and args[6] == 300:  # an own-group call, bounded by the call's 300 keys (the window band's
            raise AssertionError("varlen's own-group calls are for own-group top-1 only")  # calls are for every routing
        return twin.raw_varlen(*args)

    kernels = GpuKernels("no causal varlen", twin.raw_flex, refuse_causal, False, twin.varlen_dtypes, twin.head_dims)
    for top_k, separate in ((2, False), (1, True)):
        arguments, expected, rows = sparse_case(top_k=top_k, separate=separate)
        output = gpu_path.gpu_sparse_attention(*arguments, kernels)
        torch.testing.assert_close(output[rows], expected[rows], atol=ATOL, rtol=0)


def test_float32_without_a_varlen_kernel_runs_flex_for_the_own_group_pass():
    twin = standin_kernels()
    kernels = GpuKernels("flex only", twin.raw_flex, None, False, (), twin.head_dims)
    arguments, expected, rows = sparse_case()
    torch.testing.assert_close(
        gpu_path.gpu_sparse_attention(*arguments, kernels)[rows], expected[rows], atol=ATOL, rtol=0
    )


# --- block lists: every allowed pair inside a listed block, full blocks truly full, no n x n evaluation ---


def listed_pairs(count, indices, q_len, kv_len):
    return block_visibility(count[:, None], indices[:, None], q_len, kv_len, BLOCK)[:, 0]


def window_band_oracle(query, key, value, valid, query_groups, key_groups, sink, window, model_mask=None):
    """The window band by its definition, densely in float64: (output, natural-log lse, rows with a visible key)."""
    q_len, length = query.shape[2], key.shape[2]
    positions = torch.arange(length)
    distance = positions[length - q_len :, None] - positions[None, :]
    probed = (query_groups[:, :, None, :] == key_groups[:, None, :, None]).any(dim=-1)
    near = (distance <= window)[None] | sink[:, None, :]
    pairs = (distance >= 0)[None] & valid[:, None, :] & near & ~probed
    if model_mask is not None:
        pairs = pairs & model_mask[:, 0]
    repeats = query.shape[1] // key.shape[1]
    keys, values = (states.double().repeat_interleave(repeats, dim=1) for states in (key, value))
    scores = (query.double() @ keys.transpose(-1, -2) * SCALING).masked_fill(~pairs[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    seen = pairs.any(dim=-1)[:, None].expand_as(lse)
    weights = torch.where(seen[..., None], torch.exp(scores - lse[..., None]), 0.0)
    return weights @ values, lse, seen


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 400),  # keys
    st.integers(0, 399),  # of which before the queries
    st.sampled_from([0, 5, 128, 300]),  # window
    st.integers(1, 3),  # top_k
    st.booleans(),  # a separate query router
    st.integers(0, 6),  # sinks
    st.booleans(),  # a general model mask
    st.integers(0, 2**16),
)
def test_bands_equal_the_window_band_by_its_definition(length, before, window, top_k, separate, sinks, general, seed):
    """The window band in plain torch (`bands`), chunks of one band forced, against its definition: GQA, left padding,
    sinks moved by it, queries after a cache, rows without a key (lse NEG, output 0) and a general model mask."""
    q_len = length - min(before, length - 1)
    arguments, _, _ = sparse_case(
        length=length, q_len=q_len, top_k=top_k, separate=separate, window=window, sinks=sinks, pad=length // 5,
        seed=seed,
    )  # fmt: skip
    query, key, value, valid, query_groups, key_groups, sink, _, window, scaling = arguments
    model_mask = None
    if general:
        generator = torch.Generator().manual_seed(seed)
        model_mask = torch.rand(1, 1, q_len, length, generator=generator) > 0.3
    output, lse = torch.empty_like(query), torch.empty(query.shape[:3])
    with pytest.MonkeyPatch.context() as patch:
        use_budget(patch, 1)  # one band per chunk
        bands.band_attention(
            output, lse, query, key, value, valid, query_groups, key_groups, sink, window, scaling, model_mask
        )
    expected, expected_lse, seen = window_band_oracle(
        query, key, value, valid, query_groups, key_groups, sink, window, model_mask
    )
    assert output.shape == query.shape and lse.shape == query.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse[seen].double(), expected_lse[seen], atol=1e-5, rtol=1e-6)
    assert bool((lse[~seen] == NEG).all()) and bool((output[~seen[..., None].expand_as(output)] == 0).all())


def test_bands_take_a_sink_inside_the_window_once():
    """A sink in its query's band is counted with the sinks only: its weight is that of one key, not two."""
    query = torch.zeros(1, 1, 4, 2)
    key = torch.zeros(1, 1, 4, 2)
    value = torch.arange(4.0).view(1, 1, 4, 1).expand(1, 1, 4, 2).contiguous()
    sink = torch.tensor([[True, False, False, False]])
    groups = torch.tensor([[0, 1, 1, 1]])
    output, lse = torch.empty_like(query), torch.empty(query.shape[:3])
    bands.band_attention(
        output, lse, query, key, value, torch.ones(1, 4, dtype=torch.bool), groups[..., None] + 5, groups, sink, 8, 1.0
    )
    # Equal scores: the last query sees 4 keys, each once.
    torch.testing.assert_close(lse[0, 0, -1], torch.log(torch.tensor(4.0)))
    torch.testing.assert_close(output[0, 0, -1], torch.full((2,), 1.5))


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 700),
    st.integers(1, 5),
    st.integers(1, 3),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_sorted_range_blocks_cover_the_own_group_pass_and_full_blocks_are_full(length, groups, top_k, separate, seed):
    top_k = min(top_k, groups)
    generator = torch.Generator().manual_seed(seed)
    query_groups, key_groups = random_routing(generator, 2, length, groups, top_k, "some", separate, adaptive=True)
    valid = torch.rand(2, length, generator=generator) > 0.1
    captured = {}

    def capture(query, key, value, blocks, scale):
        captured["blocks"] = blocks
        return standin_kernels().raw_flex(query, key, value, blocks, scale)

    kernels = GpuKernels("capture", capture, None, False, (), lambda dim: dim)
    states = torch.zeros(2, 1, length, 2), torch.zeros(2, 1, length, 2), torch.zeros(2, 1, length, 2)
    output = torch.zeros(2, 1, length, 2)
    lse = torch.full((2, 1, length), NEG)
    gpu_path.fold_probed_groups(output, lse, *states, valid, query_groups, key_groups, groups, 1.0, kernels)
    blocks: BlockLists = captured["blocks"]
    entries, kv_len = blocks.q_len, blocks.kv_len
    b = torch.arange(2).view(2, 1, 1, 1)
    q_index = torch.arange(entries).view(1, 1, entries, 1)
    kv_index = torch.arange(kv_len).view(1, 1, 1, kv_len)
    rule = blocks.mask_mod(b, torch.zeros(1, dtype=torch.long), q_index, kv_index)[:, 0]
    partial = listed_pairs(blocks.kv_num_blocks, blocks.kv_indices, entries, kv_len)
    full = listed_pairs(blocks.full_num_blocks, blocks.full_indices, entries, kv_len)
    assert not bool((partial & full).any())  # a block is listed once
    assert bool((partial | full | ~rule).all())  # every visible pair is read
    assert bool((rule | ~full).all())  # a full block holds only visible pairs
    # The sort's own pairs: the own-group pass of the pattern, each once.
    assert int(rule.sum()) == int(own_group_pair_count(query_groups, key_groups, valid, groups))


def own_group_pair_count(query_groups, key_groups, valid, groups):
    length = key_groups.shape[1]
    probed = torch.zeros(*query_groups.shape[:2], groups, dtype=torch.bool)
    probed.scatter_(-1, query_groups, True)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same = probed.gather(-1, key_groups[:, None, :].expand(-1, length, -1))
    return (same & causal & valid[:, :, None] & valid[:, None, :]).sum()


# --- the doubles: the conventions of the kernels they stand for ---


def test_flex_double_equals_torch_flex_attention_where_every_block_is_read():
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 200, 16, generator=generator)
    key, value = torch.randn(2, 2, 300, 16, generator=generator), torch.randn(2, 2, 300, 16, generator=generator)

    def mask_mod(b, h, q_index, kv_index):
        return (q_index > 3) & ((q_index * 7 + kv_index + b) % 5 < 2)

    count = torch.full((2, 1, 2), 3, dtype=torch.int32)
    indices = torch.arange(3, dtype=torch.int32).expand(2, 1, 2, 3).contiguous()
    block_mask = BlockMask.from_kv_blocks(count, indices, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(200, 300))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on the CPU suggests torch.compile
        expected, expected_lse = flex_attention(
            query, key, value, block_mask=block_mask, scale=0.2, enable_gqa=True, return_lse=True
        )
    output, lse = flex_attention_standin(
        query,
        key,
        value,
        kv_num_blocks=count,
        kv_indices=indices,
        full_kv_num_blocks=None,
        full_kv_indices=None,
        mask_mod=mask_mod,
        block_size=BLOCK,
        scale=0.2,
    )
    empty = expected_lse == float("-inf")
    assert bool(empty[..., :4].all()) and bool((lse[empty] == float("-inf")).all())  # natural log, -inf if empty
    assert bool((expected[empty] == 0).all()) and bool((output[empty] == 0).all())
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse[~empty], expected_lse[~empty], atol=1e-5, rtol=0)


def test_flex_double_reads_only_listed_blocks_and_full_blocks_without_the_mask():
    query = torch.zeros(1, 1, 256, 16)
    key = torch.zeros(1, 1, 384, 16)
    value = torch.arange(384.0).view(1, 1, 384, 1).expand(1, 1, 384, 16).contiguous()
    output, lse = flex_attention_standin(
        query,
        key,
        value,
        kv_num_blocks=torch.tensor([[[1, 0]]], dtype=torch.int32),
        kv_indices=torch.tensor([[[[2], [0]]]], dtype=torch.int32),
        full_kv_num_blocks=torch.tensor([[[0, 1]]], dtype=torch.int32),
        full_kv_indices=torch.tensor([[[[0], [1]]]], dtype=torch.int32),
        mask_mod=lambda b, h, q, kv: kv % 2 == 0,  # applied in block 2 only
        block_size=BLOCK,
        scale=1.0,
    )
    assert float(output[0, 0, 0, 0]) == pytest.approx(sum(range(256, 384, 2)) / 64)
    assert float(output[0, 0, 200, 0]) == pytest.approx(sum(range(128, 256)) / 128)


def test_varlen_double_is_bottom_right_causal_and_refuses_gqa_unless_asked():
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(n, 2, 8, generator=generator) for n in (7, 12, 12))
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    output, lse = varlen_attention_standin(query, key, value, cu_q, cu_k, 4, 7, scale=0.5)
    assert lse.shape == (2, 7)
    # Sequence 0: 3 queries over 5 keys; the last query sees all 5, the first sees keys 0..2.
    expected = dense_attention(
        query[None, :3].transpose(1, 2),
        key[None, :5].transpose(1, 2),
        value[None, :5].transpose(1, 2),
        (torch.arange(5)[None, :] <= torch.arange(3)[:, None] + 2)[None, None],
        scaling=0.5,
    )
    torch.testing.assert_close(output[:3], expected[0], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="same number of heads"):
        varlen_attention_standin(query, key[:, :1], value[:, :1], cu_q, cu_k, 4, 7, scale=0.5)
    with pytest.raises(ValueError, match="exceeds"):
        varlen_attention_standin(query, key, value, cu_q, cu_k, 3, 7, scale=0.5)


def test_twin_varlen_without_gqa_equals_the_kernel_with_gqa():
    generator = torch.Generator().manual_seed(1)
    query, key, value = torch.randn(9, 6, 8, generator=generator), *(torch.randn(9, 2, 8) for _ in range(2))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    per_position = standin_kernels(varlen_gqa=False).varlen(query, key, value, cu, cu, 5, 5, 0.3)
    gqa = standin_kernels(varlen_gqa=True).varlen(query, key, value, cu, cu, 5, 5, 0.3)
    torch.testing.assert_close(per_position, gqa, atol=1e-6, rtol=0)


# --- the fault found on CUDA: the memory-efficient kernel's empty rows, reproduced and fixed on the CPU ---


def raw_efficient_kernel(query, key, value, *, causal, bias, scale):
    """The CUDA memory-efficient kernel called as the fast path called it before the fix: its output and its
    log-sum-exp as they come (lse 0.0 for a row without visible keys)."""
    repeats = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    if bias is not None:
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    output, lse, _, _ = efficient_attention_standin(query, key, value, bias, True, 0.0, causal, scale=scale)
    return output, lse[..., : query.shape[2]]


def fixed_efficient_kernel(query, key, value, *, causal, bias, scale):
    return cuda_sdpa_kernel(
        query, key, value, causal=causal, bias=bias, scale=scale, efficient=efficient_attention_standin
    )


def test_efficient_kernel_double_reproduces_the_cuda_fault_and_the_wrapper_fixes_it():
    # The torch path of the own-group pass and B (what CUDA ran), in float64 so that only the convention can differ.
    arguments, expected, rows = sparse_case(groups=5, window=9, sinks=3, pad=0, seed=4)
    query, key, value, valid, query_groups, key_groups, sink, groups, window, scaling = arguments
    double = [tensor.double() if tensor.is_floating_point() else tensor for tensor in (query, key, value)]
    run = partial(cpu_path.sparse_attention, *double, valid, query_groups, key_groups, sink, groups, window, scaling)
    wrong = run(raw_efficient_kernel)
    assert float((wrong - expected.double()).abs().max()) > 0.05  # empty parts weighed in: the fault
    torch.testing.assert_close(run(fixed_efficient_kernel).float()[rows], expected[rows], atol=ATOL, rtol=0)


def test_efficient_wrapper_gives_empty_rows_zero_output_and_the_lowest_lse():
    generator = torch.Generator().manual_seed(2)
    query, key, value = torch.randn(1, 4, 5, 12, generator=generator), *(torch.randn(1, 2, 9, 12) for _ in range(2))
    visible = torch.rand(1, 1, 5, 9, generator=generator) < 0.5
    visible[..., 1, :] = False
    visible[..., 3, :3] = True
    bias = torch.where(visible, 0.0, torch.finfo(torch.float32).min)
    output, lse = fixed_efficient_kernel(query, key, value, causal=True, bias=bias, scale=0.3)
    # Row 1 hides every key; causal (top-left) leaves row 0 only key 0, hidden there unless visible.
    empty = ~(visible[0, 0] & torch.ones(5, 9, dtype=torch.bool).tril()).any(dim=-1)
    assert bool(empty[1]) and bool((lse[0][:, empty] == NEG).all()) and bool((output[0][:, empty] == 0).all())
    expected = dense_attention(query, key, value, visible & torch.ones(5, 9, dtype=torch.bool).tril(), scaling=0.3)
    torch.testing.assert_close(output.transpose(1, 2)[0][~empty], expected[0][~empty], atol=1e-5, rtol=0)
    assert lse.shape == (1, 4, 5)  # the kernel's padding to 32 queries cut off


# --- verification: a kernel whose conventions differ is caught, and the model stays exact ---


def kernels_with(**changes):
    twin = standin_kernels()
    fields = dict(
        name="broken",
        raw_flex=twin.raw_flex,
        raw_varlen=twin.raw_varlen,
        varlen_gqa=False,
        varlen_dtypes=twin.varlen_dtypes,
        head_dims=twin.head_dims,
    )
    return GpuKernels(**{**fields, **changes})


def log2_lse_flex(query, key, value, blocks, scale):
    output, lse = standin_kernels().raw_flex(query, key, value, blocks, scale)
    return output, lse / torch.log(torch.tensor(2.0))


def zero_lse_for_empty_rows_flex(query, key, value, blocks, scale):
    output, lse = standin_kernels().raw_flex(query, key, value, blocks, scale)
    return output, torch.where(lse == float("-inf"), 0.0, lse)


def tokens_major_lse_varlen(query, key, value, *rest):
    output, lse = standin_kernels().raw_varlen(query, key, value, *rest)
    return output, lse.transpose(0, 1).contiguous().view(lse.shape)


def gpu_path_model_equals_the_reference(monkeypatch, capsys, kernels) -> str:
    """A model on the gpu-path backend with `kernels` (checked afresh) gives the reference backend's logits, called
    twice; returns what it printed to stderr."""
    verify.forget_verdicts()
    capsys.readouterr()
    monkeypatch.setattr(verify, "gpu_kernels", lambda device, backend="auto": kernels)
    model = focus_llama(1)
    ids = torch.randint(3, VOCAB, (2, 150), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        focus_hf.set_routing(model, "hard", backend="reference")
        expected = model(input_ids=ids).logits
        focus_hf.set_routing(model, "hard", backend="gpu-path")
        actual = model(input_ids=ids).logits
        model(input_ids=ids)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
    err = capsys.readouterr().err
    return err


def causal_only_varlen(query, key, value, *rest):
    return standin_kernels().raw_varlen(query, key, value, *rest[:-1])  # the window dropped: a wrong bound


def test_a_windowed_call_that_is_not_exact_leaves_the_window_band_to_the_bands(monkeypatch, capsys):
    broken = kernels_with(raw_varlen=causal_only_varlen)
    query, key = torch.zeros(1, 4, 1, 12), torch.zeros(1, 2, 1, 12)
    assert verify.verify(query, key, broken) is None  # the rest of the path is exact
    (verdict,) = verify.verdicts().values()
    assert verdict.startswith("exact, window band in torch (varlen within a window of")
    assert not verify.verified_kernels(query, key, broken).varlen_window
    err = gpu_path_model_equals_the_reference(monkeypatch, capsys, broken)
    assert err.count("was not exact") == 1 and "did not reproduce" not in err


def test_verify_passes_the_twin():
    query, key = torch.zeros(1, 6, 1, 8), torch.zeros(1, 2, 1, 8)
    assert verify.verify(query, key, standin_kernels()) is None
    assert verify.verify(query.bfloat16(), key.bfloat16(), standin_kernels(varlen_gqa=True)) is None


@pytest.mark.parametrize(
    "broken, message",
    [
        (kernels_with(raw_flex=log2_lse_flex), "FlexAttention log-sum-exp differs"),
        (kernels_with(raw_flex=zero_lse_for_empty_rows_flex), "without visible keys"),
        (kernels_with(raw_varlen=tokens_major_lse_varlen), "varlen log-sum-exp differs"),
    ],
    ids=["log2-lse", "empty-rows-lse-0", "lse-layout"],
)
def test_verify_catches_a_kernel_convention_and_the_model_falls_back_exactly(monkeypatch, capsys, broken, message):
    query, key = torch.zeros(1, 4, 1, 12), torch.zeros(1, 2, 1, 12)
    assert message in verify.verify(query, key, broken)
    err = gpu_path_model_equals_the_reference(monkeypatch, capsys, broken)
    assert err.count("did not reproduce exact results") == 1 and message in err


# --- model level: the GPU path's twin gives the reference's logits and tokens ---


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_model_with_the_stock_backend_equals_the_reference(top_k):
    model = focus_llama(top_k)
    ids = torch.randint(3, VOCAB, (2, 150), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :23] = 0
    outputs = {}
    for backend in ("reference", "gpu-path"):
        focus_hf.set_routing(model, "hard", backend=backend)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        greedy = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None
        )
        beams = model.generate(
            input_ids=ids[:1], max_new_tokens=4, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=None
        )
        outputs[backend] = (logits, greedy, beams)
    real = mask.bool()
    torch.testing.assert_close(outputs["gpu-path"][0][real], outputs["reference"][0][real], atol=ATOL, rtol=0)
    assert torch.equal(outputs["gpu-path"][1], outputs["reference"][1])
    assert torch.equal(outputs["gpu-path"][2], outputs["reference"][2])


def test_prefill_in_chunks_after_a_cache_with_the_gpu_path_backend():
    case = dict(BASE_CASE, q_len=40)
    output, reference, rows = run_case(case, backend="gpu-path")
    torch.testing.assert_close(output[rows], reference[rows], atol=ATOL, rtol=0)


def test_hard_attention_takes_the_gpu_path_for_the_gpu_path_backend():
    hard.forget_fallbacks()
    run_case(dict(BASE_CASE), backend="gpu-path")
    assert hard.paths_run() == {"gpu-sparse": 1}


def test_the_former_backend_name_is_still_accepted_with_a_warning():
    model = focus_llama(1)
    with pytest.warns(DeprecationWarning, match="'gpu-path'"):
        focus_hf.set_routing(model, "hard", backend="stock")
    assert {layer.backend for layer in focus_hf.focus_layers(model)} == {"gpu-path"}
    hard.forget_fallbacks()
    with pytest.warns(DeprecationWarning, match="'gpu-path'"):
        run_case(dict(BASE_CASE), backend="stock")
    assert hard.paths_run() == {"gpu-sparse": 1}


# --- the whole pattern in one FlexAttention call ("auto" below its crossover on CUDA) ---


@pytest.mark.parametrize("window", [0, 16, 300])
@pytest.mark.parametrize("q_len", [700, 260, 3])
@pytest.mark.parametrize("top_k, separate", [(1, False), (2, True)])
def test_pattern_attention_equals_dense_oracle(window, q_len, top_k, separate, monkeypatch):
    arguments, expected, rows = sparse_case(length=700, q_len=q_len, top_k=top_k, separate=separate, window=window)
    query, key, value, valid, query_groups, key_groups, sink, _, _, scaling = arguments
    captured = []
    twin = standin_kernels()

    def capture(query, key, value, blocks, scale):
        captured.append(blocks)
        return twin.raw_flex(query, key, value, blocks, scale)

    kernels = GpuKernels("capture", capture, None, False, (), twin.head_dims)
    routing = (query_groups, key_groups, sink, window, scaling)
    output = gpu_path.pattern_attention(query, key, value, valid, *routing, kernels)
    torch.testing.assert_close(output[rows], expected[rows], atol=ATOL, rtol=0)
    blocks = captured[0]
    full = listed_pairs(blocks.full_num_blocks, blocks.full_indices, q_len, 700)
    partial = listed_pairs(blocks.kv_num_blocks, blocks.kv_indices, q_len, 700)
    assert not bool((full & partial).any())
    allowed = allowed_of(arguments)[:, 0]
    assert bool((allowed | ~full).all())  # full blocks hold only allowed pairs
    if window == 300 and q_len == 700:
        assert int(blocks.full_num_blocks.sum()) > 0  # the window's inner blocks skip the rule


# --- masks that hide more than padding, read pair by pair (sliding windows, packed documents, torch.compile) ---


@pytest.mark.parametrize("mask_is_padding", [False, None], ids=["general", "unknown"])
@pytest.mark.parametrize("q_len", [97, 40, 5, 1])
@pytest.mark.parametrize("top_k", [1, 2])
def test_gpu_path_reads_a_general_mask(mask_is_padding, q_len, top_k):
    positions = torch.arange(BASE_CASE["seq"])
    sliding = (positions[:, None] - positions[None, :] < 20)[None, None]
    documents = (positions // 30)[:, None] == (positions // 30)[None, :]  # packed documents of 30 tokens
    for extra in (sliding, documents[None, None]):
        case = dict(BASE_CASE, q_len=q_len, top_k=top_k)
        extra = extra[:, :, BASE_CASE["seq"] - q_len :]
        output, reference, rows = run_case(case, backend="gpu-path", mask_is_padding=mask_is_padding, extra_mask=extra)
        torch.testing.assert_close(output[rows], reference[rows], atol=ATOL, rtol=0)


def test_unknown_padding_mask_is_read_not_assumed():
    # Left padding only, but not known to be: the same results through the mask lookup.
    output, reference, rows = run_case(dict(BASE_CASE, side="left"), backend="gpu-path", mask_is_padding=None)
    torch.testing.assert_close(output[rows], reference[rows], atol=ATOL, rtol=0)


def closure_constants(function) -> list:
    """The plain values a mask closes over (tensors are inputs of a compiled kernel; these are its constants)."""
    values = []
    for cell in function.__closure__ or ():
        value = cell.cell_contents
        if callable(value):
            values += closure_constants(value)
        elif not isinstance(value, torch.Tensor):
            values.append(value)
    return values


def test_masks_close_over_no_value_that_changes_with_the_length():
    # A compiled FlexAttention kernel takes the numbers its mask closes over as constants: one that changed with the
    # sequence length or the decoding step would compile the kernel again for every call.
    captured = []
    twin = standin_kernels()

    def capture(query, key, value, blocks, scale):
        captured.append(blocks.mask_mod)
        return twin.raw_flex(query, key, value, blocks, scale)

    kernels = GpuKernels("capture", capture, None, False, (), twin.head_dims)
    for length, q_len in ((300, 300), (333, 200)):
        arguments, _, _ = sparse_case(length=length, q_len=q_len, top_k=2, separate=True)
        gpu_path.gpu_sparse_attention(*arguments, kernels)
        gpu_path.pattern_attention(*arguments[:7], *arguments[8:], kernels)
    assert len(captured) == 4  # per length: the own-group pass's call and the whole pattern's
    for first, second in zip(captured[:2], captured[2:]):
        assert closure_constants(first) == closure_constants(second)
    store = paged_keys_module.PagedKeys(4, 16)
    masks = []
    for n in (300, 301):
        arguments, _, _ = sparse_case(length=n, q_len=1)
        query, key, value, valid, query_groups, key_groups, sink, _, window, scaling = arguments
        store.update(key, value, key_groups, sink, valid, window)
        masks.append(store.decode_blocks(query_groups[:, 0], key_groups, sink, n).mask_mod)
    assert closure_constants(masks[0]) == closure_constants(masks[1])


@pytest.mark.parametrize("top_k, separate", [(1, False), (2, False), (1, True)])
def test_a_prefill_call_reads_the_device_at_most_three_times(top_k, separate):
    # Each read (`.item()`, `bool(tensor)`) waits for every kernel queued before it: on a GPU, where the path's many
    # small kernels are launch-bound, a read per check would expose each launch. The block-list check reads once per
    # call, the own-group pass's varlen call twice (its longest sequences).
    arguments, expected, rows = sparse_case(top_k=top_k, separate=separate)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        output = gpu_path.gpu_sparse_attention(*arguments, standin_kernels(), own_group=top_k == 1 and not separate)
    torch.testing.assert_close(output[rows], expected[rows], atol=ATOL, rtol=0)
    reads = sum(event.count for event in profile.key_averages() if event.key == "aten::_local_scalar_dense")
    assert reads <= 3, reads
