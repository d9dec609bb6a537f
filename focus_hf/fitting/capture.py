"""What the frozen model attends to: per routed layer, its input hidden states and its own attention mass.

The recall audit and router distillation both start from one dense forward pass of the base model (the Focus
adapter switched off) that keeps, for every routed layer, the hidden states entering the attention block (what the
router sees) and the post-RoPE queries and keys (what decides the attention). From those, `distant_attention`
walks the queries in chunks and reports, per head, how much attention each query pays to its local window and
sinks (always kept), and where the rest - the distant mass a router must keep - goes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from focus_hf.tuner.controls import focus_layers
from focus_hf.tuner.devices import execution_device
from focus_hf.tuner.layer import FocusLayer
from focus_hf.tuner.model import attention_configs

CAPTURE_NAME = "focus_capture"
_CAPTURE_ATTRIBUTE = "_focus_capture"


@dataclass
class LayerCapture:
    """One routed layer of one sequence (batch of one), from a dense forward pass.

    Attributes:
        hidden: [seq, hidden_size] hidden states entering the attention block.
        query: [heads, seq, head_dim] post-RoPE queries.
        key: [kv_heads, seq, head_dim] post-RoPE keys (GQA not repeated).
        scaling: multiplier of q.k the model uses.
        softcap: logit soft-capping of the model, or None.
    """

    hidden: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    scaling: float
    softcap: Optional[float] = None


def _capturing_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    slot = getattr(module, _CAPTURE_ATTRIBUTE, None)
    if slot is not None:
        slot["query"], slot["key"] = query[0].detach(), key[0].detach()
        slot["scaling"] = query.shape[-1] ** -0.5 if scaling is None else scaling
        slot["softcap"] = kwargs.get("softcap")
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register(CAPTURE_NAME, _capturing_attention)
AttentionMaskInterface.register(CAPTURE_NAME, sdpa_mask)


@contextlib.contextmanager
def _dense_capturing(model: nn.Module, layers: list[FocusLayer]) -> Iterator[dict[int, dict]]:
    """Base model attention (adapters off) that records q/k and the attention inputs of every routed layer."""
    slots: dict[int, dict] = {layer.layer_index: {} for layer in layers}
    configs = attention_configs(model)
    saved = [(config, config._attn_implementation) for config in configs]
    hooks = []
    for layer in layers:
        slot = slots[layer.layer_index]
        setattr(layer.base_layer, _CAPTURE_ATTRIBUTE, slot)

        def keep_hidden(module, args, kwargs, slot=slot):
            hidden = args[0] if args else kwargs["hidden_states"]
            slot["hidden"] = hidden[0].detach()

        hooks.append(layer.register_forward_pre_hook(keep_hidden, with_kwargs=True))
    disabled = [(layer, layer.disable_adapters) for layer in layers]
    try:
        for config, _ in saved:
            config._attn_implementation = CAPTURE_NAME
        for layer, _ in disabled:
            layer.enable_adapters(False)
        yield slots
    finally:
        for config, implementation in saved:
            config._attn_implementation = implementation
        for layer, was_disabled in disabled:
            layer.enable_adapters(not was_disabled)
        for hook in hooks:
            hook.remove()
        for layer in layers:
            setattr(layer.base_layer, _CAPTURE_ATTRIBUTE, None)


@torch.no_grad()
def capture_layers(model: nn.Module, input_ids: torch.Tensor) -> dict[int, LayerCapture]:
    """Run the base model (Focus off) on one sequence and keep what every routed layer saw.

    Args:
        model: a model carrying a Focus adapter (PeftModel or transformers model).
        input_ids: [seq] or [1, seq] token ids.

    Returns:
        routed layer index -> `LayerCapture`.
    """
    layers = focus_layers(model)
    body = model.get_base_model() if hasattr(model, "get_base_model") else model
    # The decoder body is enough: logits over the vocabulary are not needed and cost seq x vocab memory.
    runner = getattr(body, getattr(body, "base_model_prefix", "model"), body)
    ids = input_ids.reshape(1, -1).to(execution_device(runner))  # not a weight's device: it may be meta (offloaded)
    with _dense_capturing(model, layers) as slots:
        runner(input_ids=ids, use_cache=False)
    return {index: capture_from_slot(slot, index) for index, slot in slots.items()}


def capture_from_slot(slot: dict, index: int) -> LayerCapture:
    """The `LayerCapture` a capturing pass left in `slot` for routed layer `index`."""
    if "query" not in slot:
        raise RuntimeError(f"Routed layer {index} never called its attention function during capture.")
    return LayerCapture(slot["hidden"], slot["query"], slot["key"], slot["scaling"], slot["softcap"])


def query_positions(seq_len: int, window: int, count: Optional[int] = None, generator=None) -> torch.Tensor:
    """Positions of the queries that have distant keys (beyond `window`), all or a random `count` of them, sorted.

    The last 64 positions are always included (prompts end with the question that needs a distant key), so a
    sample has `count + 64` queries whenever the sequence is long enough.
    """
    first = window + 1
    if first >= seq_len:
        return torch.empty(0, dtype=torch.long)
    positions = torch.arange(first, seq_len)
    last = positions[-64:]
    earlier = positions[:-64]
    if count is not None and count < len(earlier):
        chosen = earlier[torch.randperm(len(earlier), generator=generator)[:count]]
        positions = torch.cat([chosen.sort().values, last])
    return positions


def _attention_rows(
    capture: LayerCapture, queries: torch.Tensor, window: int, sinks: int, chunk: int
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """Chunks of (slice into `queries`, probabilities [heads, chunk, seq], local-or-sink mask [chunk, seq])."""
    query, key = capture.query.float(), capture.key.float()
    heads, seq = query.shape[0], key.shape[1]
    keys = key.repeat_interleave(heads // key.shape[0], dim=0)
    positions = torch.arange(seq, device=query.device)
    queries = queries.to(query.device)
    for start in range(0, len(queries), chunk):
        rows = queries[start : start + chunk]
        logits = torch.einsum("hqd,hkd->hqk", query[:, rows], keys) * capture.scaling
        if capture.softcap is not None:
            logits = torch.tanh(logits / capture.softcap) * capture.softcap
        distance = rows[:, None] - positions[None, :]
        probs = torch.softmax(logits.masked_fill((distance < 0)[None], float("-inf")), dim=-1)
        free = (distance <= window) | (positions[None, :] < sinks)
        yield slice(start, start + len(rows)), probs, free


@dataclass
class DistantAttention:
    """Where the attention of some queries of one layer goes (per head).

    Attributes:
        queries: [n] query positions.
        local: [heads, n] mass on the window and the sinks (always kept).
        top_keys: [heads, n, m] the m distant keys with the most mass, or None.
        top_mass: [heads, n, m] their mass, or None.
        group_mass: [heads, n, K] distant mass per key group, when key groups were given, else None.
        best_mass: [heads, n] mass on the `keep_counts` distant keys with the most mass over all heads of the
            layer, when keep counts were given, else None.
    """

    queries: torch.Tensor
    local: torch.Tensor
    top_keys: Optional[torch.Tensor] = None
    top_mass: Optional[torch.Tensor] = None
    group_mass: Optional[torch.Tensor] = None
    best_mass: Optional[torch.Tensor] = None


@torch.no_grad()
def distant_attention(
    capture: LayerCapture,
    queries: torch.Tensor,
    *,
    window: int,
    sinks: int,
    top_m: int = 0,
    key_groups: Optional[torch.Tensor] = None,
    num_groups: Optional[int] = None,
    keep_counts: Optional[torch.Tensor] = None,
    chunk: int = 256,
) -> DistantAttention:
    """Summarise the model's own attention for `queries` of one captured layer.

    Args:
        capture: the layer's `LayerCapture`.
        queries: [n] query positions.
        window: the Focus window: keys that close are always visible.
        sinks: the Focus sink count: the first keys, always visible.
        top_m: keep the `top_m` distant keys with the most mass per (head, query) (0: none).
        key_groups: [seq] each key's group: report the distant mass per group (exact).
        num_groups: K, needed with `key_groups`.
        keep_counts: [n] distant keys a selector may keep per query: report the mass on the best that many keys
            (ranked by their mass summed over the layer's heads: one choice per layer, as Focus makes). No
            selector that keeps that many distant keys per query, shared by the heads, keeps more.
        chunk: queries per step (memory ~ heads x chunk x seq floats).
    """
    heads = capture.query.shape[0]
    n = len(queries)
    local = torch.zeros(heads, n)
    top_keys = torch.zeros(heads, n, top_m, dtype=torch.long) if top_m else None
    top_mass = torch.zeros(heads, n, top_m) if top_m else None
    group_mass = torch.zeros(heads, n, num_groups) if key_groups is not None else None
    best_mass = torch.zeros(heads, n) if keep_counts is not None else None
    membership = None
    if key_groups is not None:
        membership = torch.nn.functional.one_hot(key_groups.to(capture.query.device), num_groups).float()
    for rows, probs, free in _attention_rows(capture, queries, window, sinks, chunk):
        local[:, rows] = (probs * free).sum(-1).cpu()
        distant = probs.masked_fill(free[None], 0.0)
        if top_m:
            mass, index = distant.topk(min(top_m, distant.shape[-1]), dim=-1)
            top_mass[:, rows, : mass.shape[-1]] = mass.cpu()
            top_keys[:, rows, : index.shape[-1]] = index.cpu()
        if membership is not None:
            group_mass[:, rows] = (distant @ membership).cpu()
        if keep_counts is not None:
            order = distant.sum(0).argsort(dim=-1, descending=True)  # [chunk, seq], one ranking per layer
            ranked = distant.gather(-1, order.expand(heads, -1, -1)).cumsum(-1)
            count = keep_counts[rows].to(ranked.device).clamp(max=ranked.shape[-1])
            picked = ranked.gather(-1, (count - 1).clamp(min=0).view(1, -1, 1).expand(heads, -1, 1))[..., 0]
            best_mass[:, rows] = torch.where(count > 0, picked, torch.zeros_like(picked)).cpu()
    return DistantAttention(queries.cpu(), local, top_keys, top_mass, group_mass, best_mass)
