"""Focus on bases that accelerate dispatched (`device_map="auto"`: layers spread over devices, CPU and disk).

accelerate keeps an offloaded module's weights on the meta device and loads them in a hook around the module's
`forward`. Routers cannot live that way: a `FocusLayer` reads its `focus_proj` / `focus_centroids` tensors, it
never calls them, so no hook would ever load them. Routers are tiny, so they always hold real values on the device
where the module they wrap computes (its hook's execution device; CPU when the model runs on CPU):

* `focus_hf.tuner.devices.execution_device` picks that device when a router is created;
* `pin_routers` records the routers in the model's `hf_device_map`, so that transformers' `load_adapter` loads
  their values there instead of sending them to disk with the layer around them;
* `PeftModel.load_adapter` (the path of `PeftModel.from_pretrained`) removes a dispatched base's hooks and
  re-dispatches it with an offload index written for LoRA (it assumes the adapter wraps a leaf module) and with a
  device map recomputed from the memory it finds, not the map the base was loaded with. For Focus adapters
  `load_keeping_dispatch` replaces that step (`focus_hf.tuner.patches` wraps `PeftModel.load_adapter` with it): the
  base is dispatched again with its own device map and offload index (names moved under the Focus wrappers), and the
  routers are kept out of accelerate's reach.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from focus_hf.tuner.devices import execution_device
from focus_hf.tuner.layer import FocusLayer

# The ParameterDicts of a FocusLayer that hold router tensors.
ROUTER_DICTS = FocusLayer.adapter_layer_names
_PEFT_PREFIX = "base_model.model"


def _device_map_value(device: torch.device) -> Any:
    """A torch device as a `device_map` value (accelerate writes GPU indices as ints)."""
    if device.type == "cuda":
        return device.index or 0
    return str(device)


def _focus_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules() if isinstance(module, FocusLayer)}


def pin_routers(model: nn.Module) -> None:
    """Record where each router lives in `model.hf_device_map` (a dispatched model only).

    transformers' `load_adapter` loads each tensor to the device its name maps to; without these entries a router
    inside a disk-offloaded layer would be written to the offload folder and left on the meta device.
    """
    device_map = getattr(model, "hf_device_map", None)
    if not isinstance(device_map, dict):
        return
    for name, layer in _focus_layers(model).items():
        value = _device_map_value(execution_device(layer.base_layer))
        for dict_name in ROUTER_DICTS:
            if len(getattr(layer, dict_name, ())):
                device_map[f"{name}.{dict_name}" if name else dict_name] = value


def unpin_routers(model: nn.Module) -> None:
    """Remove the router entries `pin_routers` added (after `unload()`)."""
    device_map = getattr(model, "hf_device_map", None)
    if isinstance(device_map, dict):
        for key in [key for key in device_map if key.rsplit(".", 1)[-1] in ROUTER_DICTS]:
            del device_map[key]


def is_offloaded(device_map: Optional[dict]) -> bool:
    return isinstance(device_map, dict) and bool({"cpu", "disk"} & set(map(str, device_map.values())))


@contextlib.contextmanager
def _routers_detached(model: nn.Module) -> Iterator[None]:
    """Take every router ParameterDict out of the module tree (so that accelerate neither offloads nor hooks it)."""
    detached = []
    for layer in _focus_layers(model).values():
        for dict_name in ROUTER_DICTS:
            if dict_name in layer._modules:
                detached.append((layer, dict_name, layer._modules.pop(dict_name)))
    try:
        yield
    finally:
        for layer, dict_name, parameters in detached:
            layer._modules[dict_name] = parameters


def _renamer(peft_model: nn.Module):
    """Maps a name of the base model (module or tensor) to its name inside `peft_model` (Focus wrappers included)."""
    wrapped = sorted(
        (name[len(_PEFT_PREFIX) + 1 :] for name in _focus_layers(peft_model) if name.startswith(_PEFT_PREFIX + ".")),
        key=len,
        reverse=True,
    )

    def rename(name: str) -> str:
        for layer in wrapped:
            if name.startswith(layer + "."):
                name = f"{layer}.base_layer.{name[len(layer) + 1 :]}"
                break
        return f"{_PEFT_PREFIX}.{name}" if name else _PEFT_PREFIX

    return rename


def place_routers(model: nn.Module) -> None:
    """Move every router to the execution device of the module it wraps (after the base has been dispatched)."""
    for layer in _focus_layers(model).values():
        device = execution_device(layer.base_layer)
        for dict_name in ROUTER_DICTS:
            for parameter in getattr(layer, dict_name, {}).values():
                if parameter.device != device:
                    parameter.data = parameter.data.to(device)


def redispatch(
    peft_model: nn.Module,
    device_map: dict,
    offload_index: Optional[dict] = None,
    offload_dir: Optional[str] = None,
) -> None:
    """Dispatch the base model inside `peft_model` again on `device_map` (the one it was loaded with), routers apart."""
    from accelerate import dispatch_model
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    rename = _renamer(peft_model)
    peft_map = {
        rename(name): device for name, device in device_map.items() if name.rsplit(".", 1)[-1] not in ROUTER_DICTS
    }
    index = None
    if offload_index:
        index = {
            rename(name): {**entry, "weight_name": entry.get("weight_name", name)}
            for name, entry in offload_index.items()
        }
    with _routers_detached(peft_model):
        dispatch_model(peft_model, device_map=peft_map, offload_dir=offload_dir, offload_index=index)
    # As PEFT does after its own re-dispatch: outputs come back on the inputs' device.
    add_hook_to_module(peft_model.get_base_model(), AlignDevicesHook(io_same_device=True))
    place_routers(peft_model)


def load_keeping_dispatch(
    load_adapter: Callable, peft_model: nn.Module, model_id: Any, adapter_name: str, *args: Any, **kwargs: Any
) -> Any:
    """`load_adapter(peft_model, model_id, adapter_name, ...)` (PEFT's own) of a Focus adapter on a base accelerate
    dispatched with CPU or disk offload, the base then dispatched again on its own device map (`redispatch`) rather
    than on the one PEFT would recompute, and the routers pinned where they compute (`pin_routers`)."""
    base = peft_model.get_base_model()
    device_map = base.hf_device_map
    # PEFT re-dispatches when it sees `hf_device_map`; hide it and re-dispatch on the base's own map instead.
    del base.hf_device_map
    try:
        result = load_adapter(peft_model, model_id, adapter_name, *args, **kwargs)
    finally:
        base.hf_device_map = device_map
    if not any(hasattr(module, "_hf_hook") for module in base.modules()):
        # `PeftModel.from_pretrained` removed the base's hooks: put them back.
        redispatch(
            peft_model,
            kwargs.get("device_map") if isinstance(kwargs.get("device_map"), dict) else device_map,
            offload_index=kwargs.get("offload_index"),
            offload_dir=kwargs.get("offload_folder") or kwargs.get("offload_dir"),
        )
    pin_routers(base)
    return result
