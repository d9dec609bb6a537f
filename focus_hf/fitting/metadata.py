"""What a saved adapter records about where it came from: the base model id, the package versions, JSON values.

Shared by `focus_hf.fitting.trainer` (router training) and `focus_hf.fitting.distill` (router distillation), which
both write an adapter folder with `adapter_config.json` and `training_log.json`.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any, Optional

from torch import nn

from focus_hf.aliases import MODEL_ALIASES, default_cache_dir, resolve_model_id

__all__ = ["base_model_id", "jsonable", "versions"]


def base_model_id(model: nn.Module, explicit: Optional[str]) -> Optional[str]:
    """The base model to record in an adapter config.

    Args:
        model (`nn.Module`):
            The (PEFT-wrapped) model; its config's `_name_or_path` is used when `explicit` is None.
        explicit (`str`, *optional*):
            A base model the caller names (Hub id, alias or local folder); wins over the model's config.

    Returns:
        The Hub id (an alias, or the alias cache folder, maps to its Hub id), an absolute path for a local folder
        named explicitly, or None when neither `explicit` nor the model's config names a base model.
    """
    if explicit is not None:
        resolved = resolve_model_id(explicit)
        # A local folder is recorded as an absolute path, so the adapter config stays valid from any directory.
        return os.path.abspath(resolved) if os.path.isdir(resolved) else resolved
    config = getattr(getattr(model, "base_model", model), "config", None) or getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    if not name:
        return None
    path = Path(name)
    for alias in MODEL_ALIASES.values():
        if path.name == alias.name and path.parent.name == "models":
            return alias.hub_id
    try:
        if path.resolve().parent == (default_cache_dir() / "models").resolve() and path.name in MODEL_ALIASES:
            return MODEL_ALIASES[path.name].hub_id
    except OSError:
        pass
    return resolve_model_id(name)


def jsonable(value: Any) -> Any:
    """`value` made JSON-serialisable: dicts (string keys), lists, and scalars kept; anything else as `str(value)`.

    Tuples and sets become lists.
    """
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    return str(value)


def versions() -> dict[str, str]:
    """The versions of focus_hf, torch, transformers, peft and Python, as recorded in `training_log.json`."""
    import peft
    import torch
    import transformers

    from focus_hf import __version__

    return {
        "focus_hf": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "python": platform.python_version(),
    }
