"""FlexAttention's contract, kept by every block mask the GPU path builds - shown on the CPU with torch's own kernels.

- The contract's validator (`block_masks.check_block_lists`) names each rule a mask breaks, before any kernel runs.
- Every block mask the path builds keeps all six rules (hypothesis over routings, shapes, padding, model masks,
  chunked prefill, decoding steps with filing).
- FlexAttention run eagerly - which ignores the block lists and applies `mask_mod` to every pair - gives the
  reference: every mask says everything.
- torch's compiled CPU FlexAttention kernel, which enforces the contract at compile time, runs every kind of mask the
  path builds, prefill and decoding, and equals the double call by call and the reference at the model's output.
- Compilations are bounded across twenty configurations in one process, and past torch's recompile limit a call
  takes the exact path with one warning.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from attention_cases import ATOL, BASE_CASE, SCALING, cases, run_case
from flex_kernels import CompiledCalls, compiled_cpu_kernels, dynamo_kernels, eager_kernels, strict_twin
from gpu_path_cases import allowed_of, decoding_steps, sparse_case
from hypothesis import HealthCheck, given, settings
from tiny_models import VOCAB

import focus_hf
import focus_hf.attention.gpu.paged_keys as paged_keys
import focus_hf.attention.gpu.verify as verify
import focus_hf.attention.hard as hard
from focus_hf.attention.gpu.block_masks import (
    BlockLists,
    BlockMaskContractError,
    check_block_lists,
    full_blocks_visible,
    mask_outside_lists,
)
from focus_hf.attention.gpu.flex import flex_compilations
from focus_hf.attention.gpu.gpu_path import gpu_sparse_attention
from focus_hf.attention.gpu.kernels import standin_kernels
from focus_hf.attention.reference import dense_attention


@pytest.fixture(autouse=True)
def _fresh_state():
    verify.forget_verdicts()
    hard.forget_fallbacks()
    yield
    verify.forget_verdicts()
    hard.forget_fallbacks()


@contextlib.contextmanager
def gpu_path_kernels(kernels):
    """The GPU path (`backend="gpu-path"`) on `kernels`, which the tests hold to their own checks instead of
    `verify`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hard, "verified_kernels", lambda query, key, backend="auto": kernels)
        yield


# --- the validator ---


def _lists(**changes) -> BlockLists:
    """A valid block mask of 200 queries and 300 keys (2 query blocks, 3 key blocks), then `changes`."""
    fields = dict(
        kv_num_blocks=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        kv_indices=torch.tensor([[[0, 0, 0], [1, 2, 0]], [[0, 1, 2], [0, 0, 0]]], dtype=torch.int32),
        full_num_blocks=None,
        full_indices=None,
        mask_mod=lambda b, h, q_index, kv_index: kv_index <= q_index,
        q_len=200,
        kv_len=300,
    )
    fields.update(changes)
    return BlockLists(**fields)


@pytest.mark.parametrize(
    "changes, rule",
    [
        (dict(kv_indices=torch.zeros(2, 2, 2, dtype=torch.int32)), "shape"),  # 2 wide for 3 key blocks
        (dict(kv_num_blocks=torch.zeros(2, 3, dtype=torch.int32)), "shape"),  # 3 query blocks for 200 queries
        (dict(q_len=300), "shape"),
        (dict(kv_indices=torch.zeros(2, 2, 3, dtype=torch.int64)), "dtype and layout"),
        (dict(kv_indices=torch.zeros(1, 2, 3, dtype=torch.int32).expand(2, 2, 3)), "dtype and layout"),
        (dict(kv_num_blocks=torch.tensor([[1, 4], [0, 0]], dtype=torch.int32)), "counts"),
        (dict(kv_num_blocks=torch.tensor([[1, -1], [0, 0]], dtype=torch.int32)), "counts"),
        (dict(kv_indices=torch.full((2, 2, 3), 3, dtype=torch.int32)), "indices"),
        (dict(full_num_blocks=torch.zeros(2, 2, dtype=torch.int32)), "shape"),  # counts without indices
        (
            dict(
                full_num_blocks=torch.zeros(2, 2, dtype=torch.int32),
                full_indices=torch.zeros(2, 2, 1, dtype=torch.int32),
            ),
            "shape",
        ),
    ],
)
def test_the_validator_names_the_rule_a_mask_breaks(changes, rule):
    check_block_lists(_lists())
    with pytest.raises(BlockMaskContractError, match=f"rule '{rule}'"):
        check_block_lists(_lists(**changes))


