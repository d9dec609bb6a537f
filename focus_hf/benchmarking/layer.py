"""One attention layer to time: random queries, keys and values with a real routing (`make_case`), the dense causal
baseline and the Focus call on them (`dense_call`, `focus_call`, `dense_kernel`), and the pairs the pattern allows
(`allowed_pair_count`, the pair-count ideal of a speedup). `focus-hf bench` and the CPU benchmarks share it."""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager

if TYPE_CHECKING:
    import torch

    from focus_hf.attention.routing import TokenRouting


@dataclass
class Case:
    """One attention layer's inputs: q [1, heads, n, dim], k/v [1, kv_heads, n, dim], and routing per top_k."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    routing: dict[int, TokenRouting]


def make_case(args: argparse.Namespace, seq_len: int, device: torch.device, dtype: torch.dtype) -> Case:
    """Random q/k/v laid out as a model projects them ([1, n, heads, dim] transposed) and real routing."""
    import torch
    import torch.nn.functional as F

    from focus_hf.attention.routing import RoutingState, TokenRouting, route_tokens, routing_scores
    from focus_hf.tuner.config import FocusConfig

    # On a GPU the inputs and the routing are drawn there: drawing 1M tokens' hidden states on the CPU takes longer
    # than the calls being timed. Same seeds, other random streams than on the CPU.
    setup = device if device.type == "cuda" else torch.device("cpu")
    generator = torch.Generator(device=setup).manual_seed(args.seed + seq_len)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=setup)

    defaults = FocusConfig()
    hidden_size = args.heads * args.head_dim
    hidden = draw(1, seq_len, hidden_size)
    projection = draw(hidden_size, defaults.group_dim) / math.sqrt(hidden_size)
    centroids = F.normalize(draw(args.groups, defaults.group_dim), dim=-1)
    scores = routing_scores(hidden, projection, centroids, defaults.temperature)
    query_scores = None
    if args.query_router:  # a separate query-side projection: queries probe groups other than their own
        query_projection = draw(hidden_size, defaults.group_dim) / math.sqrt(hidden_size)
        query_scores = routing_scores(hidden, query_projection, centroids, defaults.temperature)
    del hidden
    valid = torch.ones(1, seq_len, dtype=torch.bool, device=setup)
    routing = {}
    for top_k in args.top_k:
        state = RoutingState.empty(1, defaults.sinkhorn_iterations, args.groups, setup)
        tokens, _ = route_tokens(
            scores,
            valid,
            state,
            iterations=defaults.sinkhorn_iterations,
            top_k=top_k,
            sink_tokens=args.sinks,
            query_scores=query_scores,
        )
        routing[top_k] = TokenRouting(
            tokens.log_probs,
            tokens.top_groups.to(device),
            tokens.sink.to(device),
            own_groups=None if tokens.own_groups is None else tokens.own_groups.to(device),
        )

    def states(heads: int) -> torch.Tensor:
        return draw(1, seq_len, heads, args.head_dim).to(device, dtype).transpose(1, 2)

    return Case(states(args.heads), states(args.kv_heads), states(args.kv_heads), routing)


def allowed_pair_count(routing: TokenRouting, window: int, num_groups: int) -> int:
    """Allowed (query, key) pairs of one sample, counted in O(n K) memory instead of materialising n x n."""
    import torch

    from focus_hf.attention.pattern import probed_distant_keys

    groups, key_groups, sink = routing.top_groups[0].cpu(), routing.key_groups[0].cpu(), routing.sink[0].cpu()
    positions = torch.arange(groups.shape[0])
    local = torch.clamp(positions, max=window) + 1
    farthest = positions - window - 1  # last distant key of each query (negative: none)
    distant_sinks = torch.cumsum(sink.long(), 0)[farthest.clamp(min=0)] * (farthest >= 0)
    probed = probed_distant_keys(groups, key_groups, sink, window, num_groups)
    return int((local + distant_sinks + probed).sum())


def layer_fields(args: argparse.Namespace) -> dict:
    """The attention layer a row measures: K, window, sinks and head shape."""
    names = ("groups", "window", "sinks", "heads", "kv_heads", "head_dim")
    return {name: getattr(args, name) for name in names}


def dense_call(case: Case) -> Callable[[], torch.Tensor]:
    """The baseline: dense causal SDPA (GQA) on the case's q/k/v."""
    import torch.nn.functional as F

    return lambda: F.scaled_dot_product_attention(case.query, case.key, case.value, is_causal=True, enable_gqa=True)


def dense_kernel(query: torch.Tensor, key: torch.Tensor, causal: bool) -> tuple[Callable[[], ContextManager], str]:
    """(context to run the dense baseline in, the kernel's name): on CUDA torch's flash kernel when it takes inputs
    like these (tried once on a short slice), else torch's own choice, and the row says which, so that a ratio is
    never taken against a slower fallback unknowingly; on the CPU torch's choice."""
    import torch
    import torch.nn.functional as F

    if query.device.type != "cuda":
        return contextlib.nullcontext, "sdpa (torch's choice)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    keys = min(key.shape[2], 256)
    sample = query[:, :, : min(query.shape[2], keys)], key[:, :, :keys], key[:, :, :keys]
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(*sample, is_causal=causal, enable_gqa=True)
        torch.cuda.synchronize()
    except RuntimeError as error:
        reason = " ".join(str(error).split())[:160]
        return contextlib.nullcontext, f"sdpa (torch's choice; the flash kernel refused these inputs: {reason})"
    return functools.partial(sdpa_kernel, SDPBackend.FLASH_ATTENTION), "flash (torch SDPA)"


def focus_call(args: argparse.Namespace, case: Case, top_k: int) -> Callable[[], torch.Tensor]:
    import torch

    from focus_hf.attention.hard import hard_attention
    from focus_hf.attention.pattern import FocusPattern, allowed_pairs
    from focus_hf.attention.reference import dense_attention

    routing = case.routing[top_k]
    scaling = args.head_dim**-0.5
    key_groups = routing.key_groups
    if args.backend == "reference":
        positions = torch.arange(case.query.shape[2], device=case.query.device)
        return lambda: dense_attention(
            case.query,
            case.key,
            case.value,
            allowed_pairs(routing.top_groups, key_groups, routing.sink, positions, positions, args.window)[:, None],
            scaling=scaling,
        )
    groups = (routing.top_groups, key_groups, routing.sink, args.groups, args.window)
    pattern = FocusPattern(*groups, own_group=routing.own_groups is None)  # own_group as a model's routing says it
    return lambda: hard_attention(case.query, case.key, case.value, pattern, scaling=scaling, backend=args.backend)
