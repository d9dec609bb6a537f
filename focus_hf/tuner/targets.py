"""Which modules of a model Focus routes, and whether the architecture can be routed at all."""

from __future__ import annotations

import re
import sys
from typing import Optional, Union

from torch import nn

from focus_hf.errors import UnsupportedModelError

# Model families whose attention does not go through transformers' attention-function registry: routing them
# would silently run dense attention, so they are refused by name before anything is touched.
UNSUPPORTED_MODEL_TYPES = frozenset({"falcon", "gptj", "bloom", "mpt"})


def uses_attention_registry(module: nn.Module) -> bool:
    """Whether `module`'s modeling file dispatches attention through `ALL_ATTENTION_FUNCTIONS`."""
    modeling = sys.modules.get(type(module).__module__)
    return modeling is not None and hasattr(modeling, "ALL_ATTENTION_FUNCTIONS")


def is_self_attention(module: nn.Module) -> bool:
    """A causal self-attention block of a transformers model (cross- and bidirectional attention excluded)."""
    name = type(module).__name__
    return (
        name.endswith("Attention")
        and hasattr(module, "config")
        and getattr(module, "is_causal", True)
        and not getattr(module, "is_cross_attention", False)
        and uses_attention_registry(module)
    )


def _matches(name: str, target_modules: Optional[Union[list[str], str]]) -> bool:
    if target_modules is None:
        return True
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == target or name.endswith("." + target) for target in target_modules)


def find_attention_modules(
    model: nn.Module, target_modules: Optional[Union[list[str], str]] = None
) -> dict[str, nn.Module]:
    """Names and modules of the self-attention blocks Focus will route, in model order.

    Raises:
        UnsupportedModelError: the model type is known not to use the attention registry, or no routable
            attention module matches.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in UNSUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"Focus cannot route '{model_type}' models: their attention does not use transformers' attention "
            "registry, so the sparse pattern could not be applied. Supported: llama, mistral, qwen2, qwen3, "
            "gemma/gemma2, phi3, olmo2, gpt2 and other models whose attention uses ALL_ATTENTION_FUNCTIONS."
        )
    from peft.tuners.tuners_utils import BaseTunerLayer

    found = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            module = module.get_base_layer()
        if is_self_attention(module) and _matches(name, target_modules) and not name.endswith(".base_layer"):
            found[name] = module
    if not found:
        raise UnsupportedModelError(
            f"No routable self-attention module found in {type(model).__name__} (model_type={model_type!r}, "
            f"target_modules={target_modules!r}). Focus needs decoder self-attention modules whose modeling code "
            "calls transformers' attention registry."
        )
    return found
