"""Checks on adapter folders before any of their weights touch a model.

PEFT falls back to `adapter_model.bin` (a pickle) when no safetensors file is present, and transformers injects
the adapter layers before it reads the weights, so a corrupt or mismatching file would leave a half-modified model.
Focus adapters are a few hundred kilobytes, so reading the safetensors header up front costs nothing.
"""

from __future__ import annotations

import inspect
import json
import os
import struct
from pathlib import Path
from typing import Optional

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
ROUTER_LEAVES = ("focus_proj", "focus_centroids")
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class AdapterFileError(ValueError):
    """An adapter folder or file is missing, corrupt, a pickle, or does not fit the model."""


def read_safetensors_header(path: os.PathLike | str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Parse a safetensors header and check the file holds exactly the bytes it declares.

    Returns:
        tensor name -> (dtype, shape).

    Raises:
        AdapterFileError: the file is truncated, padded, or its header is not valid safetensors.
    """
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise AdapterFileError(f"{path} is not a safetensors file: {size} bytes, shorter than its 8-byte header length.")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise AdapterFileError(f"{path} is corrupt or truncated: header claims {header_len} bytes, file has {size}.")
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise AdapterFileError(f"{path} is corrupt: its safetensors header is not valid JSON ({error}).") from None
    if not isinstance(header, dict):
        raise AdapterFileError(f"{path} is corrupt: its safetensors header is not a JSON object.")
    tensors = {}
    data_end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise AdapterFileError(f"{path} is corrupt: bad header entry for tensor {name!r}.") from None
        tensors[name] = (dtype, shape)
        data_end = max(data_end, int(end))
    expected = 8 + header_len + data_end
    if size != expected:
        raise AdapterFileError(
            f"{path} is corrupt or truncated: its header describes {expected} bytes, the file has {size}. "
            "Download or save the adapter again."
        )
    return tensors


def router_module_name(key: str) -> tuple[str, str]:
    """Split a saved key such as `base_model.model.model.layers.0.self_attn.focus_proj` into (module, leaf)."""
    module, _, leaf = key.rpartition(".")
    return module.removeprefix("base_model.model."), leaf


def validate_adapter_folder(folder: os.PathLike | str, expected: dict[str, dict[str, tuple[int, ...]]]) -> None:
    """Refuse a folder whose weights are missing, pickled, corrupt, or shaped for another model.

    Args:
        folder: the adapter folder.
        expected: module name -> {"focus_proj": shape, "focus_centroids": shape} for the model being adapted.
    """
    folder = Path(folder)
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES) if folder.is_dir() else []
        if pickles:
            raise AdapterFileError(
                f"{folder} holds {pickles} but no {WEIGHTS_NAME}. Focus loads safetensors only and refuses pickle "
                "files, which can run arbitrary code. Convert it where you trust it: "
                "`safetensors.torch.save_file(torch.load(path, weights_only=True), 'adapter_model.safetensors')`."
            )
        raise AdapterFileError(f"Missing {WEIGHTS_NAME} in {folder}: the adapter folder is incomplete.")
    tensors = read_safetensors_header(weights)
    found: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, (_, shape) in tensors.items():
        module, leaf = router_module_name(key)
        if leaf not in ROUTER_LEAVES:
            raise AdapterFileError(f"{weights} holds {key!r}, which is not a Focus router tensor; refusing to load it.")
        found.setdefault(module, {})[leaf] = shape
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise AdapterFileError(
            f"{weights} routes {len(found)} attention layers, this model has {len(expected)} routable ones"
            f"{'; missing: ' + str(missing[:3]) if missing else ''}{'; unknown: ' + str(unexpected[:3]) if unexpected else ''}. "
            "The adapter was made for another base model."
        )
    for module, shapes in expected.items():
        for leaf, shape in shapes.items():
            got = found[module].get(leaf)
            if got != shape:
                raise AdapterFileError(
                    f"{weights}: {module}.{leaf} has shape {list(got) if got else None}, this model expects "
                    f"{list(shape)}. The adapter was made for another base model or another FocusConfig."
                )


_LOADERS = {("peft.peft_model", "from_pretrained"): "model_id", ("peft.peft_model", "load_adapter"): "model_id",
            ("transformers.integrations.peft", "load_adapter"): "peft_model_id"}


def calling_adapter_folder() -> Optional[Path]:
    """The local adapter folder that PEFT or transformers is loading right now, if any.

    Neither library hands the path to the tuner before it injects the layers; the loader's frame holds it.
    """
    frame = inspect.currentframe()
    while frame is not None:
        argument = _LOADERS.get((frame.f_globals.get("__name__"), frame.f_code.co_name))
        if argument is not None:
            source = frame.f_locals.get(argument)
            subfolder = (frame.f_locals.get("kwargs") or {}).get("subfolder") or ""
            if source is not None and os.path.isdir(os.path.join(os.fspath(source), subfolder)):
                return Path(os.fspath(source), subfolder)
            return None
        frame = frame.f_back
    return None
