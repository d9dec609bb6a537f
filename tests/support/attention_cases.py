"""The attention tests' shared cases: random routings and states, hypothesis cases of one hard-attention call, and
`run_case`, which runs a case through a backend and through the dense oracle (plain masked attention in float64)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from peft import get_peft_model
from tiny_models import tiny_model

import focus_hf
import focus_hf.attention.hard as hard
from focus_hf.attention.pattern import FocusPattern, allowed_pairs
from focus_hf.attention.reference import dense_attention

ATOL = 1e-4
SCALING = 0.3


def random_routing(generator, batch, seq, num_groups, top_k, skew, separate=False, adaptive=False):
    """Query groups [batch, seq, top_k] (distinct, best first) and key groups [batch, seq].

    Key groups are the queries' best groups, or with `separate` drawn on their own (a separate query router, whose
    probes need not include the token's own group). skew "one" puts every token's best group on group 0; "some"
    leaves groups without keys. `adaptive` leaves some later slots unprobed (they repeat the first group, as
    adaptive probing writes them).
    """
    scores = torch.rand(batch, seq, num_groups, generator=generator)
    if skew == "one":
        scores[..., 0] += 2.0
    elif skew == "some":
        scores[..., : max(1, num_groups // 2)] += 1.0
    query_groups = scores.argsort(dim=-1, descending=True)[..., :top_k]
    if adaptive:
        unprobed = torch.rand(batch, seq, top_k, generator=generator) < 0.5
        unprobed[..., 0] = False
        query_groups = torch.where(unprobed, query_groups[..., :1], query_groups)
    if separate:
        return query_groups, torch.randint(num_groups, (batch, seq), generator=generator)
    return query_groups, query_groups[..., 0]


def padding(batch, seq, side, pad):
    valid = torch.ones(batch, seq, dtype=torch.bool)
    if side == "left":
        valid[0, :pad] = False
    elif side == "right":
        valid[0, seq - pad :] = False
    return valid


def states(generator, batch, heads, seq, dim, token_major):
    """Random states [batch, heads, seq, dim], laid out as projections (token-major) or as a KV cache."""
    if token_major:
        return torch.randn(batch, seq, heads, dim, generator=generator).transpose(1, 2)
    return torch.randn(batch, heads, seq, dim, generator=generator)


@st.composite
def cases(draw):
    """One call of hard attention: shapes, routing, window, sinks, padding, layout and the CPU path's tile sizes."""
    seq = draw(st.sampled_from([1, 2, 3, 5, 7, 13, 31, 37, 61, 64, 97, 101, 127, 131]))
    num_groups = draw(st.integers(1, 6))
    q_len = draw(st.sampled_from(["all", "one", "few", "many"]))
    q_len = {"all": seq, "one": 1, "few": min(seq, 5), "many": min(seq, max(1, seq - 7))}[q_len]
    side = draw(st.sampled_from(["none", "left", "right"]))
    return dict(
        seq=seq,
        q_len=q_len,
        batch=draw(st.integers(1, 3)),
        kv_heads=draw(st.integers(1, 2)),
        gqa=draw(st.sampled_from([1, 3, 4])),
        dim=draw(st.sampled_from([4, 8, 16])),  # 16: the C prefill kernel takes it
        num_groups=num_groups,
        top_k=draw(st.integers(1, num_groups)),
        window=draw(st.integers(0, 40)),
        sinks=draw(st.integers(0, 4)),
        side=side,
        pad=draw(st.integers(1, max(1, seq - 1))) if side != "none" else 0,
        skew=draw(st.sampled_from(["none", "one", "some"])),
        token_major=draw(st.booleans()),
        local_block=draw(st.sampled_from([1, 4, 16, 64])),
        probe_chunk=draw(st.sampled_from([1, 5, 256])),
        stream_rows=draw(st.sampled_from([3, 16, 4096])),
        own_group_rows=draw(st.sampled_from([2, 16, 8192])),
        split_min_keys=draw(st.sampled_from([1, 8, 1024])),
        causal_chunk=draw(st.sampled_from([1, 6, 4096])),
        lead_max_keys=draw(st.sampled_from([0, 3, 16])),
        direct_gather=draw(st.sampled_from([0, 4096])),
        separate=draw(st.booleans()),
        adaptive=draw(st.booleans()),
        dense_masked=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


# bfloat16 cases keep their values within this bound, which bounds the error of the weights' rounding (below).
BF16_VALUE_BOUND = 4.0


def run_case(case, backend="sdpa", mask_is_padding=True, extra_mask=None):
    """Hard attention through `backend` and the dense oracle (float64 on the same inputs) on one case; returns
    (output, reference, rows to compare). The case's "dtype" (default float32) is the inputs'; a float32 case gets the
    reference in float32."""
    generator = torch.Generator().manual_seed(case["seed"])
    batch, seq, q_len = case["batch"], case["seq"], case["q_len"]
    heads = case["kv_heads"] * case["gqa"]
    query = states(generator, batch, heads, q_len, case["dim"], case["token_major"])
    key = states(generator, batch, case["kv_heads"], seq, case["dim"], case["token_major"])
    value = states(generator, batch, case["kv_heads"], seq, case["dim"], case["token_major"])
    dtype = case.get("dtype", torch.float32)
    if dtype != torch.float32:
        value = value.clamp(-BF16_VALUE_BOUND, BF16_VALUE_BOUND)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    query_groups, key_groups = random_routing(
        generator,
        batch,
        seq,
        case["num_groups"],
        case["top_k"],
        case["skew"],
        case.get("separate", False),
        case.get("adaptive", False),
    )
    valid = padding(batch, seq, case["side"], case["pad"])
    sink = valid & (valid.cumsum(dim=1) - 1 < case["sinks"])
    positions = torch.arange(seq)
    query_positions = positions[seq - q_len :]
    model_mask = None
    if case["side"] != "none" or extra_mask is not None:
        model_mask = (query_positions[:, None] >= positions[None, :])[None, None] & valid[:, None, None, :]
        if extra_mask is not None:
            model_mask = model_mask & extra_mask
    allowed = allowed_pairs(
        query_groups[:, seq - q_len :], key_groups, sink, query_positions, positions, case["window"]
    )
    allowed = allowed[:, None] if model_mask is None else allowed[:, None] & model_mask
    # float64 on the same values: a bfloat16 result is then off by its own rounding only
    reference = dense_attention(query.double(), key.double(), value.double(), allowed, scaling=SCALING)
    groups = (query_groups[:, seq - q_len :], key_groups, sink, case["num_groups"], case["window"])
    pattern = FocusPattern(*groups, model_mask=model_mask, mask_is_padding=mask_is_padding)
    output = hard.hard_attention(query, key, value, pattern, scaling=SCALING, backend=backend)
    # Padding queries may output anything finite.
    return output, reference if dtype != torch.float32 else reference.float(), valid[:, seq - q_len :]


BASE_CASE = dict(
    seq=97,
    q_len=97,
    batch=2,
    kv_heads=2,
    gqa=3,
    dim=8,
    num_groups=5,
    top_k=2,
    window=9,
    sinks=3,
    side="left",
    pad=11,
    skew="none",
    token_major=True,
    seed=3,
)


def focus_llama(top_k):
    """A tiny llama with a Focus adapter of 4 groups, a window of 8 and 2 sinks, keeping `top_k` groups."""
    config = focus_hf.FocusConfig(num_groups=4, group_dim=8, window=8, top_k=top_k, sink_tokens=2)
    return get_peft_model(tiny_model("llama"), config).eval()
