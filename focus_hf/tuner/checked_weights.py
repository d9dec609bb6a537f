"""The tensors a loader puts into a model are the ones the Focus tuner checked, read from safetensors: never a pickle.

PEFT and transformers each pick the adapter file themselves after the tuner has injected the layers: transformers'
`load_adapter(use_safetensors=False)` reads `adapter_model.bin` when one lies beside the safetensors file, and PEFT
falls back to the `.bin` when no safetensors file is present. The tuner checks `adapter_model.safetensors` (or the
`adapter_state_dict`) before injection (`FocusModel.inject_adapter`) and hands the checked tensors over here; the
loaders' own reading steps are wrapped so that, while a Focus adapter loads, they return exactly those tensors:

- `PeftModel.from_pretrained` / `PeftModel.load_adapter` and transformers' `load_adapter` (which
  `AutoModel*.from_pretrained` on an adapter folder or Hub id calls) open a loading scope;
- inside it, PEFT's `safe_load_file` returns the handed-over tensors and its `torch_load` (the pickle reader) is
  refused for a Focus adapter, and transformers' `_load_pretrained_model` gets the handed-over tensors as its state
  dict instead of the files it resolved (`.bin` or not).

Adapters of other types pass through untouched: nothing is handed over for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from typing import Any, Iterator, Optional

from focus_hf.errors import AdapterFileError

logger = logging.getLogger(__name__)

PICKLE_LOAD_MESSAGE = (
    "Refusing to read a pickle (adapter_model.bin) for a Focus adapter: pickles can run arbitrary code, and Focus "
    "loads the checked adapter_model.safetensors only. Save the adapter with safe_serialization=True (the default)."
)


class _Scope(threading.local):
    depth = 0
    focus = False  # a Focus adapter is being loaded in this scope
    tensors: Optional[dict] = None  # the checked tensors, set by the tuner before injection


_scope = _Scope()


@contextlib.contextmanager
def loading_scope(focus: bool = False) -> Iterator[None]:
    """Mark a loader call; nested calls (PEFT's `from_pretrained` calls `load_adapter`) share the outermost scope.

    `focus`: the model already holds the Focus adapter being loaded (PEFT's `load_adapter` into an existing name)."""
    outermost = _scope.depth == 0
    if outermost:
        _scope.focus, _scope.tensors = False, None
    _scope.focus = _scope.focus or focus
    _scope.depth += 1
    try:
        yield
    finally:
        _scope.depth -= 1
        if outermost:
            _scope.focus, _scope.tensors = False, None


def hand_over(tensors: dict) -> None:
    """Record the tensors the tuner checked for the adapter being loaded (no-op outside a loader)."""
    if _scope.depth:
        _scope.focus, _scope.tensors = True, tensors


def loading_focus_adapter() -> bool:
    """Whether a Focus adapter is being loaded on this thread right now."""
    return bool(_scope.depth and _scope.focus)


def checked_tensors() -> Optional[dict]:
    """The tensors handed over for the Focus adapter being loaded, or None."""
    return _scope.tensors if _scope.depth else None


def _wrap(owner: Any, name: str, make: Any, marker: str = "_focus_checked_weights") -> None:
    original = owner.__dict__[name]
    function = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original
    if getattr(function, marker, False):
        return
    wrapped = functools.wraps(function)(make(function))
    setattr(wrapped, marker, True)
    if isinstance(original, staticmethod):
        wrapped = staticmethod(wrapped)
    elif isinstance(original, classmethod):
        wrapped = classmethod(wrapped)
    setattr(owner, name, wrapped)


def install() -> None:
    """Wrap the loaders and their reading steps (idempotent)."""
    import peft.utils.save_and_load as save_and_load
    from peft import PeftModel
    from transformers import PreTrainedModel
    from transformers.integrations.peft import PeftAdapterMixin

    def scoped_classmethod(function):
        def wrapper(cls, *args, **kwargs):
            with loading_scope():
                return function(cls, *args, **kwargs)

        return wrapper

    def peft_load_adapter(function):
        def wrapper(self, model_id, adapter_name, *args, **kwargs):
            from focus_hf.files import PEFT_TYPE_NAME

            existing = getattr(self, "peft_config", {}).get(adapter_name)
            with loading_scope(focus=getattr(existing, "peft_type", None) == PEFT_TYPE_NAME):
                return function(self, model_id, adapter_name, *args, **kwargs)

        return wrapper

    def scoped_method(function):
        def wrapper(self, *args, **kwargs):
            with loading_scope():
                return function(self, *args, **kwargs)

        return wrapper

    def safe_load_file(function):
        def wrapper(filename, device="cpu"):
            tensors = checked_tensors()
            if tensors is None:
                loaded = function(filename, device=device)
                if loading_focus_adapter():
                    # Reloading weights into an adapter that already exists: no injection, so nothing was checked.
                    from focus_hf.files import check_finite

                    check_finite(str(filename), loaded)
                return loaded
            return {key: value.to(device) for key, value in tensors.items()}

        return wrapper

    def torch_load(function):
        def wrapper(*args, **kwargs):
            if loading_focus_adapter():
                raise AdapterFileError(PICKLE_LOAD_MESSAGE)
            return function(*args, **kwargs)

        return wrapper

    def load_pretrained_model(function):
        def wrapper(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
            tensors = checked_tensors()
            if tensors is not None:
                if checkpoint_files and any(not str(f).endswith(".safetensors") for f in checkpoint_files):
                    logger.warning(
                        "use_safetensors=False does not apply to Focus adapters: the checked "
                        "adapter_model.safetensors is loaded, never adapter_model.bin."
                    )
                # None, not []: transformers' disk-offload indexing reads checkpoint_files[0] unless it is None.
                state_dict, checkpoint_files = tensors, None
                load_config = dataclasses.replace(load_config, sharded_metadata={})
            elif loading_focus_adapter():
                raise AdapterFileError(PICKLE_LOAD_MESSAGE)
            return function(model, state_dict, checkpoint_files, load_config, *args, **kwargs)

        return wrapper

    _wrap(PeftModel, "from_pretrained", scoped_classmethod)
    _wrap(PeftModel, "load_adapter", peft_load_adapter)
    _wrap(PeftAdapterMixin, "load_adapter", scoped_method)
    _wrap(PreTrainedModel, "_load_pretrained_model", load_pretrained_model)
    # PEFT's load_peft_weights reads through these module globals.
    for name, make in (("safe_load_file", safe_load_file), ("torch_load", torch_load)):
        function = getattr(save_and_load, name)
        if not getattr(function, "_focus_checked_weights", False):
            wrapped = functools.wraps(function)(make(function))
            wrapped._focus_checked_weights = True
            setattr(save_and_load, name, wrapped)
