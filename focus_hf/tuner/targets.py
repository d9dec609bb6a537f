"""Which modules of a model Focus routes, and whether the architecture can be routed at all."""

from __future__ import annotations

import sys
import time
from typing import Optional, Union

import regex
from torch import nn

from focus_hf.errors import FocusConfigError, UnsupportedModelError

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


# A target_modules regex comes from adapter_config.json, possibly someone else's: its matching is bounded by the
# `regex` package's timeout (catastrophic backtracking such as `(a+)+$` would otherwise hang loading).
MAX_PATTERN_CHARS = 1000
REGEX_SECONDS = 1.0


def check_target_modules(target_modules: object) -> None:
    """Refuse a `target_modules` that is neither None, a regex string nor a list of module names."""
    if target_modules is None:
        return
    if isinstance(target_modules, str):
        if len(target_modules) > MAX_PATTERN_CHARS:
            raise FocusConfigError(
                f"FocusConfig.target_modules: a regex of at most {MAX_PATTERN_CHARS} characters, got "
                f"{len(target_modules)}."
            )
        try:
            regex.compile(target_modules)
        except regex.error as error:
            raise FocusConfigError(f"FocusConfig.target_modules is not a valid regex ({error}).") from None
        return
    if not isinstance(target_modules, (list, tuple, set)) or not all(isinstance(t, str) for t in target_modules):
        raise FocusConfigError(
            "FocusConfig.target_modules must be None, a regex string or a list of module names, "
            f"got {target_modules!r}."
        )


def _matches(name: str, target_modules: Optional[Union[list[str], str]], deadline: float) -> bool:
    if target_modules is None:
        return True
    if isinstance(target_modules, str):
        try:
            return regex.fullmatch(target_modules, name, timeout=max(deadline - time.monotonic(), 1e-3)) is not None
        except TimeoutError:
            raise FocusConfigError(
                f"FocusConfig.target_modules regex {target_modules[:80]!r} took more than {REGEX_SECONDS:g} s to match "
                "the model's module names (catastrophic backtracking). Use a simpler pattern or a list of names."
            ) from None
    return any(name == target or name.endswith("." + target) for target in target_modules)


def in_layers(name: str, layers_to_transform: Union[list[int], int, None], layers_pattern=None) -> bool:
    """Whether the module `name` lies in one of `layers_to_transform` (None: every layer), read as PEFT reads it for
    LoRA (`peft.tuners.tuners_utils.check_target_module_exists`: the first number after `layers_pattern`, or after
    any container when no pattern is given)."""
    if layers_to_transform is None:
        return True
    from types import SimpleNamespace

    from peft.tuners.tuners_utils import check_target_module_exists

    parent, _, leaf = name.rpartition(".")
    if not parent:
        return False  # a top-level module has no layer index
    # PEFT's matcher reads the layer index for list targets; the module is named by its own leaf so that it matches.
    shim = SimpleNamespace(
        target_modules=[leaf],
        layers_to_transform=layers_to_transform,
        layers_pattern=layers_pattern,
        exclude_modules=None,
        modules_to_save=None,
        target_parameters=None,
    )
    return bool(check_target_module_exists(shim, name))


def find_attention_modules(
    model: nn.Module,
    target_modules: Optional[Union[list[str], str]] = None,
    layers_to_transform: Union[list[int], int, None] = None,
    layers_pattern: Union[list[str], str, None] = None,
) -> dict[str, nn.Module]:
    """Names and modules of the self-attention blocks Focus will route, in model order (those matching
    `target_modules`, in `layers_to_transform` when it is given: see `in_layers`).

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

    check_target_modules(target_modules)
    deadline = time.monotonic() + REGEX_SECONDS
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            module = module.get_base_layer()
        if is_self_attention(module) and _matches(name, target_modules, deadline) and not name.endswith(".base_layer"):
            found[name] = module
    if found and layers_to_transform is not None:
        routable = list(found)
        found = {name: module for name, module in found.items() if in_layers(name, layers_to_transform, layers_pattern)}
        if not found:
            raise FocusConfigError(
                f"FocusConfig.layers_to_transform={layers_to_transform!r}"
                + (f" with layers_pattern={layers_pattern!r}" if layers_pattern is not None else "")
                + f" selects none of the routable attention modules ({routable[:3]}"
                + (" ..." if len(routable) > 3 else "")
                + "). Use indices of existing layers, and a layers_pattern naming the container they sit in."
            )
    if not found:
        raise UnsupportedModelError(
            f"No routable self-attention module found in {type(model).__name__} (model_type={model_type!r}, "
            f"target_modules={target_modules!r}). Focus needs decoder self-attention modules whose modeling code "
            "calls transformers' attention registry."
        )
    return found
