"""Which adapter PEFT or transformers is loading right now, read from the loader's frame.

Neither library hands the adapter's location to the tuner before it injects the layers, yet the tuner must check the
weights before the first module is replaced (`focus_hf.tuner.model.FocusModel.inject_adapter`). The loader's frame
holds the source: a local folder, a Hub repo id (whose weights are fetched and verified here, through
`focus_hf.hub.loading.resolve_adapter_weights`), or a state dict handed to transformers' `load_adapter`.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Optional

# (module, function) of the loaders that inject an adapter -> how to read the adapter source from their frame.
_LOADERS = {
    ("peft.peft_model", "from_pretrained"): "peft",
    ("peft.peft_model", "load_adapter"): "peft",
    ("transformers.integrations.peft", "load_adapter"): "transformers",
}


def _loader_source(frame, kind: str) -> tuple[object, dict]:
    """(adapter source, download kwargs) held by a loader's frame."""
    local = frame.f_locals
    if kind == "peft":
        # PeftModel.from_pretrained / load_adapter(model_id, ..., **kwargs): kwargs hold revision, subfolder,
        # cache_dir, token... and go to hf_hub_download as they are.
        return local.get("model_id"), dict(local.get("kwargs") or {})
    # transformers' load_adapter(peft_model_id, ..., adapter_kwargs=..., **kwargs) merges everything into
    # load_config.download_kwargs and pins download_kwargs["revision"] to a commit before loading the config.
    if local.get("adapter_state_dict") is not None:
        return local["adapter_state_dict"], {}
    load_config = local.get("load_config")
    download_kwargs = dict(getattr(load_config, "download_kwargs", None) or {})
    if not download_kwargs:
        download_kwargs = {**(local.get("kwargs") or {}), **(local.get("adapter_kwargs") or {})}
    return local.get("peft_model_id"), download_kwargs


def calling_loader() -> bool:
    """Whether PEFT or transformers is loading an adapter right now (a loader's frame is on the stack)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if (frame.f_globals.get("__name__"), frame.f_code.co_name) in _LOADERS:
                return True
            frame = frame.f_back
        return False
    finally:
        del frame


def calling_adapter_state_dict() -> Optional[dict]:
    """The `adapter_state_dict` handed to transformers' `load_adapter` right now, if any (checked before injection)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if _LOADERS.get((frame.f_globals.get("__name__"), frame.f_code.co_name)) == "transformers":
                state_dict = frame.f_locals.get("adapter_state_dict")
                return state_dict if isinstance(state_dict, dict) else None
            frame = frame.f_back
        return None
    finally:
        del frame


def calling_adapter_folder() -> Optional[Path]:
    """The folder of the adapter that PEFT or transformers is loading right now, if any.

    Neither library hands the adapter's location to the tuner before it injects the layers; the loader's frame
    holds it. A local folder is returned as is. For a Hub repo id, the same revision's `adapter_model.safetensors`
    is fetched through `huggingface_hub` with the loader's revision / subfolder / cache / token arguments,
    verified against the Hub's checksum and the safetensors format (`focus_hf.hub.loading.resolve_adapter_weights`),
    and its folder in the cache is returned; a bad download raises `AdapterFileError` here, before injection.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            kind = _LOADERS.get((frame.f_globals.get("__name__"), frame.f_code.co_name))
            if kind is not None:
                source, download_kwargs = _loader_source(frame, kind)
                if isinstance(source, dict):
                    return None  # a state dict: `calling_adapter_state_dict`
                break
            frame = frame.f_back
        else:
            return None
    finally:
        del frame
    if source is None:
        return None
    subfolder = download_kwargs.get("subfolder") or ""
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

    return resolve_adapter_weights(source, **download_kwargs).parent
