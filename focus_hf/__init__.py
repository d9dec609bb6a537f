"""focus_hf: Focus learned sparse attention as a PEFT adapter for Hugging Face transformers.

Importing the package registers the FOCUS adapter type with PEFT and the `focus` attention function with
transformers, so `get_peft_model`, `PeftModel.from_pretrained` and `model.load_adapter` accept Focus adapters.

The registration needs peft (and so torch and transformers). To keep `import focus_hf` (and `focus-hf --help`)
light, it runs at once when peft or transformers is already imported, otherwise right after peft's own import
finishes (every path that loads an adapter imports peft), or on the first use of a public name below.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import TYPE_CHECKING, Any

from focus_hf.errors import (
    AdapterFileError,
    AdapterFolderError,
    AdapterIntegrityError,
    BackendUnavailableError,
    ConfigFormatError,
    FocusConfigError,
    FocusError,
    FocusHubError,
    FocusRuntimeError,
    HubPushError,
    InvalidRepoIdError,
    MissingModelPackageError,
    NotAFocusAdapterError,
    UnknownOptionError,
    UnsupportedModelError,
    UpstreamChangedError,
)
from focus_hf.quiet import ImportHook, optional_import_hook

if TYPE_CHECKING:
    from focus_hf.base_models import load_model_and_tokenizer
    from focus_hf.interpret.groups import group_assignments, record_routing
    from focus_hf.sizing import adapter_size
    from focus_hf.tuner.config import FocusConfig
    from focus_hf.tuner.controls import configure_adapter, focus_layers, set_routing
    from focus_hf.tuner.model import FocusModel

__version__ = "0.1.0"

# Public names that need torch / transformers / peft: imported on first use (PEP 562).
_LAZY = {
    "FocusConfig": "focus_hf.tuner.config",
    "FocusModel": "focus_hf.tuner.model",
    "set_routing": "focus_hf.tuner.controls",
    "configure_adapter": "focus_hf.tuner.controls",
    "focus_layers": "focus_hf.tuner.controls",
    "group_assignments": "focus_hf.interpret.groups",
    "record_routing": "focus_hf.interpret.groups",
    "load_model_and_tokenizer": "focus_hf.base_models",
    "adapter_size": "focus_hf.sizing",
}

__all__ = [
    "FocusConfig",
    "FocusModel",
    "set_routing",
    "configure_adapter",
    "focus_layers",
    "group_assignments",
    "record_routing",
    "load_model_and_tokenizer",
    "adapter_size",
    "FocusError",
    "FocusConfigError",
    "UnknownOptionError",
    "UnsupportedModelError",
    "AdapterFileError",
    "ConfigFormatError",
    "FocusRuntimeError",
    "BackendUnavailableError",
    "MissingModelPackageError",
    "FocusHubError",
    "InvalidRepoIdError",
    "AdapterFolderError",
    "NotAFocusAdapterError",
    "AdapterIntegrityError",
    "HubPushError",
    "UpstreamChangedError",
    "__version__",
]

_registered = False


def _ensure_registered() -> None:
    """Register Focus with PEFT and transformers once (`focus_hf.tuner.patches.apply`)."""
    global _registered
    if _registered:
        return
    _registered = True  # first: the imports below must not re-enter through the peft hook
    _remove_peft_hook()
    try:
        from focus_hf.tuner.patches import apply

        apply()
    except BaseException:
        _registered = False
        raise


def _register_after(exec_module: Any, module: Any) -> None:
    """Runs peft's own module code, then registers Focus with it (until registered)."""
    exec_module(module)
    _ensure_registered()


_PEFT_HOOK = ImportHook(("peft",), _register_after)


def _remove_peft_hook() -> None:
    if _PEFT_HOOK in sys.meta_path:
        sys.meta_path.remove(_PEFT_HOOK)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'focus_hf' has no attribute {name!r}")
    _ensure_registered()
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# Modules that moved, old import path -> new one. `import focus_hf.distill` and `from focus_hf.distill import ...`
# (as earlier READMEs and scripts wrote them) still work: they give the module at its new path, with a
# DeprecationWarning that names it.
MOVED_MODULES = {
    "focus_hf.calibration": "focus_hf.fitting.capture",
    "focus_hf.distill": "focus_hf.fitting.distill",
    "focus_hf.layerwise": "focus_hf.fitting.layerwise",
    "focus_hf.full_attention": "focus_hf.fitting.dense_heads",
    "focus_hf.retrieval": "focus_hf.fitting.retrieval_heads",
    "focus_hf.audit": "focus_hf.fitting.recall_audit",
    "focus_hf.training": "focus_hf.fitting.trainer",
    "focus_hf.metadata": "focus_hf.fitting.metadata",
    "focus_hf.parallel": "focus_hf.fitting.parallel",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a module of `MOVED_MODULES` under its old name: the very module object of the new path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        new_name = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new_name}; import it from there (the old path will be removed).",
            DeprecationWarning,
            stacklevel=2,  # the importing line: warnings skips importlib's own frames
        )
        return importlib.import_module(new_name)

    def exec_module(self, module: Any) -> None:
        """Nothing to run: `create_module` returned the module, already imported under its new name."""


sys.meta_path.insert(0, _MovedModuleFinder())
# torchao and bitsandbytes (optional, imported by transformers when installed) report kernels they cannot load.
sys.meta_path.insert(0, optional_import_hook())

if "peft" in sys.modules or "transformers" in sys.modules:
    _ensure_registered()
else:
    sys.meta_path.insert(0, _PEFT_HOOK)
