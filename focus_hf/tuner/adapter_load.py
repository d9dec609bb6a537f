"""The adapter a PEFT or transformers loader is loading right now, carried in a context variable.

Neither library hands the adapter's location to the tuner before it injects the layers, yet the tuner checks the
weights before the first module is replaced (`focus_hf.tuner.model.FocusModel.inject_adapter`), and the loaders'
own reading steps must then put exactly the checked tensors into the model, from safetensors, never a pickle. So the
loaders are wrapped (`focus_hf.tuner.patches`) to run inside `loading(source, download_kwargs)`, which records the
source they were called with: a local folder, a Hub repo id (whose weights are fetched and verified by
`adapter_weights`, through `focus_hf.hub.loading.resolve_adapter_weights`) or a state dict. The tuner hands the
tensors it checked to the same record (`hand_over`), where the wrapped reading steps find them (`checked_tensors`).

A `contextvars.ContextVar` holds the record: every thread (and every asyncio task) sees its own, so threads that load
adapters at once never read each other's. Nested loaders (PEFT's `from_pretrained` calls its `load_adapter`) each
record their own source and share what was checked.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional


@dataclasses.dataclass
class _Checked:
    """What the tuner checked for the adapter being loaded, shared by nested loaders."""

    focus: bool = False  # a Focus adapter is being loaded
    tensors: Optional[dict] = None  # the checked tensors, set by the tuner before injection


@dataclasses.dataclass(frozen=True)
class AdapterLoad:
    """One loader call.

    Attributes:
        source: what the loader was asked to load: a local folder, a Hub repo id, a state dict, or None.
        download_kwargs: the loader's download arguments (revision, subfolder, cache_dir, token...).
        checked: what the tuner checked, shared with the loaders around this one.
    """

    source: Any
    download_kwargs: Mapping[str, Any]
    checked: _Checked


_CURRENT: contextvars.ContextVar[Optional[AdapterLoad]] = contextvars.ContextVar("focus_hf_adapter_load", default=None)


@contextlib.contextmanager
def loading(source: Any, download_kwargs: Optional[Mapping[str, Any]] = None, *, focus: bool = False) -> Iterator[None]:
    """Mark a loader call for `source`; the call's nested loader calls share what the outermost one checked.

    `focus`: the model already holds the Focus adapter being loaded (PEFT's `load_adapter` into an existing name)."""
    outer = _CURRENT.get()
    checked = outer.checked if outer is not None else _Checked()
    checked.focus = checked.focus or focus
    token = _CURRENT.set(AdapterLoad(source, dict(download_kwargs or {}), checked))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_load() -> Optional[AdapterLoad]:
    """The loader call under way in this context, or None."""
    return _CURRENT.get()


def hand_over(tensors: dict) -> None:
    """Record the tensors the tuner checked for the adapter being loaded (no-op outside a loader)."""
    load = _CURRENT.get()
    if load is not None:
        load.checked.focus, load.checked.tensors = True, tensors


def loading_focus_adapter() -> bool:
    """Whether a Focus adapter is being loaded in this context right now."""
    load = _CURRENT.get()
    return load is not None and load.checked.focus


def checked_tensors() -> Optional[dict]:
    """The tensors handed over for the Focus adapter being loaded, or None."""
    load = _CURRENT.get()
    return None if load is None else load.checked.tensors


def adapter_folder(load: AdapterLoad) -> Optional[Path]:
    """The folder of the adapter that `load` is loading (None for a state dict, or a source that is neither a folder
    nor a Hub id: the loader reports that one).

    A local folder is returned as is. For a Hub repo id, the same revision's `adapter_model.safetensors` is fetched
    through `huggingface_hub` with the loader's revision / subfolder / cache / token arguments, verified against the
    Hub's checksum and the safetensors format (`focus_hf.hub.loading.resolve_adapter_weights`), and its folder in the
    cache is returned; a bad download raises `AdapterFileError` here, before injection.
    """
    source = load.source
    if source is None or isinstance(source, dict):
        return None
    subfolder = load.download_kwargs.get("subfolder") or ""
    if os.path.isdir(os.path.join(os.fspath(source), subfolder)):
        return Path(os.fspath(source), subfolder)
    if not isinstance(source, str) or os.path.exists(source):
        return None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(source)
    except HFValidationError:
        return None  # neither a folder nor a Hub id: the loader reports it
    from focus_hf.hub.loading import resolve_adapter_weights  # only a Hub id needs the hub package

    return resolve_adapter_weights(source, **load.download_kwargs).parent
