"""Run-time controls of a model carrying Focus adapters (a PeftModel or a transformers model)."""

from __future__ import annotations

from typing import Optional

from torch import nn

from focus_hf.attention.backends import check_backend
from focus_hf.tuner.layer import FocusLayer


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
    model: nn.Module, mode: str = "hard", top_k: Optional[int] = None, backend: Optional[str] = None
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

    Raises:
        BackendUnavailableError: `backend="flash"` without CUDA or without flash-attn installed.
    """
    layers = focus_layers(model)
    if backend is not None:
        check_backend(backend, next(model.parameters()).device)
    for layer in layers:
        layer.set_routing(mode, top_k, backend)
