"""Run-time controls of a model carrying Focus adapters (a PeftModel or a transformers model)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from torch import nn

from focus_hf.attention.backends import check_backend
from focus_hf.errors import FocusConfigError
from focus_hf.tuner.config import FocusConfig
from focus_hf.tuner.layer import FocusLayer, RouterSettings


def focus_layers(model: nn.Module) -> list[FocusLayer]:
    """Every Focus-wrapped attention layer of `model`, in model order.

    Raises:
        ValueError: the model carries no Focus adapter.
    """
    layers = [module for module in model.modules() if isinstance(module, FocusLayer)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} carries no Focus adapter: call get_peft_model(model, FocusConfig(...)) "
            "or model.load_adapter(path) first (after `import focus_hf`)."
        )
    return layers


def set_routing(
    model: nn.Module,
    mode: str = "hard",
    top_k: Optional[int] = None,
    backend: Optional[str] = None,
    decode_copy: Optional[bool] = None,
) -> None:
    """Switch the routing of every Focus layer without reloading the adapter.

    Args:
        model: a PeftModel or a transformers model with a Focus adapter loaded.
        mode: `"soft"` (differentiable gate, dense cost, used for training), `"hard"` (the sparse pattern) or
            `"auto"` (soft in train mode, hard in eval mode, the default after loading).
        top_k: groups each query probes in hard mode; None keeps each adapter's configured value.
        backend: attention implementation of hard mode (see `focus_hf.attention.backends`): `"reference"` (dense masked
            oracle), `"sdpa"` (two standard attention calls merged by log-sum-exp, CPU and CUDA), `"flash"`
            (the same on flash-attn, CUDA only), or `None`/`"auto"`: the fastest available, dense masked on
            short sequences.
        decode_copy: whether a hard-mode decoding step of one sample reads its probed groups from a group-sorted copy
            of the distant keys and values kept beside the KV cache (True, the default: no gather, several times
            faster on long caches, at the memory of a second copy of the routed heads' cache) or gathers them from
            the cache (False); None keeps the current choice. A cache that offloads its layers
            (`DynamicCache(offloading=True)`) never gets the copy.

    Raises:
        BackendUnavailableError: `backend="flash"` without CUDA or without flash-attn installed.
    """
    layers = focus_layers(model)
    if backend is not None:
        check_backend(backend, next(model.parameters()).device)
    for layer in layers:
        layer.set_routing(mode, top_k, backend, decode_copy)


# Options that change what the hard pattern keeps but not what the routers learned, so a trained adapter can
# take new values: a wider window only adds local pairs, dense heads and dense_below only add dense attention,
# probe_mass only changes how many of its best groups a query probes.
RUNTIME_OPTIONS = ("window", "top_k", "probe_mass", "dense_heads", "dense_below")


def configure_adapter(model: nn.Module, adapter_name: Optional[str] = None, **options: Any) -> FocusConfig:
    """Change run-time options of a loaded Focus adapter; `save_pretrained` then records the new values.

    A `top_k` given to `set_routing` is a run-time override of the loaded layers (never saved) and still takes
    precedence over the configured one (`set_routing(model, mode)` without `top_k` clears it).

    Args:
        model: a PeftModel or a transformers model with a Focus adapter loaded.
        adapter_name: the adapter to change; None: the active one.
        **options: any of `window`, `top_k`, `probe_mass`, `dense_heads` (`[layer, kv_head]` pairs), `dense_below`.

    Returns:
        The adapter's new `FocusConfig`.

    Raises:
        FocusConfigError: an option that needs retraining, or a value out of range (nothing is changed then).
    """
    unknown = sorted(set(options) - set(RUNTIME_OPTIONS))
    if unknown:
        raise FocusConfigError(
            f"configure_adapter cannot change {unknown}: only {list(RUNTIME_OPTIONS)} can change after training; "
            "train a new adapter for the others."
        )
    layers = focus_layers(model)
    name = adapter_name or layers[0]._active_router()
    configs = getattr(model, "peft_config", {})
    if name not in configs:
        raise FocusConfigError(f"No Focus adapter named {name!r}; loaded: {sorted(configs)}.")
    config = dataclasses.replace(configs[name], **options)  # validates before anything changes
    configs[name] = config
    for layer in layers:
        if name in layer.focus_settings:
            layer.focus_settings[name] = RouterSettings.from_config(config)
    return config
