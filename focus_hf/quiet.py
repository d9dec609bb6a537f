"""Output of other packages that a focus_hf user did not ask for and cannot act on, held back only around the call
that causes it (never by a filter that outlives the call).

* Optional packages that report, while they are imported, kernels they could not load: torchao (compiled kernels
  of other Python versions or GPU architectures), bitsandbytes (an optional CPU kernel from the `kernels` package)
  and torch's note on the enums torchao registers. transformers imports both packages whenever they are installed
  (the `quant` and `test` extras), so without this every `focus-hf` command and every script that imports peft
  starts with five lines about them. `import focus_hf` installs `OptionalImportHook`, which runs the import of these
  packages with exactly those records held back; other records, and these packages' later output, pass.
* Records that transformers logs inside a call focus_hf makes for the user and that say nothing about what the user
  asked for are held back around that call with `quiet_logs` (e.g. `focus_hf.fitting.trainer`).
* peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` each time it wraps a model
  (`PeftModel.__init__`): `quiet_peft_wrapping` holds that FutureWarning back around the wrapping of a Focus model
  (`focus_hf.tuner.patches` applies it to `get_peft_model` and `PeftModel.from_pretrained`).

Standard library only: `focus_hf/__init__.py` imports this module, and `import focus_hf` stays light.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

# peft 0.21 reads `model.is_gradient_checkpointing` whenever it wraps a model, a property that transformers 5
# deprecates in favour of `is_activation_checkpointing`.
_CHECKPOINTING_DEPRECATION = r"`is_gradient_checkpointing` is deprecated"

# logger name -> the messages it logs while its package is imported that say an optional kernel is missing.
IMPORT_NOISE: Mapping[str, tuple[str, ...]] = {
    "torchao": (r"Failed to load .*\.so\b",),  # kernels built for another Python version or a GPU architecture
    "torchao.kernel.intmm": (r"Warning: Detected no triton",),  # Triton is a GPU compiler
    "torch.utils._pytree": (r".* is an Enum subclass and is now natively supported by torch\.compile",),
    "bitsandbytes.backends.cpu.ops": (r"Failed to load CPU gemm_4bit_forward from kernels-community",),
}
# Top-level packages whose import runs with IMPORT_NOISE held back.
NOISY_PACKAGES = ("torchao", "bitsandbytes")


class _MessageFilter(logging.Filter):
    """Drops the records whose message matches one of `patterns` (from the start)."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self._patterns = [re.compile(pattern) for pattern in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(pattern.match(message) for pattern in self._patterns)


@contextlib.contextmanager
def quiet_logs(noise: Mapping[str, tuple[str, ...]]) -> Iterator[None]:
    """Hold back the log records of `noise` (logger name -> message patterns, matched from the start) inside the
    block.

    The filters sit on the loggers that emit the records, so they apply whichever handler would print them (the
    last-resort one, torch's own, or one the user configured); they are removed when the block ends.
    """
    filters = [(logging.getLogger(name), _MessageFilter(patterns)) for name, patterns in noise.items()]
    for logger, message_filter in filters:
        logger.addFilter(message_filter)
    try:
        yield
    finally:
        for logger, message_filter in filters:
            logger.removeFilter(message_filter)


@contextlib.contextmanager
def quiet_peft_wrapping() -> Iterator[None]:
    """Around peft's wrapping of a Focus model: hides transformers' FutureWarning that peft's own read of
    `is_gradient_checkpointing` raises. Other warnings pass through."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_CHECKPOINTING_DEPRECATION, category=FutureWarning)
        yield


class ImportHook(importlib.abc.MetaPathFinder):
    """Runs the module code of the packages `names` (with `submodules`, of every module inside them too) through
    `around(exec_module, module)`.

    A meta path finder placed first on `sys.meta_path`: for one of `names` it asks the other finders for the spec
    and hands back that spec with its loader's `exec_module` wrapped (a fresh loader per spec, so nothing else is
    changed); other names are left to the other finders.
    """

    def __init__(
        self,
        names: tuple[str, ...],
        around: Callable[[Callable[[Any], None], Any], None],
        *,
        submodules: bool = False,
    ) -> None:
        self.names = names
        self._around = around
        self._submodules = submodules
        self._searching = False

    def _covers(self, fullname: str) -> bool:
        package = fullname.partition(".")[0] if self._submodules else fullname
        return package in self.names

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if self._searching or not self._covers(fullname):
            return None
        self._searching = True
        try:
            # The other finders, as the import system would ask them (a submodule is looked up on its parent's
            # __path__, which is imported already).
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module
        around = self._around

        def exec_wrapped(module: Any) -> None:
            around(exec_module, module)

        spec.loader.exec_module = exec_wrapped
        return spec


def _import_quietly(exec_module: Callable[[Any], None], module: Any) -> None:
    with quiet_logs(IMPORT_NOISE):
        exec_module(module)


def optional_import_hook() -> ImportHook:
    """The hook that imports `NOISY_PACKAGES` with `IMPORT_NOISE` held back (`import focus_hf` installs it)."""
    # Submodules too: transformers imports some of torchao's lazily, after `import torchao` has finished.
    return ImportHook(NOISY_PACKAGES, _import_quietly, submodules=True)
