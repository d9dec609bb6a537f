"""Download a Focus adapter from the Hub or the cache (`pull_adapter`) and verify every file it holds.

The repo must be a Focus adapter (FOCUS config, safetensors weights, no pickle files); each downloaded file must
match the size and checksum of the Hub's listing (see `focus_hf.hub.integrity`), else it is evicted from the cache
and the pull fails.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from pathlib import Path

from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
from huggingface_hub.utils import filter_repo_objects

from focus_hf.errors import AdapterIntegrityError, NotAFocusAdapterError
from focus_hf.files import (
    ADAPTER_FILE_PATTERNS,
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterFileError,
    ConfigFormatError,
    is_pickle,
    read_focus_config,
    read_safetensors_header,
)
from focus_hf.hub.integrity import evict_cached_file, file_mismatch, load_remote_tree
from focus_hf.hub.repo_ids import validate_repo_id, validate_revision

logger = logging.getLogger(__name__)


def _copy_files(snapshot: Path, rel_paths: list[str], out_dir: Path) -> None:
    """Copy verified snapshot files into `out_dir` (atomically per file: a crash never leaves a partial file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for rel in rel_paths:
        destination = out_dir / rel
        destination.parent.mkdir(parents=True, exist_ok=True)
        # Not mkstemp: its file is 0600, and the copy would keep that mode. copyfile creates the file with open(),
        # under the umask, as save_pretrained writes an adapter's files.
        tmp = destination.parent / f".{destination.name}.{secrets.token_hex(8)}.tmp"
        try:
            shutil.copyfile(snapshot / rel, tmp)  # follows the cache symlink
            os.replace(tmp, destination)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _remove_stale_files(out_dir: Path, pulled: list[str]) -> None:
    """Delete the adapter files (`ADAPTER_FILE_PATTERNS`, top level) of `out_dir` that this revision does not have,
    so that an older pull's chart or page never sits beside the new card. Other files are left alone."""
    kept = set(pulled)
    for path in sorted(out_dir.iterdir()):
        if path.name in kept or path.name.startswith(".") or not (path.is_file() or path.is_symlink()):
            continue
        if list(filter_repo_objects([path.name], allow_patterns=list(ADAPTER_FILE_PATTERNS))):
            logger.info("Removing %s: the pulled revision does not have it.", path)
            path.unlink()


def pull_adapter(
    repo_id: str,
    *,
    revision: str | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Download a Focus adapter from the Hub (or the local cache) and verify it.

    Downloads only the adapter files (``adapter_config.json``, ``adapter_model.safetensors``, ``README.md``,
    ``*.json``, ``*.png``, ``*.html``) with ``huggingface_hub.snapshot_download``, then checks that:

    - the repo has an ``adapter_config.json`` whose ``peft_type`` is ``FOCUS`` and an ``adapter_model.safetensors``;
    - the repo holds no pickle file;
    - every downloaded file has the size and checksum listed by the Hub for that commit (``huggingface_hub`` only
      checks sizes), and ``adapter_model.safetensors`` is a well-formed safetensors file. A corrupt file is
      evicted from the cache, so retrying downloads it again.

    Works offline from the cache with ``local_files_only=True`` or ``HF_HUB_OFFLINE=1`` (files already pulled
    for that revision; a branch name resolves to the commit it pointed to when last pulled).

    Args:
        repo_id (`str`): ``namespace/name`` (see [`validate_repo_id`]).
        revision (`str`, *optional*): branch, tag or commit sha. Defaults to ``main``.
        out_dir (`str` or `os.PathLike`, *optional*): if given, the verified files are also copied there, and
            adapter files left there by an older pull that this revision does not have are deleted
            (created if needed, same-named files overwritten) and this folder is returned.
        token (`str` or `bool`, *optional*): Hub token; defaults to the locally saved one.
        local_files_only (`bool`, defaults to `False`): never touch the network, use the cache only.
        cache_dir (`str` or `os.PathLike`, *optional*): ``huggingface_hub`` cache folder; defaults to
            ``HF_HUB_CACHE``.

    Returns:
        `pathlib.Path`: ``out_dir`` if given, else the snapshot folder in the cache (don't modify it).

    Raises:
        [`InvalidRepoIdError`]: bad ``repo_id``.
        [`NotAFocusAdapterError`]: no ``adapter_config.json`` / ``adapter_model.safetensors``, ``peft_type`` not
            ``FOCUS``, or pickle files in the repo.
        [`AdapterIntegrityError`]: a download is truncated, tampered with, or not valid safetensors.
        `huggingface_hub.errors.RepositoryNotFoundError` / `RevisionNotFoundError`: unknown (or private) repo or
            revision. `huggingface_hub.errors.LocalEntryNotFoundError`: offline and not in the cache.
    """
    repo_id = validate_repo_id(repo_id)
    revision = validate_revision(revision)
    label = f"{repo_id}@{revision or constants.DEFAULT_REVISION}"
    offline = bool(local_files_only) or constants.is_offline_mode()
    try:
        snapshot = Path(
            snapshot_download(
                repo_id,
                repo_type="model",
                revision=revision,
                cache_dir=cache_dir,
                token=token,
                local_files_only=offline,
                allow_patterns=list(ADAPTER_FILE_PATTERNS),
            )
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, ConnectionError):
        raise
    except OSError as error:
        if error.errno is not None:  # a real filesystem error (disk full, permissions...)
            raise
        # `huggingface_hub` raises a bare OSError("Consistency check failed: file should be of size ...") when a
        # download is shorter or longer than announced, and FileMetadataError (an OSError) on bad metadata.
        raise AdapterIntegrityError(f"Download of Focus adapter {label} is incomplete or corrupt: {error}") from error

    commit_hash = snapshot.name
    storage_folder = snapshot.parent.parent
    remote = load_remote_tree(storage_folder, commit_hash, None if offline else HfApi(token=token), repo_id)
    if remote is not None:
        repo_files = sorted(remote)
    else:
        logger.warning("No file listing available for %s: checksums cannot be verified, only file formats.", label)
        repo_files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    wanted = sorted(filter_repo_objects(repo_files, allow_patterns=list(ADAPTER_FILE_PATTERNS)))

    if CONFIG_NAME not in repo_files:
        raise NotAFocusAdapterError(
            f"{label} is not a Focus adapter repo: it has no {CONFIG_NAME} (files: {repo_files[:20]})."
        )
    pickles = [name for name in repo_files if is_pickle(name)]
    if pickles:
        raise NotAFocusAdapterError(
            f"Refusing {label}: it contains pickle files {pickles}, which can run arbitrary code when loaded. "
            "Focus adapters are safetensors-only."
        )
    if WEIGHTS_NAME not in repo_files:
        raise NotAFocusAdapterError(f"{label} is not a Focus adapter repo: it has no {WEIGHTS_NAME}.")
    unsafe = [name for name in wanted if name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/"))]
    if unsafe:
        raise NotAFocusAdapterError(f"Refusing {label}: unsafe file paths {unsafe}.")

    problems: dict[str, str] = {}
    for rel in wanted:
        local = snapshot / rel
        if not local.is_file():
            problems[rel] = "missing from the download"
        elif remote is not None and (reason := file_mismatch(local, remote[rel])) is not None:
            problems[rel] = reason
    if WEIGHTS_NAME not in problems:
        try:
            read_safetensors_header(snapshot / WEIGHTS_NAME)
        except AdapterFileError as error:
            problems[WEIGHTS_NAME] = f"not a valid safetensors file: {error}"
    if problems:
        for rel in sorted(problems):
            evict_cached_file(snapshot / rel)
        details = "; ".join(f"{name}: {reason}" for name, reason in sorted(problems.items()))
        raise AdapterIntegrityError(
            f"Download of Focus adapter {label} (commit {commit_hash}) failed verification - {details}. "
            "The corrupt files were removed from the cache; retry the download."
        )

    try:
        read_focus_config(snapshot / CONFIG_NAME)
    except ConfigFormatError as error:
        raise NotAFocusAdapterError(f"{label} is not a Focus adapter: {error}.") from None

    if out_dir is None:
        return snapshot
    out_path = Path(out_dir)
    _copy_files(snapshot, wanted, out_path)
    _remove_stale_files(out_path, wanted)
    return out_path
