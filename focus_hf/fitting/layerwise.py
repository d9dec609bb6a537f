"""Layer-by-layer router distillation: the calibration data of one decoder layer in memory at a time.

`focus_hf.fitting.distill.distill_routers` runs the whole model once per calibration sequence and keeps every routed
layer's targets until the fit. Because a router's loss depends only on its own layer's inputs, the same fit can
walk the decoder one layer at a time, the way GPTQ-style quantizers calibrate models larger than their device:

1. the decoder body runs once per sequence with every decoder layer replaced by a recorder that keeps the layer's
   call (the hidden states and what the layer needs besides: position embeddings, mask, ...) and passes the
   embeddings on untouched, so no decoder layer computes;
2. for each decoder layer in order, each sequence's hidden states go through that layer alone, densely (base
   attention, the Focus adapter off, `focus_hf.fitting.capture`): the pass records what the attention block saw
   (its input hidden states, post-RoPE queries and keys), which is summarised at once (`distant_attention`), and
   its output replaces the sequence's hidden states as the next layer's input;
3. the layer's router is fitted to those targets (`focus_hf.fitting.distill.fit_layer`) before the next layer starts.

Held at any time: the hidden states of every sequence at one layer boundary, one sequence's `LayerCapture` and
one layer's targets. On a model dispatched by accelerate (`device_map` with CPU or disk offload) each decoder
layer's hook loads its weights when the layer is called and frees them after, so one layer's weights are on the
device at a time. The dense computation is the one `distill_routers` makes, in another order: the routers come out
equal (same sequences, settings and seed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from focus_hf.fitting.capture import LayerCapture, _dense_capturing, capture_from_slot, distant_attention
from focus_hf.fitting.distill import (
    DistillSettings,
    LayerResult,
    _adapter_name,
    _load_checkpoint,
    _progress,
    _save_checkpoint,
    fit_layer,
    layer_targets,
    query_sample,
)
from focus_hf.fitting.parallel import shard
from focus_hf.tuner.controls import focus_layers
from focus_hf.tuner.devices import execution_device
from focus_hf.tuner.layer import FocusLayer

# One decoder layer's call: its positional arguments after the hidden states, its keyword arguments, and whether
# the hidden states came as the keyword `hidden_states`.
_Call = tuple[tuple, dict, bool]


class _Recorder(nn.Module):
    """Stands in for a decoder layer while the body runs: keeps the layer's call (and, for the first layer, the
    hidden states: the embeddings) and returns the hidden states as they came. Other attributes, such as
    `attention_type`, are read from the layer."""

    def __init__(self, layer: nn.Module, index: int, calls: dict[int, _Call], embeddings: list[torch.Tensor]):
        super().__init__()
        # Plain attributes, not submodules: the recorder holds no weights and accelerate's hooks stay on the layer.
        object.__setattr__(self, "_layer", layer)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_calls", calls)
        object.__setattr__(self, "_embeddings", embeddings)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        by_keyword = not args
        hidden = kwargs.pop("hidden_states") if by_keyword else args[0]
        self._calls[self._index] = (args[1:], kwargs, by_keyword)
        if self._index == 0:
            self._embeddings.append(hidden)
        return hidden

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_layer"), name)


def _decoder_body(model: nn.Module) -> nn.Module:
    """The decoder without the language-model head (what `capture_layers` runs)."""
    body = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(body, getattr(body, "base_model_prefix", "model"), body)


def _decoder_layers(body: nn.Module, layers: list[FocusLayer]) -> tuple[nn.ModuleList, list[list[FocusLayer]]]:
    """The body's list of decoder layers, and the Focus layers inside each (in model order)."""
    wanted = {id(layer) for layer in layers}
    for module in body.modules():
        if isinstance(module, nn.ModuleList) and len(module):
            owned = [[m for m in block.modules() if id(m) in wanted] for block in module]
            if sum(map(len, owned)) == len(layers):
                return module, owned
    raise ValueError(
        f"{type(body).__name__} has no list of decoder layers that holds every Focus layer: layer-by-layer "
        "distillation needs one; use focus_hf.fitting.distill.distill_routers."
    )


@torch.no_grad()
def _layer_inputs(body: nn.Module, blocks: nn.ModuleList, ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, _Call]]:
    """Embed one sequence and record every decoder layer's call, without running any decoder layer.

    Returns:
        The first decoder layer's input hidden states and, per decoder layer index, its call.
    """
    calls: dict[int, _Call] = {}
    embeddings: list[torch.Tensor] = []
    originals = list(blocks)
    try:
        for index, block in enumerate(originals):
            blocks[index] = _Recorder(block, index, calls, embeddings)
        body(input_ids=ids.reshape(1, -1).to(execution_device(body)), use_cache=False)
    finally:
        for index, block in enumerate(originals):
            blocks[index] = block
    if not embeddings:
        raise RuntimeError(f"{type(body).__name__} never called its first decoder layer.")
    return embeddings[0], calls


