"""Registers the Focus adapter type with PEFT as soon as peft is imported, in every interpreter where focus_hf is
installed, so that the code a Hugging Face Hub model page shows for a Focus adapter runs as it is::

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_model = AutoModelForCausalLM.from_pretrained("org/base-model")
    model = PeftModel.from_pretrained(base_model, "org/focus-adapter")

PEFT has no plugin discovery, and without the registration PEFT fails on a Focus adapter with a bare
``KeyError: 'FOCUS'``. The installed package ships ``focus_hf.pth`` (processed by Python's ``site`` module at
interpreter start), whose one line calls `install`: it places a finder on ``sys.meta_path`` that waits for
``import peft`` and, once peft's own code has run, imports focus_hf, which registers itself. Nothing else is imported
at start-up (this module uses the standard library only), and a program that never imports peft never loads focus_hf.

Set ``FOCUS_HF_AUTOLOAD=0`` to turn it off; ``import focus_hf`` then registers Focus as before.
"""

from __future__ import annotations

# The standard library's lightest modules only (os and sys are loaded at start-up anyway): every interpreter pays
# for this import. importlib.util and warnings are imported when peft is.
import os
import sys

ENV_VAR = "FOCUS_HF_AUTOLOAD"
_PACKAGE = "peft"


class PeftImportFinder:
    """A meta path finder (the protocol of `importlib.abc.MetaPathFinder`) for ``peft`` only: it asks the other
    finders for peft's spec and hands it back with the loader's ``exec_module`` wrapped, so that focus_hf is imported
    right after peft's module code has run."""

    def __init__(self) -> None:
        self._searching = False

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname != _PACKAGE or self._searching or "focus_hf" in sys.modules:
            return None  # an imported focus_hf registers itself when peft is imported (its own hook)
        import importlib.util

        self._searching = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: object) -> None:
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


def _register() -> None:
    uninstall()
    try:
        import focus_hf  # noqa: F401  (peft is imported: focus_hf registers Focus with it at once)
    except Exception as error:  # a broken focus_hf must not break peft
        import warnings

        warnings.warn(
            f"focus_hf is installed but could not register the Focus adapter type with peft ({type(error).__name__}: "
            f"{error}); `import focus_hf` shows the full error. Set {ENV_VAR}=0 to stop this attempt.",
            RuntimeWarning,
            stacklevel=2,
        )


def enabled() -> bool:
    """Whether the registration at ``import peft`` is on (``FOCUS_HF_AUTOLOAD`` is not ``0``)."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def install() -> None:
    """Place the finder first on ``sys.meta_path`` (once), unless peft is imported already or it is turned off."""
    if not enabled() or _PACKAGE in sys.modules:
        return
    if not any(isinstance(finder, PeftImportFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, PeftImportFinder())


def uninstall() -> None:
    """Remove the finder from ``sys.meta_path``."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, PeftImportFinder)]
