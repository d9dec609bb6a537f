"""Decoding steps that read a group-sorted copy of the distant keys (`focus_hf.attention.cpu.grouped_keys`), against the
dense oracle, step after step on one copy (generate() with the copy: tests/tuner/test_behaviour.py)."""

from __future__ import annotations

import torch
from attention_cases import ATOL, SCALING, random_routing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import focus_hf.attention.hard as hard
from focus_hf.attention.cpu.grouped_keys import GroupedKeys, one_step_behind
from focus_hf.attention.pattern import FocusPattern, allowed_pairs
from focus_hf.attention.reference import dense_attention


def decoding_case(seed, seq, kv_heads, gqa, dim, num_groups, top_k, sinks, pad, separate, adaptive):
    """One sample's states [1, heads, seq, dim], routing and left-padding validity [1, seq] (a KV cache's layout)."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, kv_heads * gqa, seq, dim, generator=generator)
    key = torch.randn(1, kv_heads, seq, dim, generator=generator)
    value = torch.randn(1, kv_heads, seq, dim, generator=generator)
    query_groups, key_groups = random_routing(generator, 1, seq, num_groups, top_k, "none", separate, adaptive)
    valid = torch.ones(1, seq, dtype=torch.bool)
    valid[0, :pad] = False
    sink = valid & (valid.cumsum(dim=1) - 1 < sinks)
    return query, key, value, query_groups, key_groups, sink, valid


def step(case, grouped, position, window, num_groups):
    """The decoding step of the token at `position` (its cache: every token up to it) and the oracle's output."""
    query, key, value, query_groups, key_groups, sink, valid = case
    end = position + 1
    model_mask = valid[:, None, None, :end]
    groups = (query_groups[:, position:end], key_groups[:, :end], sink[:, :end], num_groups, window)
    output = hard.hard_attention(
        query[:, :, position:end],
        key[:, :, :end],
        value[:, :, :end],
        FocusPattern(*groups, model_mask=model_mask),
        scaling=SCALING,
        backend="sdpa",
        key_copy=[grouped],
    )
    positions = torch.arange(end)
    allowed = allowed_pairs(
        query_groups[:, position:end], key_groups[:, :end], sink[:, :end], positions[position:], positions, window
    )
    reference = dense_attention(
        query[:, :, position:end], key[:, :, :end], value[:, :, :end], allowed[:, None] & model_mask, scaling=SCALING
    )
    return output, reference


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seq=st.integers(2, 90),
    first=st.floats(0.0, 1.0),
    kv_heads=st.integers(1, 2),
    gqa=st.sampled_from([1, 3]),
    dim=st.sampled_from([4, 8, 16, 32]),  # 16 and 32: the CPU kernel (`native`) serves the steps; 4 and 8: torch
    num_groups=st.integers(1, 6),
    top_k=st.integers(1, 6),
    window=st.integers(0, 30),
    sinks=st.integers(0, 4),
    pad=st.integers(0, 20),
    separate=st.booleans(),
    adaptive=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_decoding_steps_on_one_copy_equal_the_dense_oracle(
    seq, first, kv_heads, gqa, dim, num_groups, top_k, window, sinks, pad, separate, adaptive, seed
):
    top_k = min(top_k, num_groups)
    pad = min(pad, seq - 1)
    case = decoding_case(seed, seq, kv_heads, gqa, dim, num_groups, top_k, sinks, pad, separate, adaptive)
    valid = case[-1]
    grouped = GroupedKeys(num_groups)
    served = 0
    # The first step takes in many keys at once (a prompt's), each later one the key that has just left the window.
    for position in range(int(first * (seq - 1)), seq):
        output, reference = step(case, grouped, position, window, num_groups)
        if valid[0, position]:
            torch.testing.assert_close(output, reference, atol=ATOL, rtol=0)
        first_window = position - window
        if first_window > 0 and bool(valid[0, first_window:].all()):
            served += 1  # a step the copy can serve: it holds exactly the keys beyond the window
            assert grouped.filled == first_window
            assert sum(grouped.counts) == grouped.sinks * num_groups + int((valid & ~case[5])[0, :first_window].sum())
    if seq - 1 - window > pad:
        assert served


def test_window_grown_mid_generation_falls_back_until_the_copy_is_beyond_it():
    case = decoding_case(7, 60, 2, 3, 8, 4, 1, 2, 0, True, False)
    grouped = GroupedKeys(4)
    for position in range(30, 40):
        step(case, grouped, position, 5, 4)
    assert grouped.filled == 34
    for position in range(40, 60):  # window 12: keys 28 .. 33 are in the copy and in the window until 46
        output, reference = step(case, grouped, position, 12, 4)
        torch.testing.assert_close(output, reference, atol=ATOL, rtol=0)
        assert grouped.filled == (34 if position < 47 else position - 12)


def test_unrouted_query_is_served_by_the_gather_not_the_copy():
    """A query not routed yet (group -1) sees, as `pattern.probes` says, the keys of group -1 only: the copy, whose
    buffers are indexed by group, must not serve it (index -1 would read the last group)."""
    query, key, value, query_groups, key_groups, sink, valid = decoding_case(5, 40, 2, 2, 8, 4, 1, 2, 0, False, False)
    query_groups = query_groups.clone()
    query_groups[:, 39] = -1
    case = (query, key, value, query_groups, key_groups, sink, valid)
    grouped = GroupedKeys(4)
    for position in range(20, 40):
        output, reference = step(case, grouped, position, 6, 4)
        torch.testing.assert_close(output, reference, atol=ATOL, rtol=0)


def test_one_step_behind_times_the_same_step_again():
    query, key, value, query_groups, key_groups, sink, _ = decoding_case(3, 50, 1, 3, 8, 4, 1, 4, 0, False, False)
    grouped, rewind = one_step_behind(key, value, key_groups, sink, 4, 8)
    assert grouped.filled == 50 - 2 - 8
    outputs = []
    for _ in range(2):
        rewind()
        outputs.append(step((query, key, value, query_groups, key_groups, sink, sink | True), grouped, 49, 8, 4)[0])
        assert grouped.filled == 50 - 1 - 8
    torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)


def test_no_copy_beside_an_offloading_or_reordered_cache():
    from types import SimpleNamespace

    from focus_hf.tuner.cache_state import grouped_key_copies as _grouped_keys

    assert _grouped_keys(SimpleNamespace(offloading=True), ("default", 0), fresh=True) is None
    cache = SimpleNamespace(offloading=False)
    stores = _grouped_keys(cache, ("default", 0), fresh=True)
    assert stores == {} and _grouped_keys(cache, ("default", 0), fresh=False) is stores
    assert _grouped_keys(cache, ("default", 0), fresh=True) is not stores  # a reset cache: new copies
    cache._focus_grouped_keys = "reordered"  # what a reorder of the cache's samples leaves
    assert _grouped_keys(cache, ("default", 0), fresh=False) is None
    assert _grouped_keys(cache, ("default", 0), fresh=True) == {}  # until the cache starts afresh
