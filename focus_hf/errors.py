"""Every error `focus_hf` raises: one base class, `FocusError`, and one subclass per way something fails.

Each also derives from the builtin error callers would naturally catch (`ValueError` for bad input, `OSError` for
a bad download, `RuntimeError` for a failing run or Hub, `ImportError` for a missing package), so code that does
not know `focus_hf` still handles them. This module imports nothing, so any module may import it.
"""

from __future__ import annotations


class FocusError(Exception):
    """Base class of every error raised by `focus_hf`."""


# --- adapter core ----------------------------------------------------------------------------------------------
class FocusConfigError(FocusError, ValueError):
    """A Focus adapter configuration is invalid or does not fit the model."""


class UnknownOptionError(FocusConfigError, TypeError):
    """`FocusConfig` got an option it does not take. Also a `TypeError`, as every PEFT config raises for an option
    it does not take, so that `except TypeError` (PEFT's own tests, users' code) works."""


class UnsupportedModelError(FocusError, ValueError):
    """The model's attention cannot be routed by Focus."""


class AdapterFileError(FocusError, ValueError):
    """An adapter folder or file is missing, corrupt, a pickle, or does not fit the model."""


class ConfigFormatError(FocusError, ValueError):
    """``adapter_config.json`` is not a Focus config; push and pull turn it into their own error type."""


class FocusRuntimeError(FocusError, RuntimeError):
    """Focus attention was asked to run in a situation it does not support."""


class UpstreamChangedError(FocusError, ImportError):
    """peft or transformers changed something a focus_hf patch relies on (`focus_hf.tuner.patches`): raised at
    import, naming the patch and the installed version, rather than running with a check left out."""


class FocusServingError(FocusError, RuntimeError):
    """A vLLM configuration Focus cannot serve exactly (`focus_hf.vllm`): refused at start-up, never run dense. Not a
    ValueError: vLLM checks its configuration in pydantic validators, which would bury a ValueError's message."""


class FocusMergeError(FocusError, NotImplementedError):
    """A Focus adapter cannot be merged into the base weights (it changes the attention pattern, not a weight)."""


class BackendUnavailableError(FocusError, RuntimeError):
    """The requested attention backend cannot run here (missing package or device)."""


class FileWriteError(FocusError, OSError):
    """A file could not be written (a full disk, no permission); the files that were there are left as they were."""


class CpuTargetError(FocusError, ValueError):
    """FOCUS_HF_CPU_TARGET names a target that the C compiler does not know or that this processor cannot run."""


class MissingModelPackageError(FocusError, ImportError):
    """Raised when an alias needs a package (or a file in it) that is not installed."""


# --- Hub -------------------------------------------------------------------------------------------------------
class FocusHubError(FocusError):
    """Base class of the errors raised by `focus_hf.hub`."""


class InvalidRepoIdError(FocusHubError, ValueError):
    """The repo id is not of the form ``namespace/name`` (or looks like a local path or URL)."""


class AdapterFolderError(FocusHubError, ValueError):
    """The local folder cannot be pushed: missing adapter files, pickles, base-model weights, bad config."""


class NotAFocusAdapterError(FocusHubError, ValueError):
    """The Hub repo is not a (safe) Focus adapter: no config, another ``peft_type``, or pickle files."""


class AdapterIntegrityError(FocusHubError, OSError):
    """A downloaded adapter file does not match the Hub's size / checksum, or is not valid safetensors."""


class HubPushError(FocusHubError, RuntimeError):
    """The Hub failed while pushing; the local folder is untouched and the push can be retried."""


__all__ = [
    "FocusError",
    "FocusConfigError",
    "UnknownOptionError",
    "UnsupportedModelError",
    "AdapterFileError",
    "ConfigFormatError",
    "FileWriteError",
    "FocusRuntimeError",
    "FocusMergeError",
    "BackendUnavailableError",
    "MissingModelPackageError",
    "FocusHubError",
    "InvalidRepoIdError",
    "AdapterFolderError",
    "NotAFocusAdapterError",
    "AdapterIntegrityError",
    "HubPushError",
]
