"""The errors of `focus_hf.hub`: one base class, `FocusHubError`, and one subclass per way a push or pull fails.

Each also derives from the builtin error callers would naturally catch (`ValueError` for bad input, `OSError` for
a bad download, `RuntimeError` for a failing Hub), so code that does not know `focus_hf` still handles them.
"""

from __future__ import annotations


class FocusHubError(Exception):
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