@torch.no_grad()
def _run_layer(block: nn.Module, hidden: torch.Tensor, call: _Call) -> torch.Tensor:
    args, kwargs, by_keyword = call
    output = block(*args, hidden_states=hidden, **kwargs) if by_keyword else block(hidden, *args, **kwargs)
    return output[0] if isinstance(output, tuple) else output


def _capture(slot: dict, index: int) -> LayerCapture:
    """The layer's capture, emptying the slot so the next sequence fills it afresh."""
    capture = capture_from_slot(slot, index)
    slot.clear()
    return capture


def distill_routers_layerwise(
    model: nn.Module,
    sequences: Sequence[torch.Tensor],
    settings: Optional[DistillSettings] = None,
    *,
    checkpoint_dir: Optional[str | os.PathLike] = None,
    progress: bool = True,
) -> list[LayerResult]:
    """`distill_routers` one decoder layer at a time: for models whose calibration (or weights) do not fit at once.

    Each decoder layer runs alone on the hidden states the previous one produced (densely, Focus off); its router
    is fitted to what its attention saw before the next layer runs. Works on models dispatched by accelerate
    (`device_map`, `max_memory`, `offload_folder`): each layer's weights are loaded when it is called.

    Args:
        model: a model with an active Focus adapter (its routers are updated in place; the model stays frozen).
        sequences: calibration token ids, one tensor [seq] per sequence, all of one length (all of them in every
            process of a multi-process launch).
        settings: a `DistillSettings` (defaults if None).
        checkpoint_dir: where to save progress after each layer; an existing checkpoint there is resumed (the
            finished layers still run, densely, to feed the next ones).
        progress: show a progress bar.

    Returns:
        One `LayerResult` per routed layer, equal to `distill_routers`'s for the same sequences and settings.
    """
    settings = settings or DistillSettings()
    layers = focus_layers(model)
    adapter = _adapter_name(layers[0])
    config = layers[0].focus_settings[adapter]
    mine = shard(len(sequences))  # under a multi-process launch, this process's share (see `distill_routers`)
    everyone = query_sample(sequences, config.window, settings)
    sampled = [everyone[index] for index in mine]
    folder = Path(checkpoint_dir) if checkpoint_dir is not None else None
    done = _load_checkpoint(folder, layers, adapter) if folder is not None else []
    finished = {result.layer for result in done}
    body = _decoder_body(model)
    blocks, owned = _decoder_layers(body, layers)
    todo = [[layer for layer in inside if layer.layer_index not in finished] for inside in owned]
    if not any(todo):
        return done
    last = max(index for index, inside in enumerate(todo) if inside)
    with _dense_capturing(model, []):  # the masks the body builds are those of the capture pass
        inputs = [_layer_inputs(body, blocks, sequences[index]) for index in mine]
    missing = sorted({index for index in range(last + 1) for _, call in inputs if index not in call})
    if missing:
        raise RuntimeError(f"{type(body).__name__} never called its decoder layers {missing}.")
    states = [hidden for hidden, _ in inputs]
    calls = [call for _, call in inputs]
    del inputs
    bar = _progress(last + 1, "distilling layer by layer", progress)
    for index in range(last + 1):
        per_layer: dict[int, tuple[list, list]] = {layer.layer_index: ([], []) for layer in todo[index]}
        with _dense_capturing(model, owned[index]) as slots:
            for number, queries in enumerate(sampled):
                states[number] = _run_layer(blocks[index], states[number], calls[number].pop(index))
                for layer in owned[index]:
                    if layer.layer_index not in per_layer:
                        slots[layer.layer_index].clear()
                        continue
                    capture = _capture(slots[layer.layer_index], layer.layer_index)
                    attention = distant_attention(
                        capture, queries, window=config.window, sinks=config.sink_tokens, top_m=settings.top_m
                    )
                    per_layer[layer.layer_index][0].append(attention)
                    per_layer[layer.layer_index][1].append(capture.hidden.cpu())
                    del capture
        for layer in todo[index]:
            result = fit_layer(layer, layer_targets(layer, *per_layer.pop(layer.layer_index)), settings)
            done.append(result)
            bar.set_postfix(layer=result.layer, kept=f"{result.kept_after:.3f}", largest=f"{result.largest_group:.2f}")
            if folder is not None:
                _save_checkpoint(folder, layers, adapter, done)
        bar.update(1)
    bar.close()
    return sorted(done, key=lambda result: result.layer)
