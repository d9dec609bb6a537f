"""`FocusModel`: the PEFT tuner that injects Focus routers into a frozen transformers model."""

from __future__ import annotations

import contextlib
from typing import Optional

import regex
import torch
from peft.tuners.tuners_utils import BaseTuner
from torch import nn

from focus_hf.attention.function import ATTENTION_NAME
from focus_hf.errors import AdapterFileError, FocusMergeError, FocusRuntimeError
from focus_hf.files import validate_adapter_folder, validate_adapter_state_dict
from focus_hf.tuner.adapter_load import adapter_folder, current_load, hand_over
from focus_hf.tuner.config import FocusConfig, FocusConfigError, record_wrapped_model
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
    record_wrapped_model(config, model)


def check_adapter_dtype(targets: dict[str, nn.Module], autocast_adapter_dtype: bool) -> None:
    """Refuse `autocast_adapter_dtype=False` on a half-precision base: PEFT would keep the adapter in the base's
    dtype, but Focus routers always hold float32 (Sinkhorn routing sums many small probabilities)."""
    if autocast_adapter_dtype:
        return
    dtypes = {
        parameter.dtype
        for module in targets.values()
        for parameter in module.parameters()
        if parameter.dtype in (torch.float16, torch.bfloat16)
    }
    if dtypes:
        raise FocusConfigError(
            f"autocast_adapter_dtype=False asks for adapter weights in the base model's dtype "
            f"({', '.join(sorted(str(d) for d in dtypes))}), but Focus routers are always float32: Sinkhorn routing "
            "sums many small probabilities, which half precision would round away. Leave autocast_adapter_dtype "
            "at its default (True); the base model keeps its dtype."
        )


def saved_module_shapes(model: nn.Module, config: FocusConfig, targets: dict[str, nn.Module]) -> dict[str, tuple]:
    """Key (without `base_model.model.`) -> shape of every tensor PEFT saves for `config.modules_to_save`.

    Modules are matched as PEFT's `_set_trainable` matches them (the module name ends with an entry); a module PEFT
    wrapped already for another adapter is read through its original module. A routed attention module cannot be
    saved too (PEFT would wrap it twice): refused with `FocusConfigError`.
    """
    if not config.modules_to_save:
        return {}
    from peft.utils.other import ModulesToSaveWrapper

    for name in targets:
        clash = [m for m in config.modules_to_save if regex.match(rf"(^|.*\.){regex.escape(m)}($|\..*)", name)]
        if clash:
            raise FocusConfigError(
                f"FocusConfig.modules_to_save={config.modules_to_save!r} names the routed attention module {name!r} "
                f"(through {clash[0]!r}): a module cannot be both routed and saved. Save another module, or leave "
                "this layer out with target_modules / layers_to_transform."
            )
    shapes: dict[str, tuple] = {}
    for name, module in model.named_modules():
        if ".modules_to_save." in f".{name}." or ".original_module" in f".{name}":
            continue  # the inside of a wrapper made for an earlier adapter
        if not any(name.endswith(entry) for entry in config.modules_to_save):
            continue
        source = module.original_module if isinstance(module, ModulesToSaveWrapper) else module
        for parameter_name, parameter in source.named_parameters():
            shapes[f"{name}.{parameter_name}"] = tuple(parameter.shape)
    return shapes


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


MERGE_MESSAGE = (
    "A Focus adapter cannot be merged: it changes no weight of the model, it changes which keys each query attends "
    "to (a learned sparse attention pattern), so there is nothing to fold into the base weights. Keep the adapter "
    "loaded for sparse inference (model.eval(), then focus_hf.set_routing(model, 'hard')); use `unload()` or "
    "`disable_adapter()` to get the dense base model back."
)


