"""The check run when transformers or PEFT load a Focus adapter straight from the Hub (`resolve_adapter_weights`).

``model.load_adapter("org/name")`` and ``PeftModel.from_pretrained(base, "org/name")`` need none of the push /
pull functions; before the Focus tuner injects such an adapter it runs `resolve_adapter_weights` with the loader's
own revision / cache / token arguments, so a truncated or tampered ``adapter_config.json`` or
``adapter_model.safetensors`` is refused with the model left untouched.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

from focus_hf.files import CONFIG_NAME, WEIGHTS_NAME, AdapterFileError, read_safetensors_header
from focus_hf.hub.integrity import evict_cached_file, snapshot_commit, transport_errors, verify_snapshot

logger = logging.getLogger(__name__)

# Loader keyword arguments that select or fetch the file (what PEFT and transformers hand to hf_hub_download).
_HF_HUB_DOWNLOAD_KWARGS = ("subfolder", "repo_type", "revision", "cache_dir", "force_download", "etag_timeout",
                           "token", "local_files_only", "headers", "endpoint")  # fmt: skip


def _download(repo_id: str, filename: str, label: str, kwargs: dict[str, Any]) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, filename, **kwargs))
    except LocalEntryNotFoundError:
        raise
    except EntryNotFoundError:
        if filename != WEIGHTS_NAME:
            raise
        raise AdapterFileError(
            f"The Hub adapter {label} has no {WEIGHTS_NAME}. Focus loads safetensors only and refuses "
            "pickle files (adapter_model.bin), which can run arbitrary code."
        ) from None
    except transport_errors() as error:
        if isinstance(error, HfHubHTTPError) or (isinstance(error, OSError) and error.errno is not None):
            raise
        # A connection cut mid-download (after huggingface_hub's own retries), or the bare OSError("Consistency check
        # failed ...") huggingface_hub raises on a short download: nothing was kept where a load would read it.
        raise AdapterFileError(
            f"Download of {filename} from {label} is incomplete or corrupt ({type(error).__name__}: {error}). The "
            "model was not modified; retry to complete the download."
        ) from error


def resolve_adapter_weights(repo_id: str, **download_kwargs: Any) -> Path:
    """Download (or find in the cache) a Hub adapter's ``adapter_config.json`` and ``adapter_model.safetensors`` and
    verify both.

    This is what the Focus tuner runs before injecting an adapter loaded from the Hub by
    ``PeftModel.from_pretrained(model, repo_id, ...)``, ``PeftModel.load_adapter`` or transformers'
    ``model.load_adapter(repo_id, ...)``: the same revision / subfolder / cache / token arguments the loader got
    are used, so the files checked are the files the loader reads (from the same cache entry).

    Checks: the repo has an ``adapter_model.safetensors`` (pickle-only adapters are refused); both files are the
    bytes the Hub lists for the commit they were downloaded from (`focus_hf.hub.integrity.verify_snapshot`: the Hub's
    listing online, the checksum each cached file was filed under offline; a cache that cannot be checked offline,
    one without symbolic links, is loaded with a warning that says so); the weights are well-formed safetensors
    (`focus_hf.files.read_safetensors_header`). A corrupt file is evicted from the cache.

    Args:
        repo_id (`str`): Hub repo id (any id ``huggingface_hub`` accepts).
        **download_kwargs: loader keyword arguments; those of ``hf_hub_download`` (``revision``, ``subfolder``,
            ``cache_dir``, ``token``, ``local_files_only``...) are used, ``use_auth_token`` is read as ``token``,
            the rest are ignored.

    Returns:
        `pathlib.Path`: the verified weights file in the cache (the config lies beside it).

    Raises:
        [`focus_hf.files.AdapterFileError`] (a `ValueError`): no safetensors weights, or a corrupt, truncated or
            tampered download, or the Hub's listing could not be fetched to check it.
        huggingface_hub.errors: `RepositoryNotFoundError`, `RevisionNotFoundError`, `LocalEntryNotFoundError`...
            as raised by ``hf_hub_download``.
    """
    kwargs = {k: v for k, v in download_kwargs.items() if k in _HF_HUB_DOWNLOAD_KWARGS and v is not None}
    if kwargs.get("token") is None and download_kwargs.get("use_auth_token") is not None:
        kwargs["token"] = download_kwargs["use_auth_token"]
    if not kwargs.get("subfolder"):
        kwargs.pop("subfolder", None)
    label = f"{repo_id}@{kwargs.get('revision') or constants.DEFAULT_REVISION}"
    if kwargs.get("subfolder"):
        label += f" (subfolder {kwargs['subfolder']!r})"
    weights = _download(repo_id, WEIGHTS_NAME, label, kwargs)
    config = _download(repo_id, CONFIG_NAME, label, kwargs)
    snapshot, commit = snapshot_commit(weights)
    prefix = f"{kwargs['subfolder'].strip('/')}/" if kwargs.get("subfolder") else ""
    files = {f"{prefix}{CONFIG_NAME}": config, f"{prefix}{WEIGHTS_NAME}": weights}
    offline = bool(kwargs.get("local_files_only")) or constants.is_offline_mode()
    try:
        verification = verify_snapshot(
            repo_id, snapshot, list(files), repo_type=kwargs.get("repo_type") or "model", token=kwargs.get("token"),
            offline=offline, endpoint=kwargs.get("endpoint"),
        )  # fmt: skip
    except transport_errors() as error:
        raise AdapterFileError(
            f"The Hub adapter {label} was downloaded, but the Hub's checksums of commit {commit} could not be fetched "
            f"to check it ({type(error).__name__}: {error}). The model was not modified; retry, or load it offline "
            "(HF_HUB_OFFLINE=1) to check the cached files against the checksums they were downloaded with."
        ) from error
    problems = dict(verification.problems)
    if f"{prefix}{WEIGHTS_NAME}" not in problems:
        try:
            read_safetensors_header(weights)
        except AdapterFileError as error:
            problems[f"{prefix}{WEIGHTS_NAME}"] = str(error)
    if problems:
        for path in problems:
            evict_cached_file(files[path])
        details = "; ".join(f"{name}: {reason}" for name, reason in sorted(problems.items()))
        raise AdapterFileError(
            f"{' and '.join(sorted(problems))} of the Hub adapter {label} (commit {commit}) is corrupt, truncated or "
            f"tampered with ({details}). The model was not modified and the files were removed from the cache; retry "
            "the download."
        )
    if verification.unverified:
        logger.warning(
            "Loading %s from the cache without checking %s against the Hub's checksums: offline, and this cache keeps "
            "copies rather than links named after the checksums. Load it online once to check it.",
            label, ", ".join(verification.unverified),
        )  # fmt: skip
    return weights
