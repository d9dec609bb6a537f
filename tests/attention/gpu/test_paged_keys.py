"""One-query decoding steps of the GPU path over a paged, group-sorted copy of the keys (`attention.gpu.paged_keys`,
`gpu_path.decode_from_paged_keys`), run on the CPU through FlexAttention's CPU stand-in, against the dense oracle."""

from __future__ import annotations

import torch
from attention_cases import ATOL, SCALING, focus_llama
from gpu_path_cases import decoding_case, decoding_steps
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import VOCAB

import focus_hf
import focus_hf.attention.gpu.paged_keys as paged_keys
import focus_hf.attention.gpu.verify as verify
import focus_hf.attention.hard as hard
from focus_hf.attention.gpu.block_masks import BlockLists
from focus_hf.attention.gpu.gpu_path import decode_from_paged_keys
from focus_hf.attention.gpu.kernels import GpuKernels, standin_kernels
from focus_hf.attention.gpu.paged_keys import PAGE, PagedKeys
from focus_hf.attention.pattern import FocusPattern, allowed_pairs
from focus_hf.attention.reference import dense_attention


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 2**16),
    st.integers(1, 2),
    st.integers(1, 5),
    st.integers(1, 3),
    st.sampled_from([0, 3, 40, 200]),
    st.sampled_from([1, 5, 128]),
    st.integers(0, 300),
    st.integers(0, 4),
    st.booleans(),
)
def test_decoding_steps_equal_the_dense_oracle(seed, batch, groups, top_k, window, file_every, pad, sinks, separate):
    steps = list(range(290, 297)) + list(range(395, 400)) + [420]
    options = dict(seed=seed, batch=batch, groups=groups, top_k=min(top_k, groups), window=window, pad=pad)
    options.update(file_every=file_every, sinks=sinks, separate=separate)
    decoding_steps(standin_kernels(), steps, (395, 420), 420, **options)


def test_a_step_reads_the_ring_the_sinks_and_its_probed_groups_pages_only(monkeypatch):
    monkeypatch.setattr(paged_keys, "FILE_EVERY", 128)
    groups, window, length = 4, 16, 3000
    query, key, value, query_groups, key_groups, valid, sink = decoding_case(0, 1, length, groups, 1, 0, 4, skew="none")
    lists: list[BlockLists] = []
    twin = standin_kernels()

    def capture(query, key, value, blocks, scale):
        lists.append(blocks)
        return twin.raw_flex(query, key, value, blocks, scale)

    kernels = GpuKernels("capture", capture, None, False, (), twin.head_dims)
    store = PagedKeys(groups, window)
    decode_from_paged_keys(
        query[:, :, -1:], key, value, valid, query_groups[:, -1:], key_groups, sink, window, SCALING, store, kernels
    )
    probed = int(query_groups[0, -1, 0])
    filed = (length - 1 - window) // 128 * 128
    distant_of_group = int(((key_groups[0, :filed] == probed) & ~sink[0, :filed]).sum())
    expected_blocks = store.ring // PAGE + 1 + -(-distant_of_group // PAGE)  # ring, one page of sinks, the group's
    assert int(lists[0].kv_num_blocks) == expected_blocks
    assert expected_blocks * PAGE < length / 2  # about a quarter of the keys, not all of them


def test_generate_with_the_gpu_path_backend_steps_through_the_paged_copy(monkeypatch):
    monkeypatch.setattr(paged_keys, "FILE_EVERY", 4)  # filing during the steps, not only when the copy is built
    hard.forget_fallbacks()
    verify.forget_verdicts()
    model = focus_llama(2)
    ids = torch.randint(3, VOCAB, (2, 150), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, :31] = 0
    generated = {}
    for backend in ("reference", "gpu-path"):
        focus_hf.set_routing(model, "hard", backend=backend)
        generated[backend] = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    assert torch.equal(generated["gpu-path"], generated["reference"])
    assert hard.paths_run()["gpu-paged-decode"] == 11 * 2  # every step after the prefill, in both layers


def test_a_step_that_does_not_read_the_copy_has_it_rebuilt(monkeypatch):
    # A step whose query probes every group runs plain causal attention; the copy misses its key and must not be
    # read as if it had it.
    monkeypatch.setattr(paged_keys, "FILE_EVERY", 4)
    groups, window, length = 3, 6, 120
    query, key, value, query_groups, key_groups, valid, sink = decoding_case(2, 1, length, groups, 3, 0, 2)
    query_groups[..., 1:] = query_groups[..., :1]  # one probe each (adaptive probing) ...
    query_groups[:, 100] = torch.tensor([0, 1, 2])  # ... but at position 100 every group
    store = PagedKeys(groups, window)
    positions = torch.arange(length)
    verify.forget_verdicts()
    for n in range(95, 110):
        q = query[:, :, n - 1 : n]
        pattern = FocusPattern(query_groups[:, n - 1 : n], key_groups[:, :n], sink[:, :n], groups, window)
        output = hard.hard_attention(
            q, key[:, :, :n], value[:, :, :n], pattern, scaling=SCALING, backend="gpu-path", key_copy=store
        )
        allowed = allowed_pairs(
            query_groups[:, n - 1 : n], key_groups[:, :n], sink[:, :n], positions[n - 1 : n], positions[:n], window
        )
        expected = dense_attention(q, key[:, :, :n], value[:, :, :n], allowed[:, None], scaling=SCALING)
        torch.testing.assert_close(output, expected, atol=ATOL, rtol=0)
