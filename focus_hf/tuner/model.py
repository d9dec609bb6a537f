"""`FocusModel`: the PEFT tuner that injects Focus routers into a frozen transformers model."""

from __future__ import annotations

from typing import Optional

import torch
from peft.tuners.tuners_utils import BaseTuner
from torch import nn

from focus_hf.attention.function import ATTENTION_NAME
from focus_hf.files import calling_adapter_folder, validate_adapter_folder
from focus_hf.tuner.config import FocusConfig, FocusConfigError
from focus_hf.tuner.dispatch import pin_routers, unpin_routers
from focus_hf.tuner.layer import FocusLayer
from focus_hf.tuner.targets import find_attention_modules

_RECORDED_FIELDS = ("hidden_size", "num_routed_layers", "base_model_type")


def _base_description(model: nn.Module, targets: dict[str, nn.Module]) -> dict[str, object]:
    first = next(iter(targets.values()))
    return {
        "hidden_size": first.config.hidden_size,
        "num_routed_layers": len(targets),
        "base_model_type": getattr(getattr(model, "config", None), "model_type", None),
    }


def check_base_model(config: FocusConfig, model: nn.Module, targets: dict[str, nn.Module]) -> None:
    """Refuse a config recorded for another base model; record this model's description in a fresh one."""
    found = _base_description(model, targets)
    mismatches = [
        f"{name}: adapter has {getattr(config, name)!r}, model has {value!r}"
        for name, value in found.items()
        if getattr(config, name) is not None and getattr(config, name) != value
    ]
    if mismatches:
        raise FocusConfigError(
            f"This Focus adapter was made for another base model ({config.base_model_name_or_path or 'unknown'}): "
            + "; ".join(mismatches)
            + ". Load it on the model it was trained for."
        )
    for name, value in found.items():
        setattr(config, name, value)


def expected_router_shapes(config: FocusConfig, targets: dict[str, nn.Module]) -> dict[str, dict[str, tuple[int, ...]]]:
    """Module name -> shapes of its router tensors under `config`."""
    shapes = {
        "focus_proj": (config.hidden_size, config.group_dim),
        "focus_centroids": (config.num_groups, config.group_dim),
    }
    if config.query_projection:
        shapes["focus_query_proj"] = (config.hidden_size, config.group_dim)
    return {name: dict(shapes) for name in targets}


def use_focus_attention(model: nn.Module) -> None:
    """Point every routed module's config (and the model's) at the Focus attention function."""
    for config in attention_configs(model):
        config._attn_implementation = ATTENTION_NAME


def attention_configs(model: nn.Module) -> list:
    """The distinct config objects the routed attention modules (and the model's mask builder) read."""
    configs = {
        id(layer.base_layer.config): layer.base_layer.config
        for layer in model.modules()
        if isinstance(layer, FocusLayer)
    }
    if getattr(model, "config", None) is not None:
        configs.setdefault(id(model.config), model.config)
    return list(configs.values())


class FocusModel(BaseTuner):
    """Creates a Focus model (learned sparse-attention routers) from a pretrained transformers model.

    Use it through PEFT: `get_peft_model(model, FocusConfig(...))`, `PeftModel.from_pretrained(model, path)`, or
    transformers' `model.load_adapter(path)` (after `import focus_hf`).
    """

    prefix: str = "focus_"
    tuner_layer_cls = FocusLayer
    target_module_mapping: dict[str, list[str]] = {}

    def inject_adapter(
        self,
        model: nn.Module,
        adapter_name: str,
        autocast_adapter_dtype: bool = True,
        low_cpu_mem_usage: bool = False,
        state_dict: Optional[dict[str, torch.Tensor]] = None,
    ) -> None:
        # Everything that can be wrong with the adapter is checked here, before the first module is replaced.
        config = self.peft_config[adapter_name]
        config.validate()
        targets = find_attention_modules(model, config.target_modules)
        check_base_model(config, model, targets)
        folder = calling_adapter_folder()
        if folder is not None:
            validate_adapter_folder(folder, expected_router_shapes(config, targets))
        self._focus_targets = set(targets)
        self._focus_layer_indices = {name: getattr(m, "layer_idx", i) for i, (name, m) in enumerate(targets.items())}
        super().inject_adapter(
            model,
            adapter_name,
            autocast_adapter_dtype=autocast_adapter_dtype,
            low_cpu_mem_usage=low_cpu_mem_usage,
            state_dict=state_dict,
        )
        use_focus_attention(model)
        pin_routers(model)

    def _prepare_adapter_config(self, peft_config: FocusConfig, model_config: dict) -> FocusConfig:
        return peft_config

    def _check_target_module_exists(self, peft_config: FocusConfig, key: str) -> bool:
        return key in self._focus_targets

    def _create_and_replace(
        self,
        peft_config: FocusConfig,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        **kwargs,
    ) -> None:
        if isinstance(target, FocusLayer):
            target.update_layer(adapter_name, peft_config)
            return
        new_module = FocusLayer(target, adapter_name, peft_config, layer_index=self._focus_layer_indices[current_key])
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)

    def _replace_module(self, parent: nn.Module, child_name: str, new_module: nn.Module, child: nn.Module) -> None:
        # PEFT's version moves the new module to the device of the wrapped module's first weight, which is the meta
        # device for a layer accelerate offloaded; routers are created where the module computes and stay there.
        setattr(parent, child_name, new_module)

    def merge_and_unload(self, *args, **kwargs) -> nn.Module:
        raise NotImplementedError(
            "Focus routers change which tokens attend to each other; there is no weight to merge. "
            "Use `unload()` to get the base model back."
        )

    def _unload_and_optionally_merge(
        self, merge: bool = True, progressbar: bool = False, safe_merge: bool = False, adapter_names=None
    ):
        if merge:
            self.merge_and_unload()
        layers = [(name, module) for name, module in self.model.named_modules() if isinstance(module, FocusLayer)]
        configs = attention_configs(self.model)
        for name, layer in layers:
            parent_name, _, child_name = name.rpartition(".")
            setattr(self.model.get_submodule(parent_name), child_name, layer.base_layer)
        if layers:
            for config in configs:
                config._attn_implementation = layers[0][1].base_attn_implementation
        if hasattr(self.model, "peft_config"):
            del self.model.peft_config
        unpin_routers(self.model)
        return self.model