def test_shape_rules_are_checked_without_reading_values():
    check_block_lists(_lists(kv_num_blocks=torch.tensor([[1, 9], [0, 0]], dtype=torch.int32)), values=False)
    with pytest.raises(BlockMaskContractError, match="rule 'shape'"):
        check_block_lists(_lists(kv_indices=torch.zeros(2, 2, 2, dtype=torch.int32)), values=False)


def test_a_full_block_the_mask_hides_and_a_pair_outside_the_lists_are_named():
    full = dict(
        full_num_blocks=torch.ones(2, 2, dtype=torch.int32), full_indices=torch.ones(2, 2, 3, dtype=torch.int32)
    )
    assert "listed as full" in full_blocks_visible(_lists(**full))  # block 1 is partly in the future of query 0
    assert mask_outside_lists(_lists()) is not None  # query 130 sees key 0, which its block does not list
    every_causal_block = torch.tensor([[[0, 1, 2], [0, 1, 2]]] * 2, dtype=torch.int32)
    counts = torch.tensor([[1, 2]] * 2, dtype=torch.int32)
    assert mask_outside_lists(_lists(kv_num_blocks=counts, kv_indices=every_causal_block)) is None


def test_a_broken_mask_is_refused_before_any_kernel_runs():
    twin = standin_kernels()
    ran = []
    kernels = type(twin)("spy", lambda *a: ran.append(1), None, False, (), twin.head_dims)
    query, key = torch.zeros(2, 2, 200, 8), torch.zeros(2, 2, 300, 8)
    with pytest.raises(BlockMaskContractError, match="width >= 3"):
        kernels.flex(query, key, key, _lists(kv_indices=torch.zeros(2, 2, 2, dtype=torch.int32)), 1.0)
    assert ran == []


