"""The attention function Focus registers with transformers, and the routing it reads from its module.

Routed attention modules are wrapped by `FocusLayer`, which computes the routing from the hidden states and hands it
to the wrapped module's call as the keyword argument `focus_routing`; transformers' attention modules pass it on to
their attention function with their other keyword arguments. The routing belongs to that one call, so threads that
call one model at once each attend with their own. Every attention module of a model with a Focus adapter calls
`focus_attention_forward` (it is the model's attention implementation); modules without routing - unrouted layers,
disabled adapters - get the base implementation unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from focus_hf.attention.cpu.grouped_keys import GroupedKeys
from focus_hf.attention.cpu.native_decode import attend_runs
from focus_hf.attention.cpu.native_prefill import prefill_attention
from focus_hf.attention.gpu.paged_keys import PagedKeys
from focus_hf.attention.hard import hard_attention
from focus_hf.attention.paths import path_platform
from focus_hf.attention.pattern import FocusPattern, causal_positions, pair_distance
from focus_hf.attention.reference import ChunkBias, causal_bias, chunked_attention, hard_bias, soft_bias
from focus_hf.attention.routing import RoutingState, TokenRouting, waiting_keys
from focus_hf.errors import FocusRuntimeError

ATTENTION_NAME = "focus"
# The keyword argument that carries a call's `LayerRouting` through the attention module to `focus_attention_forward`.
ROUTING_ARGUMENT = "focus_routing"


def pattern_restricts(mode: str, kv_len: int, window: int, num_groups: int, top_k: int, dense_below: int) -> bool:
    """Whether the Focus pattern (routing `mode` "soft" or "hard") removes any causal pair among `kv_len` keys;
    where it does not, the attention is the base model's."""
    return kv_len >= first_restricted_length(mode, window, num_groups, top_k, dense_below)


def first_restricted_length(mode: str, window: int, num_groups: int, top_k: int, dense_below: int) -> float:
    """The fewest keys (the query's own included) among which the Focus pattern removes a causal pair (math.inf
    where it never does): every key within the window, one group, hard mode with every group probed or below
    `dense_below` keep the attention dense."""
    if num_groups == 1 or (mode == "hard" and top_k >= num_groups):
        return math.inf
    return window + 2 if mode == "soft" else max(window + 2, dense_below)


