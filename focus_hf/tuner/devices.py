"""Where a module computes, on a plain or an accelerate-dispatched model (`device_map="auto"`).

accelerate keeps an offloaded module's weights on the meta device and moves the inputs to its hook's execution
device, so a weight's device does not say where the module runs. Routers are created on that device
(`focus_hf.tuner.layer`), and the calibration passes send their inputs there (`focus_hf.fitting.capture`).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn


def _hook_devices(module: nn.Module) -> Iterator[Any]:
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return
    for single in getattr(hook, "hooks", None) or [hook]:
        device = getattr(single, "execution_device", None)
        if device is not None:
            yield device


def execution_device(module: nn.Module) -> torch.device:
    """The device `module` computes on: its (or a submodule's) accelerate hook's execution device, else the device
    of its first weight that is not on the meta device, else CPU (a model built on the meta device)."""
    for submodule in module.modules():
        for device in _hook_devices(submodule):
            return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")