def check_single_adapter(adapter_name) -> None:
    """Refuse more than one active Focus adapter at the call (routing runs one adapter at a time)."""
    if isinstance(adapter_name, (list, tuple)) and len(adapter_name) > 1:
        raise FocusRuntimeError(
            f"Focus routes with one adapter at a time; set_adapter({list(adapter_name)!r}) would activate "
            f"{len(adapter_name)}. Call set_adapter with a single name, e.g. set_adapter({adapter_name[0]!r}); "
            "the active adapter is unchanged."
        )


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
        # Everything that can be wrong with the adapter is checked here, before the first module is replaced; a
        # failure at any point leaves the model and its adapter registry as they were (`_roll_back`).
        existed = any(adapter_name in layer.focus_proj for layer in model.modules() if isinstance(layer, FocusLayer))
        try:
            config = self.peft_config[adapter_name]
            config.validate()
            targets = find_attention_modules(
                model, config.target_modules, config.layers_to_transform, config.layers_pattern
            )
            check_base_model(config, model, targets)
            expected = expected_router_shapes(config, targets)
            saved = saved_module_shapes(model, config, targets)
            load = current_load()  # the loader call under way, if any (`focus_hf.tuner.patches` wraps them)
            if load is None:
                checked = None
            elif isinstance(load.source, dict):  # transformers' load_adapter(adapter_state_dict=...)
                validate_adapter_state_dict(load.source, expected, saved)
                checked = load.source
            else:
                folder = adapter_folder(load)
                if folder is None:
                    raise AdapterFileError(
                        "Focus could not find the adapter weights this loader is about to read (neither a local "
                        "folder, a Hub repo id nor an adapter_state_dict), so it cannot check them; refusing to load "
                        "unchecked weights. Pass the adapter folder or Hub id to PeftModel.from_pretrained or "
                        "load_adapter."
                    )
                checked = validate_adapter_folder(folder, expected, saved)
            if checked is not None:
                # The loader will put exactly these tensors into the model, whatever file it picked.
                hand_over(checked)
            self._focus_targets = set(targets)
            self._focus_layer_indices = {
                name: getattr(m, "layer_idx", i) for i, (name, m) in enumerate(targets.items())
            }
            super().inject_adapter(
                model,
                adapter_name,
                autocast_adapter_dtype=autocast_adapter_dtype,
                low_cpu_mem_usage=low_cpu_mem_usage,
                state_dict=state_dict,
            )
        except BaseException:
            if not existed:
                self._roll_back(model, adapter_name)
            raise
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

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        # PEFT calls this right after injecting (get_peft_model, add_adapter), with the caller's
        # autocast_adapter_dtype, which the injection itself does not receive: a refusal takes the adapter out again.
        if not autocast_adapter_dtype:
            targets = {
                name: layer.base_layer
                for name, layer in self.model.named_modules()
                if isinstance(layer, FocusLayer) and adapter_name in layer.focus_proj
            }
            try:
                check_adapter_dtype(targets, autocast_adapter_dtype)
            except FocusConfigError:
                self._roll_back(self.model, adapter_name)
                if self.model.__dict__.get("peft_config") == {}:
                    del self.model.peft_config  # set by BaseTuner for this adapter alone
                raise
        super()._cast_adapter_dtype(adapter_name, autocast_adapter_dtype)

    def _replace_module(self, parent: nn.Module, child_name: str, new_module: nn.Module, child: nn.Module) -> None:
        # PEFT's version moves the new module to the device of the wrapped module's first weight, which is the meta
        # device for a layer accelerate offloaded; routers are created where the module computes and stay there.
        setattr(parent, child_name, new_module)

    def _roll_back(self, model: nn.Module, adapter_name: str) -> None:
        """Undo a failed injection of `adapter_name`: its parameters, the wrappers it created, its config entry
        (transformers' `load_adapter` registers it in the model's `peft_config` before injecting), the copies PEFT
        made for its `modules_to_save`, and, when no Focus layer is left, the attention implementation and router
        pinning that injection set."""
        from peft.utils.other import ModulesToSaveWrapper

        configs = attention_configs(model)
        base_attention = None
        for name, layer in list(model.named_modules()):
            if isinstance(layer, ModulesToSaveWrapper) and adapter_name in layer.modules_to_save:
                del layer.modules_to_save[adapter_name]
                if not layer.modules_to_save:
                    parent_name, _, child_name = name.rpartition(".")
                    setattr(model.get_submodule(parent_name), child_name, layer.original_module)
                continue
            if not isinstance(layer, FocusLayer):
                continue
            base_attention = layer.base_attn_implementation
            for attribute in FocusLayer.adapter_layer_names:
                parameters = getattr(layer, attribute)
                if adapter_name in parameters:
                    del parameters[adapter_name]
            layer.focus_settings.pop(adapter_name, None)
            if not layer.focus_proj:
                parent_name, _, child_name = name.rpartition(".")
                setattr(model.get_submodule(parent_name), child_name, layer.base_layer)
        if base_attention is not None and not any(isinstance(m, FocusLayer) for m in model.modules()):
            for config in configs:
                if config._attn_implementation == ATTENTION_NAME:
                    config._attn_implementation = base_attention
            unpin_routers(model)
        peft_config = self.__dict__.get("peft_config")
        if peft_config is None:
            peft_config = getattr(model, "peft_config", None)
        if isinstance(peft_config, dict):
            peft_config.pop(adapter_name, None)

    def set_adapter(self, adapter_name, inference_mode: bool = False) -> None:
        check_single_adapter(adapter_name)
        super().set_adapter(adapter_name, inference_mode=inference_mode)

    @contextlib.contextmanager
    def _enable_peft_forward_hooks(self, *args, **kwargs):
        if kwargs.get("adapter_names") is not None:
            raise FocusRuntimeError(
                "Focus does not support `adapter_names=[...]` in forward/generate (one adapter per sample): routing "
                "runs one adapter for the whole batch. Call `model.set_adapter(name)` and run each adapter's "
                "samples as their own batch."
            )
        yield

    def merge_adapter(self, *args, **kwargs) -> None:
        raise FocusMergeError(MERGE_MESSAGE)

    def _check_merge_allowed(self) -> None:
        raise FocusMergeError(MERGE_MESSAGE)

    def merge_and_unload(self, *args, **kwargs) -> nn.Module:
        raise FocusMergeError(MERGE_MESSAGE)

    def _unload_and_optionally_merge(
        self, merge: bool = True, progressbar: bool = False, safe_merge: bool = False, adapter_names=None
    ):
        if merge:
            self.merge_and_unload()
        layers = [module for module in self.model.modules() if isinstance(module, FocusLayer)]
        configs = attention_configs(self.model)
        # PEFT's own unloading puts back the wrapped attention modules and the modules_to_save originals, and drops
        # the model's peft_config.
        super()._unload_and_optionally_merge(merge=False, progressbar=progressbar, adapter_names=adapter_names)
        if layers:
            for config in configs:
                config._attn_implementation = layers[0].base_attn_implementation
        unpin_routers(self.model)
        return self.model
