"""What a Focus adapter for a given base model costs, computed without allocating the base model's weights.

The base model is built on the meta device (no memory for its weights, whatever its size), the routers are injected
exactly as `get_peft_model` does, and the adapter's state dict is measured: the parameter count, and the size of
`adapter_model.safetensors` as `save_pretrained` would write it (8-byte header length + JSON header + data).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

__all__ = ["adapter_size"]


def _model_config(model_config: Any):
    """A transformers config from a config object, a dict, a config.json path, a model folder or a Hub id."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model_config, PretrainedConfig):
        return model_config
    if isinstance(model_config, dict):
        options = dict(model_config)
        return AutoConfig.for_model(options.pop("model_type"), **options)
    return AutoConfig.from_pretrained(os.fspath(model_config))


def adapter_size(
    model_config: Union[str, os.PathLike, dict, Any],
    focus_config: Optional[Any] = None,
    **focus_options: Any,
) -> dict[str, Any]:
    """Parameter count and file size of a Focus adapter for `model_config`, without loading the model.

    Args:
        model_config: a transformers `PretrainedConfig`, a config dict (with `model_type`), the path of a
            `config.json`, a model folder or a Hub id.
        focus_config: a `FocusConfig`; by default one built from `focus_options` (e.g. num_groups=8, group_dim=16).

    Returns:
        {"model_type", "routed_layers", "hidden_size", "parameters", "file_bytes", "tensors", "base_parameters"}:
        `file_bytes` is the exact size of the `adapter_model.safetensors` that `save_pretrained` writes;
        `base_parameters` the base model's parameter count, for scale.
    """
    import torch
    from peft import get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM

    import focus_hf

    config = _model_config(model_config)
    if focus_config is None:
        focus_config = focus_hf.FocusConfig(**focus_options)
    elif focus_options:
        raise TypeError("Pass either a FocusConfig or FocusConfig options, not both.")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        base_parameters = sum(p.numel() for p in model.parameters())
        peft_model = get_peft_model(model, focus_config)
    # Focus never saves embedding layers; PEFT's "auto" would look the base model's config up on disk or the Hub.
    state = get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    # Uninitialised tensors of the saved shapes and dtypes: serialising them gives the file's exact layout.
    stand_ins = {name: torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu") for name, tensor in state.items()}
    recorded = peft_model.peft_config["default"]
    return {
        "model_type": config.model_type,
        "routed_layers": recorded.num_routed_layers,
        "hidden_size": recorded.hidden_size,
        "parameters": sum(t.numel() for t in state.values()),
        "file_bytes": len(save(stand_ins, metadata={"format": "pt"})),
        "tensors": len(state),
        "base_parameters": base_parameters,
    }