@dataclass
class LayerRouting:
    """Routing of one attention layer for one forward call, handed from `FocusLayer` to the attention function."""

    mode: str  # "soft" or "hard"
    backend: str  # hard mode's (`backends.BACKENDS`)
    window: int
    num_groups: int
    top_k: int
    gate_floor: float
    queries: TokenRouting  # the tokens of this call
    keys: RoutingState  # every token so far, these included
    consumed: bool = False
    dense_kv_heads: tuple[int, ...] = ()  # kv heads of this layer that keep full attention
    dense_below: int = 0  # hard mode: queries with fewer keys (themselves included) attend densely
    sink_tokens: Optional[int] = None  # the most sinks a sample has (None: not known, read from the flags)
    # Group-sorted copies of the distant keys of the layer's KV cache by run of kv heads (start, end), for one-query
    # decoding steps: one per sample (`cpu_path.grouped_decode`, the CPU path) or, under ("paged", start, end), one
    # paged copy of the batch (`gpu_path.decode_from_paged_keys`, the GPU path); None where there is no cache to keep
    # them with.
    grouped_keys: Optional[dict[tuple, Union[list[GroupedKeys], PagedKeys]]] = None

    def restricts(self, kv_len: int) -> bool:
        """Whether the pattern removes any causal pair among `kv_len` keys (otherwise attention is dense)."""
        return pattern_restricts(self.mode, kv_len, self.window, self.num_groups, self.top_k, self.dense_below)

    def grouped_for(self, heads: tuple[int, int], batch: int) -> Optional[list[GroupedKeys]]:
        """The group-sorted copies of kv heads start .. end - 1, one per sample (created empty on first use), or
        None."""
        if self.grouped_keys is None:
            return None
        if heads not in self.grouped_keys:
            self.grouped_keys[heads] = [GroupedKeys(self.num_groups) for _ in range(batch)]
        copies = self.grouped_keys[heads]
        return copies if len(copies) == batch else None

    def paged_for(self, heads: tuple[int, int]) -> Optional[PagedKeys]:
        """The paged copy of kv heads start .. end - 1 (created empty on first use), or None."""
        if self.grouped_keys is None:
            return None
        key = ("paged", *heads)
        if key not in self.grouped_keys:
            self.grouped_keys[key] = PagedKeys(self.num_groups, self.window)
        return self.grouped_keys[key]

    def invalidate_paged(self) -> None:
        """A call other than a one-query step changes the cache in a way the paged copies do not follow: they are
        rebuilt at the next step."""
        for key, copy in (self.grouped_keys or {}).items():
            if key[0] == "paged":
                copy.invalidate()

    def pattern(
        self,
        key_groups: torch.Tensor,
        key_sink: torch.Tensor,
        model_mask: Optional[torch.Tensor],
        mask_is_padding: Optional[bool],
    ) -> FocusPattern:
        """The hard pattern of this layer's call, whose keys have `key_groups` / `key_sink` (the routed tokens the
        KV cache holds) under the model's boolean mask (`pattern.FocusPattern`)."""
        return FocusPattern(
            query_groups=self.queries.top_groups,
            key_groups=key_groups,
            key_sink=key_sink,
            num_groups=self.num_groups,
            window=self.window,
            model_mask=model_mask,
            mask_is_padding=mask_is_padding,
            sink_tokens=self.sink_tokens,
            own_group=self.queries.own_groups is None,
        )

    def dense_queries(self, q_len: int) -> int:
        """How many of the call's first queries attend densely under `dense_below`: a query sees itself and every
        token before it, so it is dense iff that count is below `dense_below` - the same for a query whatever the
        call it comes in (a prompt at once, in chunks, or token by token), so caching never changes results."""
        if self.mode != "hard":
            return 0
        first_keys = self.keys.seen - q_len + 1  # keys of the call's first query
        return min(max(self.dense_below - first_keys, 0), q_len)


