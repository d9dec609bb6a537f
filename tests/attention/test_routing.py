"""Router and pattern units: causal Sinkhorn, continuation state, balance, and the pair rule."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from focus_hf.attention.pattern import allowed_pairs, soft_gate
from focus_hf.attention.routing import (
    PENDING_LIMIT,
    RoutingState,
    causal_sinkhorn,
    defer_noted_steps,
    defer_tokens,
    note_step,
    probed_groups,
    route_tokens,
    settle,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noted_steps_keep_copies_not_the_models_tensors(dtype):
    # A noted step must not keep the model's tensors alive (they would pin the heap between the KV cache's blocks),
    # and must read back exactly what was noted - past the buffers' first size, with padding, after a beam reorder.
    state = RoutingState.empty(2, 3, 4, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    steps = PENDING_LIMIT + 5
    inputs = torch.randn(2, steps, 6, generator=generator).to(dtype)
    validity = torch.rand(2, steps, generator=generator) > 0.3
    for position in range(steps):
        hidden = inputs[:, position : position + 1].clone()
        valid = validity[:, position : position + 1].clone()
        if position % 2:
            hidden = inputs[:, position : position + 1].transpose(0, 1).clone().transpose(0, 1)  # not contiguous
        watched = weakref.ref(hidden), weakref.ref(valid)
        note_step(state, hidden, valid)
        del hidden, valid
        gc.collect()
        assert watched[0]() is None and watched[1]() is None, position
    assert len(state.noted_steps) == steps and state.seen == steps
    noted_hidden, noted_valid = state.noted_steps.inputs()
    assert noted_hidden.dtype == dtype
    assert torch.equal(noted_hidden, inputs) and torch.equal(noted_valid, validity)
    reordered = state.noted_steps.index_select(torch.tensor([1, 1]))
    reordered.append(inputs[:, :1], validity[:, :1])
    hidden, valid = reordered.inputs()
    assert torch.equal(hidden[:, :steps], inputs[[1, 1]]) and torch.equal(hidden[:, steps], inputs[:, 0])
    assert torch.equal(valid[:, :steps], validity[[1, 1]]) and torch.equal(valid[:, steps], validity[:, 0])


def test_dense_steps_defer_as_their_steps_would():
    # Decoding steps noted as dense (a list append each) and then deferred as one block leave the state that
    # deferring each at its step leaves, with padding and sinks among them; nothing reads them before that.
    generator = torch.Generator().manual_seed(4)
    scores = torch.randn(2, 12, 8, generator=generator) * 6
    valid = torch.tensor([[False] * 3 + [True] * 9, [True] * 12])
    options = dict(iterations=10, top_k=1, sink_tokens=5)
    _, start = route_tokens(scores[:, :2], valid[:, :2], RoutingState.empty(2, 10, 8, scores.device), **options)
    _, noted = route_tokens(scores[:, :2], valid[:, :2], RoutingState.empty(2, 10, 8, scores.device), **options)
    step_by_step = start
    for position in range(2, 12):
        token = (scores[:, position : position + 1], valid[:, position : position + 1])
        _, step_by_step = defer_tokens(*token, step_by_step, probes=None, sink_tokens=5)
        note_step(noted, *token)
    assert noted.seen == 12 and noted.pending == 0 and noted.key_groups.shape[1] == 2
    with pytest.raises(ValueError, match="defer_noted_steps"):
        route_tokens(scores[:, :1], valid[:, :1], noted, **options)
    deferred = defer_noted_steps(noted, sink_tokens=5)
    assert deferred.noted_steps is None and deferred.seen == step_by_step.seen == 12
    for field in ("valid_count", "key_groups", "key_sink", "pending_hidden", "pending_valid", "column_lse"):
        assert torch.equal(getattr(deferred, field), getattr(step_by_step, field)), field
    assert deferred.key_sink[0].tolist() == [False] * 3 + [True] * 5 + [False] * 4


def test_sinks_filled_only_once_every_sample_has_its_sinks():
    # A deferred decoding step works out no sink flags once every sample has had its sink tokens
    # (`RoutingState.sinks_filled`); a mostly padded sample keeps the flag off, and its next real tokens are sinks.
    scores = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(6))
    valid = torch.tensor([[False] * 4 + [True] * 2, [True] * 6])
    _, state = route_tokens(
        scores, valid, RoutingState.empty(2, 10, 8, scores.device), iterations=10, top_k=1, sink_tokens=3
    )
    assert not state.sinks_filled
    for _ in range(2):
        step, state = defer_tokens(scores[:, :1], torch.ones(2, 1, dtype=torch.bool), state, probes=None, sink_tokens=3)
    assert step.sink.tolist() == [[False], [False]] and state.key_sink[:, 6:].tolist() == [[True, False], [False] * 2]
    _, filled = route_tokens(
        scores,
        torch.ones(2, 6, dtype=torch.bool),
        RoutingState.empty(2, 10, 8, scores.device),
        iterations=10,
        top_k=1,
        sink_tokens=3,
    )
    assert filled.sinks_filled
    step, after = defer_tokens(scores[:, :1], torch.ones(2, 1, dtype=torch.bool), filled, probes=None, sink_tokens=3)
    assert after.sinks_filled and not bool(step.sink.any()) and after.key_sink.shape == (2, 7)
    assert not bool(after.key_sink[:, 6].any()) and step.key_groups.tolist() == [[-1], [-1]]


def test_sinkhorn_rows_are_distributions():
    log_probs, _ = causal_sinkhorn(torch.randn(2, 50, 8) * 5, torch.ones(2, 50, dtype=torch.bool), 10)
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(2, 50))


def test_sinkhorn_is_causal():
    scores = torch.randn(1, 60, 8) * 5
    changed = scores.clone()
    changed[:, 30:] = torch.randn(1, 30, 8) * 5
    valid = torch.ones(1, 60, dtype=torch.bool)
    first, _ = causal_sinkhorn(scores, valid, 10)
    second, _ = causal_sinkhorn(changed, valid, 10)
    torch.testing.assert_close(first[:, :30], second[:, :30], atol=0, rtol=0)


@settings(max_examples=30, deadline=None)
@given(total=st.integers(2, 40), split=st.integers(1, 39), groups=st.integers(1, 8), iterations=st.integers(1, 12))
def test_routing_continues_exactly_across_calls(total, split, groups, iterations):
    split = min(split, total - 1)
    scores = torch.randn(2, total, groups, generator=torch.Generator().manual_seed(total * 100 + split)) * 4
    valid = torch.ones(2, total, dtype=torch.bool)
    valid[1, :3] = False  # left padding in the second sample
    options = dict(iterations=iterations, top_k=1, sink_tokens=2)
    whole, whole_state = route_tokens(
        scores, valid, RoutingState.empty(2, iterations, groups, scores.device), **options
    )
    head, state = route_tokens(
        scores[:, :split], valid[:, :split], RoutingState.empty(2, iterations, groups, scores.device), **options
    )
    tail, state = route_tokens(scores[:, split:], valid[:, split:], state, **options)
    torch.testing.assert_close(torch.cat([head.log_probs, tail.log_probs], 1), whole.log_probs, atol=1e-5, rtol=0)
    assert torch.equal(state.key_sink, whole_state.key_sink) and state.seen == total
    assert state.key_sink[1].nonzero().flatten().tolist() == [p for p in (3, 4) if p < total]


def test_token_by_token_routing_equals_the_whole_sequence():
    # Decoding routes one token per call (its own code path): the same assignments as routing the prefix at once.
    generator = torch.Generator().manual_seed(7)
    scores = torch.randn(2, 64, 8, generator=generator) * 6
    valid = torch.ones(2, 64, dtype=torch.bool)
    options = dict(iterations=10, top_k=2, sink_tokens=4)
    whole, whole_state = route_tokens(scores, valid, RoutingState.empty(2, 10, 8, scores.device), **options)
    state = RoutingState.empty(2, 10, 8, scores.device)
    steps = []
    for position in range(64):
        step, state = route_tokens(scores[:, position : position + 1], valid[:, :1], state, **options)
        steps.append(step)
    torch.testing.assert_close(torch.cat([s.log_probs for s in steps], 1), whole.log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(state.column_lse, whole_state.column_lse, atol=1e-5, rtol=0)
    assert torch.equal(torch.cat([s.top_groups for s in steps], 1), whole.top_groups)
    assert torch.equal(state.key_groups, whole_state.key_groups) and torch.equal(state.key_sink, whole_state.key_sink)


def test_deferred_tokens_settle_to_the_routed_groups():
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 40, 8, generator=generator) * 6
    query_scores = torch.randn(2, 40, 8, generator=generator) * 6
    valid = torch.ones(2, 40, dtype=torch.bool)
    options = dict(top_k=2, sink_tokens=4)
    whole, whole_state = route_tokens(
        scores, valid, RoutingState.empty(2, 10, 8, scores.device), iterations=10, query_scores=query_scores, **options
    )
    _, state = route_tokens(
        scores[:, :30],
        valid[:, :30],
        RoutingState.empty(2, 10, 8, scores.device),
        iterations=10,
        query_scores=query_scores[:, :30],
        **options,
    )
    for position in range(30, 40):
        # The probes as `FocusLayer.query_probes` hands them over: the top-k of the query router's log-probabilities.
        probes = probed_groups(torch.log_softmax(query_scores[:, position : position + 1], dim=-1), 2)
        step, state = defer_tokens(
            scores[:, position : position + 1], valid[:, :1], state, probes=probes, sink_tokens=4
        )
        assert torch.equal(step.top_groups, whole.top_groups[:, position : position + 1])
        assert step.log_probs is None and bool((step.key_groups == -1).all())
    assert state.pending == 10 and bool((state.key_groups[:, 30:] == -1).all()) and state.key_probs.shape[1] == 30
    # routing.py never projects: the "hidden states" waiting here are the key scores themselves.
    settled = settle(state, state.pending_hidden, 10)
    assert settled.pending == 0 and torch.equal(settled.key_groups, whole_state.key_groups)
    assert torch.equal(settled.key_sink, whole_state.key_sink)
    torch.testing.assert_close(settled.key_probs, whole_state.key_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(settled.column_lse, whole_state.column_lse, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="settle"):
        route_tokens(scores[:, :1], valid[:, :1], state, iterations=10, **options)


def test_sinkhorn_balances_a_biased_router():
    # Every token prefers group 0 by a wide margin: raw argmax puts all tokens there, balancing must not.
    scores = torch.randn(1, 2000, 8)
    scores[..., 0] += 4.0
    valid = torch.ones(1, 2000, dtype=torch.bool)
    raw_dominance = (scores.argmax(-1) == 0).float().mean()
    log_probs, _ = causal_sinkhorn(scores, valid, 10)
    balanced_share = torch.bincount(log_probs.argmax(-1).flatten(), minlength=8).max() / 2000
    assert raw_dominance > 0.95
    assert balanced_share < 0.25, balanced_share


@settings(max_examples=40, deadline=None)
@given(
    q_len=st.integers(1, 12),
    extra=st.integers(0, 12),
    groups=st.integers(1, 5),
    top_k=st.integers(1, 5),
    window=st.integers(0, 8),
    seed=st.integers(0, 10_000),
)
def test_allowed_pairs_matches_the_rule(q_len, extra, groups, top_k, window, seed):
    top_k = min(top_k, groups)
    kv_len = q_len + extra
    generator = torch.Generator().manual_seed(seed)
    query_groups = torch.stack([torch.randperm(groups, generator=generator)[:top_k] for _ in range(q_len)])[None]
    key_groups = torch.randint(0, groups, (1, kv_len), generator=generator)
    key_sink = torch.rand(1, kv_len, generator=generator) < 0.2
    query_positions = torch.arange(extra, kv_len)
    key_positions = torch.arange(kv_len)
    mask = allowed_pairs(query_groups, key_groups, key_sink, query_positions, key_positions, window)
    for qi in range(q_len):
        i = extra + qi
        for j in range(kv_len):
            rule = j <= i and (
                i - j <= window or bool(key_sink[0, j]) or int(key_groups[0, j]) in query_groups[0, qi].tolist()
            )
            assert bool(mask[0, qi, j]) == rule


def test_soft_gate_tends_to_the_hard_pattern():
    # One-hot assignments: the gate is 0 for same-group and local/sink pairs and log(floor) for the others.
    groups = torch.tensor([[0, 1, 0, 1, 2, 0]])
    probs = torch.nn.functional.one_hot(groups, 3).float()
    positions = torch.arange(6)
    sink = torch.tensor([[True, False, False, False, False, False]])
    gate = soft_gate(probs, probs, sink, positions, positions, window=1, floor=1e-6)
    hard = allowed_pairs(groups[..., None], groups, sink, positions, positions, window=1)
    causal = positions[:, None] >= positions[None, :]
    assert torch.equal((gate == 0)[0] & causal, hard[0])
    assert torch.allclose(gate[0][causal & ~hard[0]], torch.tensor(1e-6).log())


@settings(max_examples=50, deadline=None)
@given(
    groups=st.integers(2, 8),
    top_k=st.integers(1, 8),
    mass=st.floats(0.05, 1.0),
    sharpness=st.floats(0.1, 10.0),
    seed=st.integers(0, 999),
)
def test_adaptive_probes_are_the_fewest_best_groups_reaching_the_mass(groups, top_k, mass, sharpness, seed):
    top_k = min(top_k, groups)
    log_probs = torch.log_softmax(
        sharpness * torch.randn(50, groups, generator=torch.Generator().manual_seed(seed)), -1
    )
    probed = probed_groups(log_probs, top_k, mass)
    fixed = probed_groups(log_probs, top_k)
    probs = log_probs.exp()
    for row in range(50):
        ranked = probs[row].sort(descending=True, stable=True)
        distinct = list(dict.fromkeys(probed[row].tolist()))  # order kept, repeats removed

        # The best groups, best first, stopping at the first prefix holding `mass` (or at top_k); float rounding
        # may move a prefix that holds the mass almost exactly to either side.
        def needed(target):
            return next((i + 1 for i in range(top_k) if float(ranked.values[: i + 1].sum()) >= target), top_k)

        assert needed(mass - 1e-6) <= len(distinct) <= needed(mass + 1e-6)
        assert distinct == ranked.indices[: len(distinct)].tolist() == fixed[row, : len(distinct)].tolist()
        assert all(g == distinct[0] for g in probed[row, len(distinct) :].tolist())
    assert torch.equal(probed_groups(log_probs, top_k, None), fixed)


@settings(max_examples=150, deadline=None)
@given(
    groups=st.integers(1, 16),
    iterations=st.integers(1, 10),
    history=st.integers(0, 40),
    top_k=st.integers(1, 4),
    mass=st.sampled_from([None, 0.3, 0.7, 0.95]),
    query_router=st.booleans(),
    sharpness=st.sampled_from([0.5, 3.0, 10.0]),
    seed=st.integers(0, 2**16),
)
def test_the_one_call_routing_of_a_decoding_token_equals_route_tokens(
    groups, iterations, history, top_k, mass, query_router, sharpness, seed
):
    """`native_decode.route_token` (csrc/routing.c), the vLLM decoding step's routing, against `route_tokens` on the
    same token after the same history: the same groups, the same column sums within float32 rounding."""
    from focus_hf.attention.cpu import native, native_decode

    assert native.native_kernels() is not None, "the C kernels must build on this machine (cc on the PATH)"
    top_k = min(top_k, groups)
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(1, history + 1, groups, generator=generator) * sharpness
    query_scores = torch.randn(1, 1, groups, generator=generator) * sharpness if query_router else None
    state = RoutingState.empty(1, iterations, groups, torch.device("cpu"))
    if history:
        _, state = route_tokens(
            scores[:, :history], torch.ones(1, history, dtype=torch.bool), state, iterations=iterations, top_k=top_k,
            sink_tokens=0,
        )  # fmt: skip
    tokens, routed = route_tokens(
        scores[:, history:], torch.ones(1, 1, dtype=torch.bool), state, iterations=iterations, top_k=top_k,
        sink_tokens=0, query_scores=query_scores, probe_mass=mass,
    )  # fmt: skip
    columns = state.column_lse.reshape(-1).clone()
    result = native_decode.route_token(
        scores[0, history], None if query_scores is None else query_scores[0, 0], columns, columns, top_k, mass
    )
    assert result is not None
    probes, key_group = result
    assert probes.tolist() == tokens.top_groups[0, 0].tolist()
    assert key_group == int(tokens.key_groups[0, 0])
    torch.testing.assert_close(columns, routed.column_lse.reshape(-1), rtol=1e-6, atol=1e-6)
