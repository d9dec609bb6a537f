"""The check run when transformers or PEFT load a Focus adapter straight from the Hub (`resolve_adapter_weights`).

``model.load_adapter("org/name")`` and ``PeftModel.from_pretrained(base, "org/name")`` need none of the push /
pull functions; before the Focus tuner injects such an adapter it runs `resolve_adapter_weights` with the loader's
own revision / cache / token arguments, so a truncated or tampered ``adapter_model.safetensors`` is refused with
the model left untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

from focus_hf.files import WEIGHTS_NAME, AdapterFileError, read_safetensors_header
from focus_hf.hub.integrity import cached_blob_mismatch, evict_cached_file

# Loader keyword arguments that select or fetch the file (what PEFT and transformers hand to hf_hub_download).
_HF_HUB_DOWNLOAD_KWARGS = ("subfolder", "repo_type", "revision", "cache_dir", "force_download", "etag_timeout",
                           "token", "local_files_only", "headers", "endpoint")  # fmt: skip


def resolve_adapter_weights(repo_id: str, **download_kwargs: Any) -> Path:
    """Download (or find in the cache) a Hub adapter's ``adapter_model.safetensors`` and verify it.

    This is what the Focus tuner runs before injecting an adapter loaded from the Hub by
    ``PeftModel.from_pretrained(model, repo_id, ...)``, ``PeftModel.load_adapter`` or transformers'
    ``model.load_adapter(repo_id, ...)``: the same revision / subfolder / cache / token arguments the loader got
    are used, so the file checked is the file the loader then reads (from the same cache entry).

    Checks: the repo has an ``adapter_model.safetensors`` (pickle-only adapters are refused), the downloaded
    bytes match the checksum the Hub announced (see `focus_hf.hub.integrity.cached_blob_mismatch`), and the file is
    well-formed
    safetensors (`focus_hf.files.read_safetensors_header`). A corrupt file is evicted from the cache.

    Args:
        repo_id (`str`): Hub repo id (any id ``huggingface_hub`` accepts).
        **download_kwargs: loader keyword arguments; those of ``hf_hub_download`` (``revision``, ``subfolder``,
            ``cache_dir``, ``token``, ``local_files_only``...) are used, ``use_auth_token`` is read as ``token``,
            the rest are ignored.

    Returns:
        `pathlib.Path`: the verified file in the cache.

    Raises:
        [`focus_hf.files.AdapterFileError`] (a `ValueError`): no safetensors weights, or a corrupt,
            truncated or tampered download.
        huggingface_hub.errors: `RepositoryNotFoundError`, `RevisionNotFoundError`, `LocalEntryNotFoundError`...
            as raised by ``hf_hub_download``.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    kwargs = {k: v for k, v in download_kwargs.items() if k in _HF_HUB_DOWNLOAD_KWARGS and v is not None}
    if kwargs.get("token") is None and download_kwargs.get("use_auth_token") is not None:
        kwargs["token"] = download_kwargs["use_auth_token"]
    if not kwargs.get("subfolder"):
        kwargs.pop("subfolder", None)
    label = f"{repo_id}@{kwargs.get('revision') or constants.DEFAULT_REVISION}"
    if kwargs.get("subfolder"):
        label += f" (subfolder {kwargs['subfolder']!r})"
    try:
        path = Path(hf_hub_download(repo_id, WEIGHTS_NAME, **kwargs))
    except LocalEntryNotFoundError:
        raise
    except EntryNotFoundError:
        raise AdapterFileError(
            f"The Hub adapter {label} has no {WEIGHTS_NAME}. Focus loads safetensors only and refuses "
            "pickle files (adapter_model.bin), which can run arbitrary code."
        ) from None
    except OSError as error:
        if isinstance(error, HfHubHTTPError) or error.errno is not None:
            raise
        # huggingface_hub raises a bare OSError("Consistency check failed ...") on a short download.
        raise AdapterFileError(f"Download of {WEIGHTS_NAME} from {label} is incomplete or corrupt: {error}") from error

    problem = cached_blob_mismatch(path)
    if problem is None:
        try:
            read_safetensors_header(path)
        except AdapterFileError as error:
            problem = str(error)
    if problem is not None:
        evict_cached_file(path)
        raise AdapterFileError(
            f"{WEIGHTS_NAME} of the Hub adapter {label} is corrupt, truncated or tampered with: {problem}. "
            "The model was not modified and the file was removed from the cache; retry the download."
        )
    return path
