"""`FocusModel`: the PEFT tuner that injects Focus routers into a frozen transformers model."""

from __future__ import annotations

import contextlib
import functools
import inspect
from pathlib import Path
from typing import Any, Callable, Optional

import regex
import torch
from peft.tuners.tuners_utils import BaseTuner
from torch import nn

from focus_hf.attention.function import ATTENTION_NAME
from focus_hf.errors import AdapterFileError, FocusMergeError, FocusRuntimeError
from focus_hf.files import (
    CONFIG_NAME,
    PEFT_TYPE_NAME,
    README_NAME,
    WEIGHTS_NAME,
    give_mode_of,
    staged_folder,
    validate_adapter_folder,
    validate_adapter_state_dict,
)
from focus_hf.quiet import quiet_peft_wrapping
from focus_hf.tuner.checked_weights import hand_over
from focus_hf.tuner.config import FocusConfig, FocusConfigError, record_wrapped_model
from focus_hf.tuner.dispatch import pin_routers, unpin_routers
from focus_hf.tuner.layer import FocusLayer
from focus_hf.tuner.loader_source import calling_adapter_folder, calling_adapter_state_dict, calling_loader
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


PICKLE_SAVE_MESSAGE = (
    "save_pretrained(safe_serialization=False) would write adapter_model.bin, a pickle, which Focus refuses to load "
    "(pickles can run arbitrary code). Save with the default safe_serialization=True (adapter_model.safetensors)."
)


def install() -> None:
    """Wrap three `PeftModel` methods and transformers' `save_pretrained` for Focus models (idempotent; models with
    other adapter types, or none, are untouched).

    - `__init__` (reached by `get_peft_model` and `PeftModel.from_pretrained`): runs under
      `focus_hf.quiet.quiet_peft_wrapping`, which holds back the FutureWarning that peft 0.21 raises by reading
      transformers 5's deprecated `is_gradient_checkpointing`: a user who wraps a model cannot act on it.
    - `set_adapter([a, b])`: PEFT looks the name up in `peft_config` before it reaches the tuner, so a list fails
      there with "unhashable type: 'list'" (a tuple with "Adapter (...) not found"), never reaching
      `FocusModel.set_adapter`. A list or tuple is checked first: more than one name raises `FocusRuntimeError` with
      nothing changed, a single name is unwrapped.
    - `save_pretrained(..., safe_serialization=False)`: would write `adapter_model.bin`, a pickle Focus refuses to
      load. Refused with `AdapterFileError` before anything is written, also when the caller passes `state_dict=`
      (then PEFT never calls the model's `state_dict()`). It also passes `save_embedding_layers=False` unless the
      caller chose: PEFT's "auto" looks the base model up on the Hub on every save, for embeddings Focus never has.
      The saved safetensors file then gets the mode of the config beside it (safetensors 0.8 writes it 0600).
    - `PreTrainedModel.save_pretrained` of a model holding a Focus adapter (transformers' `load_adapter` path):
      the same mode fix.
    """
    from peft import PeftModel

    set_original = PeftModel.set_adapter
    if not getattr(set_original, "_focus_single_adapter", False):

        @functools.wraps(set_original)
        def set_adapter(self, adapter_name, *args, **kwargs):
            if isinstance(adapter_name, (list, tuple)) and _is_focus_model(self):
                check_single_adapter(adapter_name)
                if len(adapter_name) == 1:
                    adapter_name = adapter_name[0]
            return set_original(self, adapter_name, *args, **kwargs)

        set_adapter._focus_single_adapter = True
        PeftModel.set_adapter = set_adapter

    init_original = PeftModel.__init__
    if not getattr(init_original, "_focus_quiet", False):

        @functools.wraps(init_original)
        def __init__(self, model, peft_config, *args, **kwargs):
            if getattr(peft_config, "peft_type", None) != PEFT_TYPE_NAME:
                return init_original(self, model, peft_config, *args, **kwargs)
            with quiet_peft_wrapping():
                return init_original(self, model, peft_config, *args, **kwargs)

        __init__._focus_quiet = True
        PeftModel.__init__ = __init__

    save_original = PeftModel.save_pretrained
    if not getattr(save_original, "_focus_safetensors_only", False):
        signature = inspect.signature(save_original)

        @functools.wraps(save_original)
        def save_pretrained(self, *args, **kwargs):
            if not _is_focus_model(self):
                return save_original(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs).arguments
            if not bound.get("safe_serialization", True):
                raise AdapterFileError(PICKLE_SAVE_MESSAGE)
            if "save_embedding_layers" not in bound:
                # Focus never holds embedding weights; PEFT's "auto" would ask the Hub whether the base's
                # vocabulary changed (a network call on every save, failing offline).
                kwargs["save_embedding_layers"] = False
            result = _saved_whole(save_original, signature, self, args, kwargs)
            if bound.get("is_main_process", True):
                directory = Path(bound["save_directory"])
                names = bound.get("selected_adapters") or list(self.peft_config)
                # PEFT saves an adapter other than "default" into a subfolder of its name.
                _give_weights_the_config_mode([directory if name == "default" else directory / name for name in names])
            return result

        save_pretrained._focus_safetensors_only = True
        PeftModel.save_pretrained = save_pretrained

    from transformers import PreTrainedModel

    save_model_original = PreTrainedModel.save_pretrained
    if not getattr(save_model_original, "_focus_file_modes", False):
        save_model_signature = inspect.signature(save_model_original)

        @functools.wraps(save_model_original)
        def save_model(self, save_directory, *args, **kwargs):
            loaded = getattr(self, "_hf_peft_config_loaded", False)
            peft_configs = getattr(self, "peft_config", None) if loaded else None
            if not isinstance(peft_configs, dict) or not any(
                getattr(config, "peft_type", None) == PEFT_TYPE_NAME for config in peft_configs.values()
            ):
                return save_model_original(self, save_directory, *args, **kwargs)
            result = _saved_whole(save_model_original, save_model_signature, self, (save_directory, *args), kwargs)
            _give_weights_the_config_mode([Path(save_directory)])
            return result

        save_model._focus_file_modes = True
        PreTrainedModel.save_pretrained = save_model