# --- every mask the path builds keeps the contract, and says everything ---


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_prefill_mask_keeps_the_contract(case):
    with gpu_path_kernels(strict_twin()):
        output, reference, rows = run_case(case, backend="gpu-path")
    torch.testing.assert_close(output[rows], reference[rows], atol=ATOL, rtol=0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_eager_flex_attention_gives_the_reference(case):
    # Eager FlexAttention reads every pair through mask_mod: no meaning may hide in the block lists.
    with gpu_path_kernels(eager_kernels()):
        output, reference, rows = run_case(case, backend="gpu-path")
    torch.testing.assert_close(output[rows], reference[rows], atol=ATOL, rtol=0)


def decode_a_while(kernels, length=300, **options):
    """Six consecutive decoding steps (filing every 8 positions), then two that rebuild the paged copy."""
    steps = list(range(length - 30, length - 24)) + [length - 3, length]
    decoding_steps(kernels, steps, (length - 3, length), length, **options)


@pytest.mark.parametrize("kernels", [strict_twin, eager_kernels], ids=["contract", "eager"])
def test_every_decoding_mask_keeps_the_contract_and_says_everything(kernels):
    decode_a_while(kernels())


# --- torch's compiled CPU kernel on every kind of mask ---

# Routings, padding, model masks and query counts of the prefill masks, on few shapes (the CPU kernel compiles per
# shape): shared top-1, top-k, a separate query router, adaptive probes, left and right padding, a sliding-window
# model mask read pair by pair, chunked prefill after a cache, and few queries (the whole-pattern call).
COMPILED_CASES = {
    "shared top-1": dict(top_k=1),
    "shared top-2, right padding": dict(top_k=2, side="right"),
    "query router top-3, adaptive": dict(top_k=3, separate=True, adaptive=True),
    "query router top-1": dict(top_k=1, separate=True),
    "chunk after a cache": dict(q_len=40),
    "few queries": dict(q_len=5),
}


@pytest.fixture
def compiler():
    """A fresh torch.compile state: the CPU kernel compiles per shape, and each test stays within its recompile
    limit (the disk cache of compiled kernels keeps recompilation cheap)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("changes", COMPILED_CASES.values(), ids=COMPILED_CASES.keys())
def test_the_compiled_cpu_kernel_runs_every_prefill_mask(changes, compiler):
    record = CompiledCalls()
    case = {**BASE_CASE, "seq": 200, "q_len": 200, "pad": 17, **changes}
    with gpu_path_kernels(compiled_cpu_kernels(record)):
        output, reference, rows = run_case(case, backend="gpu-path")
    torch.testing.assert_close(output[rows], reference[rows], atol=ATOL, rtol=0)
    # The own-group pass on varlen, the window band in torch (`bands`): no FlexAttention.
    if changes is COMPILED_CASES["shared top-1"]:
        assert record.calls == 0
    else:
        assert record.calls >= 1
    assert hard.fallback_calls() == {}


def test_the_compiled_cpu_kernel_reads_a_model_mask_pair_by_pair(compiler):
    record = CompiledCalls()
    positions = torch.arange(200)
    sliding = (positions[:, None] - positions[None, :] < 50)[None, None]
    with gpu_path_kernels(compiled_cpu_kernels(record)):
        output, reference, rows = run_case(
            {**BASE_CASE, "seq": 200, "q_len": 200, "pad": 17},
            backend="gpu-path",
            mask_is_padding=False,
            extra_mask=sliding,
        )
    torch.testing.assert_close(output[rows], reference[rows], atol=ATOL, rtol=0)
    assert record.calls == 1  # the own-group pass, reading the mask (the window band reads it in torch: `bands`)
    assert hard.fallback_calls() == {}


def test_the_compiled_cpu_kernel_runs_decoding_steps_with_filing(compiler):
    record = CompiledCalls()
    decode_a_while(compiled_cpu_kernels(record))
    assert record.calls == 8


def test_a_model_on_the_compiled_cpu_kernel_equals_the_reference(compiler):
    # Prefill, dense heads (the routed heads run apart), a query router and greedy decoding through the paged copy.
    config = focus_hf.FocusConfig(
        num_groups=4, group_dim=8, window=8, top_k=2, sink_tokens=2, query_projection=True, dense_heads=[[0, 0]]
    )
    from peft import get_peft_model
    from tiny_models import tiny_model

    model = get_peft_model(tiny_model("llama"), config).eval()
    ids = torch.randint(3, VOCAB, (2, 150), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :23] = 0
    record = CompiledCalls()
    outputs = {}
    for backend in ("reference", "gpu-path"):
        focus_hf.set_routing(model, "hard", backend=backend)
        with gpu_path_kernels(compiled_cpu_kernels(record)), pytest.MonkeyPatch.context() as patch:
            patch.setattr(paged_keys, "FILE_EVERY", 4)
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits
            greedy = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None
            )
        outputs[backend] = (logits, greedy)
    real = mask.bool()
    torch.testing.assert_close(outputs["gpu-path"][0][real], outputs["reference"][0][real], atol=ATOL, rtol=0)
    assert torch.equal(outputs["gpu-path"][1], outputs["reference"][1])
    assert record.calls > 0
    assert hard.fallback_calls() == {}


# --- compilations bounded; past the limit, the exact path ---

ROUTINGS = [
    dict(top_k=1),
    dict(top_k=2),
    dict(top_k=1, separate=True),
    dict(top_k=3, separate=True, adaptive=True),
    dict(top_k=2, separate=True, side="right"),
]
PREFILL_SHAPES = [
    (150, 2),
    (260, 3),
    (333, 2),
    (500, 2),
    (700, 3),
    (129, 2),
    (401, 3),
    (222, 2),
    (97, 2),
    (611, 2),
    (180, 4),
]


def bfloat16_case(length: int, top_k: int, separate: bool):
    """The GPU path in bfloat16 on one routed case, and the oracle on the same rounded inputs."""
    arguments, _, rows = sparse_case(length=length, q_len=length, top_k=top_k, separate=separate)
    query, key, value, *rest = arguments
    states = tuple(state.to(torch.bfloat16) for state in (query, key, value))
    output = gpu_sparse_attention(*states, *rest, dynamo_kernels(), own_group=not separate)
    expected = dense_attention(*(state.float() for state in states), allowed_of(arguments), scaling=SCALING)
    torch.testing.assert_close(output.float()[rows], expected[rows], atol=2e-2, rtol=0)


def test_twenty_configurations_compile_a_bounded_number_of_times(compiler):
    # Lengths, batch sizes, routings, dtypes, windows and decoding steps change; the masks' code and the numbers in
    # them do not: torch.compile recompiles for new dtypes, probe slots and sizes of one, not for each call.
    configurations = 0
    with gpu_path_kernels(dynamo_kernels()):
        for index, (length, batch) in enumerate(PREFILL_SHAPES):
            routing = ROUTINGS[index % len(ROUTINGS)]
            case = {**BASE_CASE, "seq": length, "q_len": length, "batch": batch, "seed": index, "window": 5 + index}
            output, reference, rows = run_case({**case, **routing}, backend="gpu-path")
            torch.testing.assert_close(output[rows], reference[rows], atol=ATOL, rtol=0)
            configurations += 1
        for length, top_k, separate in ((300, 1, False), (450, 2, True), (520, 1, True), (260, 2, False)):
            bfloat16_case(length, top_k, separate)
            configurations += 1
        for length, window, file_every in ((300, 16, 8), (420, 40, 5), (200, 3, 128), (350, 16, 4), (280, 9, 8)):
            decode_a_while(dynamo_kernels(), length, window=window, file_every=file_every)
            configurations += 1
        counts = flex_compilations()
    assert configurations >= 20
    assert hard.fallback_calls() == {}
    limit = torch._dynamo.config.recompile_limit
    assert all(count < limit for count in counts.values()), counts
    assert sum(counts.values()) <= 12, counts


def test_past_the_recompile_limit_a_call_takes_the_exact_path_with_one_warning(compiler, capsys):
    # One compilation per kind allowed; the probe slots (2, then 4, then 8) of the whole pattern's rule (a few queries
    # after a cache) need a new one each time.
    with gpu_path_kernels(dynamo_kernels()), torch._dynamo.config.patch(recompile_limit=1):
        for top_k in (2, 3, 5):
            case = {**BASE_CASE, "seq": 260, "q_len": 5, "num_groups": 6, "top_k": top_k}
            output, reference, rows = run_case(case, backend="gpu-path")
            torch.testing.assert_close(output[rows], reference[rows], atol=ATOL, rtol=0)
    assert hard.fallback_calls() == {"recompile limit": 2}
    assert capsys.readouterr().err.count("reached its recompile limit") == 1


def test_inside_a_compiled_model_each_call_runs_its_own_compiled_function(compiler):
    # Traced into a compiled model's graph, the decoding step's FlexAttention failed to lower on an H200 (torch 2.11);
    # so a call under torch.compile leaves the model's graph, once per call, and runs the path's own compiled
    # function of its kind - counted by `flex_compilations`, and equal to the oracle.
    arguments, expected, rows = sparse_case(top_k=2, separate=True)
    query, key, value, *rest = arguments

    def attention(query, key, value):
        return gpu_sparse_attention(query, key, value, *rest, dynamo_kernels(), own_group=False)

    explained = torch._dynamo.explain(attention)(query, key, value)
    # The own-group pass's call (the window band runs in torch: `bands`).
    assert explained.graph_break_count >= 1, explained
    for graph in explained.graphs:
        assert "flex_attention" not in str(graph.code), "FlexAttention was traced into the model's graph"
    torch._dynamo.reset()
    output = torch.compile(attention, backend="eager")(query, key, value)
    torch.testing.assert_close(output[rows], expected[rows], atol=ATOL, rtol=0)
    counts = flex_compilations()
    assert counts["full"] >= 1, counts