def as_bool_mask(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The model's mask as booleans (True = may attend), whether it came boolean or additive."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def is_causal_padding_mask(mask: Optional[torch.Tensor], q_len: int, kv_len: int) -> bool:
    """Whether a boolean mask [batch, 1, q, kv] is plain causal + key padding (what the fast paths assume).

    The fast paths read only the key padding from the model's mask (the last query's row). Any other mask - a
    block-diagonal mask of several packed documents, a sliding window, a custom 4D mask - must run where the
    mask is applied in full. Rows of padding queries (hidden from themselves) are ignored: their output is
    meaningless anyway.
    """
    if mask is None:
        return True
    if mask.shape[1] != 1 or mask.shape[-2:] != (q_len, kv_len):
        return False
    if q_len == 1:  # a decoding step: its one row is the key padding by definition (no pass over it needed)
        return True
    query_positions, key_positions = causal_positions(q_len, kv_len, mask.device)
    causal = pair_distance(query_positions, key_positions) >= 0
    key_valid = mask[:, 0, -1, :]
    expected = causal[None] & key_valid[:, None, :]
    real_query = mask[:, 0, torch.arange(q_len, device=mask.device), query_positions]
    return bool(((mask[:, 0] == expected) | ~real_query[:, :, None]).all())


def base_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Unrestricted attention, as the base model computes it (SDPA, or the dense path when SDPA cannot: soft-capped
    logits, or `output_attentions=True`, whose weights SDPA does not return).

    Without a mask the queries are the last of the keys (causal from the bottom-right corner), as everywhere in
    Focus: a later chunk of a prefill (vLLM's paged cache, `focus_hf.vllm`) comes so. SDPA's causal flag aligns
    them with the first keys instead, so such a call runs the C kernel of `native` (or the dense path)."""
    plain = kwargs.get("softcap") is None and not kwargs.get("output_attentions")
    q_len, kv_len = query.shape[2], key.shape[2]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    later_chunk = attention_mask is None and 1 < q_len < kv_len
    if plain and later_chunk and dropout == 0.0:
        computed = prefill_attention(query, key, value, causal=True, scale=scaling, first=kv_len - q_len)
        if computed is not None:
            return computed[0].transpose(1, 2), None
    if plain and not later_chunk:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    bias = causal_bias(as_bool_mask(attention_mask), q_len, kv_len, query.device)
    return _reference_attention(query, key, value, bias, scaling, dropout, kwargs)


def _reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: ChunkBias,
    scaling: float,
    dropout: float,
    kwargs: dict,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Dense attention over the pairs of `bias` in chunks of queries (`reference.chunked_attention`), with the
    soft-capping and attention weights the call's transformers keyword arguments ask for."""
    return chunked_attention(
        query,
        key,
        value,
        bias,
        scaling=scaling,
        softcap=kwargs.get("softcap"),
        dropout=dropout,
        return_weights=bool(kwargs.get("output_attentions")),
    )


def filled_slots(
    key: torch.Tensor, value: torch.Tensor, attention_mask: Optional[torch.Tensor], filled: int, q_len: int
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The first `filled` key slots [batch, kv_heads, filled, dim] and the mask's columns for them.

    A pre-allocated KV cache (`StaticCache`, `cache_implementation="static"`) hands the attention all its slots,
    token t in slot t and the slots not written yet hidden by the model's mask; Focus routed only the tokens so far,
    which are the first slots, so the rest can be left out. Any other layout is refused rather than misread.
    """
    if attention_mask is None and q_len == filled:
        # transformers leaves the mask out of a prefill into an empty static cache: SDPA's causal flag aligns the
        # queries with the first slots, which are exactly the filled ones.
        return key[:, :, :filled], value[:, :, :filled], None
    allowed = as_bool_mask(attention_mask)
    if allowed is not None and allowed.shape[-1] == key.shape[2]:
        tail = allowed[..., filled:]
        # Rows that see every slot are padding queries that transformers unmasks (SDPA would give them NaN); the
        # common case, no row seeing an unwritten slot, takes one pass over the tail only.
        if not bool(tail.any()) or not bool((tail.any(dim=-1) & ~allowed.all(dim=-1)).any()):
            return key[:, :, :filled], value[:, :, :filled], attention_mask[..., :filled]
    raise FocusRuntimeError(
        f"The attention received {key.shape[2]} keys but only {filled} tokens were routed, and the model's mask "
        f"does not hide the slots after the first {filled}: this KV cache layout is not supported. Use the default "
        "DynamicCache or a StaticCache."
    )


def focus_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Attention with the Focus pattern of the call's `focus_routing` keyword argument (transformers'
    attention-function signature).

    Shapes follow transformers: query [batch, heads, q, dim], key/value [batch, kv_heads, kv, dim] (GQA not
    repeated; during decoding the keys include the cache); returns [batch, q, heads, dim].
    """
    routing: Optional[LayerRouting] = kwargs.pop(ROUTING_ARGUMENT, None)
    if routing is None:
        return base_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    routing.consumed = True
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise FocusRuntimeError("Focus does not support models with learned attention-sink logits (s_aux) yet.")
    keys = routing.keys
    if key.shape[2] > keys.seen:
        key, value, attention_mask = filled_slots(key, value, attention_mask, keys.seen, query.shape[2])
    kv_len = key.shape[2]
    if not routing.restricts(kv_len):
        return base_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if routing.dense_kv_heads:
        return _split_dense_heads(module, routing, query, key, value, attention_mask, dropout, scaling, kwargs)
    return _routed_queries(module, routing, query, key, value, attention_mask, dropout, scaling, kwargs)


def _routed_queries(module, routing, query, key, value, attention_mask, dropout, scaling, kwargs, kv_heads=None):
    """Focus attention for routed heads; the call's first queries below `dense_below` with the base attention.

    Only ever splits queries of heads that are routed; the dense part's queries are the last of its keys, which
    `base_attention` reads right with or without a mask."""
    count = routing.dense_queries(query.shape[2])
    if not count:
        return _routed_attention(
            module, routing, query, key, value, attention_mask, dropout, scaling, kwargs, kv_heads=kv_heads
        )
    q_len, kv_len = query.shape[2], key.shape[2]
    seen_by_dense = kv_len - q_len + count  # keys up to the last dense query
    dense_mask = None if attention_mask is None else attention_mask[..., :count, :seen_by_dense]
    dense_output, dense_weights = base_attention(
        module,
        query[:, :, :count],
        key[:, :, :seen_by_dense],
        value[:, :, :seen_by_dense],
        dense_mask,
        dropout=dropout,
        scaling=scaling,
        **kwargs,
    )
    routed_mask = None if attention_mask is None else attention_mask[..., count:, :]
    later = dataclasses.replace(routing, queries=routing.queries.select_tokens(slice(count, None)))
    routed_output, routed_weights = _routed_attention(
        module, later, query[:, :, count:], key, value, routed_mask, dropout, scaling, kwargs, kv_heads=kv_heads
    )
    weights = None
    if kwargs.get("output_attentions"):
        dense_weights = torch.nn.functional.pad(dense_weights, (0, kv_len - seen_by_dense))
        weights = torch.cat([dense_weights, routed_weights], dim=2)
    return torch.cat([dense_output, routed_output], dim=1), weights


def _split_dense_heads(module, routing, query, key, value, attention_mask, dropout, scaling, kwargs):
    """Run the dense kv heads (and their query heads) with the base attention, the others with Focus.

    Heads go in runs of neighbouring kv heads of one kind, each as a view of the states (no copy: while decoding a
    copy of the cache's heads would cost as much as the attention), and the runs' outputs are joined in head order.
    """
    per_kv = query.shape[1] // key.shape[1]
    outputs, weights = [], []
    for start, end, dense in head_runs(key.shape[1], routing.dense_kv_heads):
        run = (query[:, start * per_kv : end * per_kv], key[:, start:end], value[:, start:end])
        if dense:
            output, run_weights = _dense_heads(module, *run, attention_mask, dropout, scaling, kwargs)
        else:
            output, run_weights = _routed_queries(
                module, routing, *run, attention_mask, dropout, scaling, kwargs, kv_heads=(start, end)
            )
        outputs.append(output)
        weights.append(run_weights)
    joined_weights = torch.cat(weights, dim=1) if kwargs.get("output_attentions") else None
    return torch.cat(outputs, dim=2), joined_weights


@functools.lru_cache(maxsize=256)
def head_runs(kv_heads: int, dense_kv_heads: tuple[int, ...]) -> tuple[tuple[int, int, bool], ...]:
    """The runs of neighbouring kv heads of one kind: (start, end, dense) in head order (worked out once per layout:
    every routed layer asks at every call)."""
    runs, start = [], 0
    while start < kv_heads:
        end = start + 1
        while end < kv_heads and (end in dense_kv_heads) == (start in dense_kv_heads):
            end += 1
        runs.append((start, end, start in dense_kv_heads))
        start = end
    return tuple(runs)


def _dense_heads(module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """Full attention of dense heads. A decoding step (one query per sample, every key visible, nothing but the plain
    softmax asked for) runs in the C kernel of `native` where it applies: on CPU, torch's SDPA call for one query
    costs more than the kernel's pass over the cache (1.2 ms for one kv head over 16K keys in SmolLM2)."""
    plain = dropout == 0.0 and kwargs.get("softcap") is None and not kwargs.get("output_attentions")
    if query.shape[2] == 1 and plain and kwargs.get("sliding_window") is None:
        allowed = as_bool_mask(attention_mask)
        if allowed is None or bool(allowed.all()):
            scale = query.shape[-1] ** -0.5 if scaling is None else scaling
            if len(query) == 1:  # one sample: its query as [heads, dim] is a view (cheaper than two indexings)
                output = attend_runs(query.reshape(query.shape[1], query.shape[3]), [(key[0], value[0])], scale)
                if output is not None:
                    return output.view(1, 1, *output.shape), None
            else:
                outputs = [
                    attend_runs(query[sample, :, 0], [(key[sample], value[sample])], scale)
                    for sample in range(len(query))
                ]
                if all(output is not None for output in outputs):
                    return torch.stack(outputs).unsqueeze(1), None
    return base_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _routed_attention(module, routing, query, key, value, attention_mask, dropout, scaling, kwargs, kv_heads=None):
    """Focus attention of the routed heads (kv heads `kv_heads` = (start, end) of the layer's; None: all of them)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    keys = routing.keys

    # Keys are the most recent kv_len tokens (sliding-window caches keep only those).
    start = keys.seen - kv_len
    # Slices only where the cache keeps fewer tokens than were routed (each is a tensor operation per layer and step).
    key_sink = keys.key_sink[:, start:] if start else keys.key_sink
    key_groups = keys.key_groups[:, start:] if start else keys.key_groups
    base_allowed = as_bool_mask(attention_mask)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    # Soft-capped logits (Gemma 2), attention dropout and gradients exist only in the reference path: the fast
    # path's kernels ignore the gradient of the log-sum-exp they return, which its merge depends on.
    # `output_attentions=True` needs the weights, which only the reference path forms.
    needs_grad = torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (query, key, value))
    output_attentions = bool(kwargs.get("output_attentions"))
    fast = (
        routing.backend != "reference"
        and kwargs.get("softcap") is None
        and dropout == 0.0
        and not needs_grad
        and not output_attentions
    )
    if routing.mode == "hard" and fast:
        heads = kv_heads or (0, key.shape[1])
        # Positions of the copies are the cache's slots: only while the cache holds every token since the first.
        step = q_len == 1 and start == 0
        on_gpu_path = path_platform(query.device, routing.backend) == "gpu"
        if not step:
            routing.invalidate_paged()
        # A mask that is more than causal + padding (sliding window, packed documents, any custom 4D mask) is applied
        # in full: by one dense masked call on the CPU path, pair by pair on the GPU path.
        mask_is_padding = kwargs.get("sliding_window") is None and (
            None  # not known: the GPU path reads the mask (checking it would break torch.compile's graph)
            if on_gpu_path and torch.compiler.is_compiling() and base_allowed is not None and q_len > 1
            else is_causal_padding_mask(base_allowed, q_len, kv_len)
        )
        key_copy = None
        if step:
            key_copy = routing.paged_for(heads) if on_gpu_path else routing.grouped_for(heads, query.shape[0])
        pattern = routing.pattern(key_groups, key_sink, base_allowed, mask_is_padding)
        output = hard_attention(query, key, value, pattern, scaling=scaling, backend=routing.backend, key_copy=key_copy)
        return output, None
    # The reference path: the pattern (or soft mode's gate) over dense scores, in chunks of queries.
    key_groups, key_sink = waiting_keys(key_groups, key_sink, kv_len)
    if routing.mode == "hard":
        bias = hard_bias(routing.queries.top_groups, key_groups, key_sink, routing.window, base_allowed)
    else:
        query_probs = routing.queries.probe_log_probs.exp()
        key_probs = keys.key_probs[:, start:]
        bias = soft_bias(query_probs, key_probs, key_sink, routing.window, routing.gate_floor, base_allowed)
    return _reference_attention(query, key, value, bias, scaling, dropout, kwargs)
