"""What a Focus adapter repo may hold: the files that are pushed and pulled, and those that are refused.

Shared by push (checks the local folder) and pull (checks the repo's file list): the allow-list of file patterns,
pickle and base-model weight detection, and the ``adapter_config.json`` check (``peft_type`` FOCUS).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub.utils import filter_repo_objects

from ..adapter_files import CONFIG_NAME as ADAPTER_CONFIG_NAME
from ..adapter_files import PICKLE_SUFFIXES
from ..adapter_files import WEIGHTS_NAME as ADAPTER_WEIGHTS_NAME

README_NAME = "README.md"
FOCUS_PEFT_TYPE = "FOCUS"
# Files pushed and pulled (fnmatch patterns on top-level names, as `huggingface_hub` `allow_patterns`); the
# interpretability files of `focus-hf inspect` / `focus-hf card` (interpretability.json, group_balance.png, an
# HTML page) are among them.
ADAPTER_FILE_PATTERNS: tuple[str, ...] = (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    README_NAME,
    "*.json",
    "*.png",
    "*.html",
)
# Full-model weight formats; any *.safetensors other than the adapter's is treated as base-model weights.
_BASE_WEIGHT_SUFFIXES: tuple[str, ...] = (".safetensors", ".gguf", ".h5", ".msgpack", ".onnx", ".tflite")
_BASE_WEIGHT_INDEX_SUFFIXES: tuple[str, ...] = (".safetensors.index.json", ".bin.index.json")


def is_pickle(name: str) -> bool:
    """Whether a file name has a pickle suffix (``.bin``, ``.pt``, ``.pkl``...): such files can run code on load."""
    return name.lower().endswith(PICKLE_SUFFIXES)


def is_base_weight(name: str) -> bool:
    """Whether a file name is a model weight file or shard index other than the adapter's own weights."""
    lowered = name.lower()
    if lowered == ADAPTER_WEIGHTS_NAME:
        return False
    return lowered.endswith(_BASE_WEIGHT_SUFFIXES) or lowered.endswith(_BASE_WEIGHT_INDEX_SUFFIXES)


def matches_adapter_patterns(name: str) -> bool:
    """Whether a top-level file name is one of `ADAPTER_FILE_PATTERNS` (so it is pushed and pulled)."""
    return bool(list(filter_repo_objects([name], allow_patterns=list(ADAPTER_FILE_PATTERNS))))


class ConfigFormatError(Exception):
    """``adapter_config.json`` is not a Focus config; push and pull turn it into their own error type."""


def read_focus_config(path: Path) -> dict[str, Any]:
    """Parse an adapter_config.json; raise `ConfigFormatError` unless it is a JSON object with peft_type FOCUS."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ConfigFormatError(f"{ADAPTER_CONFIG_NAME} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ConfigFormatError(f"{ADAPTER_CONFIG_NAME} is not a JSON object")
    peft_type = config.get("peft_type")
    if peft_type != FOCUS_PEFT_TYPE:
        raise ConfigFormatError(
            f"{ADAPTER_CONFIG_NAME} has peft_type {peft_type!r}, expected {FOCUS_PEFT_TYPE!r} (not a Focus adapter)"
        )
    return config