def _saved_whole(save: Callable, signature: inspect.Signature, model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """`save(model, *args, **kwargs)` (a `save_pretrained`) run into a staging folder inside its `save_directory`,
    whose files then replace those there (`files.staged_folder`; the model card there is handed to it, which PEFT
    updates): a save that fails part way - a full disk - leaves the adapter saved there before as it was and raises
    `FileWriteError`."""
    bound = signature.bind(model, *args, **kwargs)
    directory = bound.arguments["save_directory"]
    if Path(directory).is_file():
        return save(model, *args, **kwargs)  # the save's own error names the mistake
    with staged_folder(directory, keep=(README_NAME,)) as staging:
        bound.arguments["save_directory"] = str(staging)
        return save(*bound.args, **bound.kwargs)


def _give_weights_the_config_mode(folders: list[Path]) -> None:
    """The safetensors file of each saved adapter folder gets the mode of the config written beside it
    (`focus_hf.files.give_mode_of`: safetensors 0.8 writes it 0600)."""
    for folder in folders:
        weights, config = folder / WEIGHTS_NAME, folder / CONFIG_NAME
        if weights.is_file() and config.is_file():
            give_mode_of(weights, config)


def _is_focus_model(peft_model: nn.Module) -> bool:
    return isinstance(getattr(peft_model, "base_model", None), FocusModel)


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
            adapter_state_dict = calling_adapter_state_dict()
            folder = None if adapter_state_dict is not None else calling_adapter_folder()
            if adapter_state_dict is not None:
                validate_adapter_state_dict(adapter_state_dict, expected, saved)
                checked = adapter_state_dict
            elif folder is not None:
                checked = validate_adapter_folder(folder, expected, saved)
            elif calling_loader():
                raise AdapterFileError(
                    "Focus could not find the adapter weights this loader is about to read (neither a local folder, "
                    "a Hub repo id nor an adapter_state_dict), so it cannot check them; refusing to load unchecked "
                    "weights. Pass the adapter folder or Hub id to PeftModel.from_pretrained or load_adapter."
                )
            else:
                checked = None
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
