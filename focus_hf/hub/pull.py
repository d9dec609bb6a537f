"""Download a Focus adapter from the Hub or the cache (`pull_adapter`), verify every file it holds, and optionally copy
it into a folder of the user's (`local_dir`) without touching any file the user made.

The repo must be a Focus adapter (FOCUS config, safetensors weights, no pickle files); each downloaded file must be the
bytes the Hub lists for its commit (see `focus_hf.hub.integrity`), else it is evicted from the cache and the pull fails.
A pull cut mid-download leaves no file that a later load trusts: huggingface_hub writes a download under a temporary
name until it is complete (and resumes it on the next try), and `local_dir` receives files only once they are verified.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import warnings
from pathlib import Path

from huggingface_hub import constants, snapshot_download
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
from focus_hf.hub.integrity import evict_cached_file, transport_errors, verify_snapshot
from focus_hf.hub.repo_ids import validate_repo_id, validate_revision

logger = logging.getLogger(__name__)

# What a pull into a local folder wrote there (repo, commit, each file's sha256), so that a later pull into the same
# folder knows which files are its own and which ones the user made.
PULL_RECORD_NAME = ".focus-hf-pull.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_pull_record(folder: Path) -> dict[str, str]:
    """path -> sha256 of the files an earlier pull wrote into `folder` ({} when none did)."""
    record = folder / PULL_RECORD_NAME
    if not record.is_file():
        return {}
    try:
        files = json.loads(record.read_text(encoding="utf-8"))["files"]
        return {str(path): str(digest) for path, digest in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise NotAFocusAdapterError(
            f"{record} is not a record of an earlier pull (unreadable); remove it, or pull into another folder."
        ) from None


def check_local_dir(folder: Path) -> dict[str, str]:
    """Refuse a `local_dir` holding files that no earlier pull wrote, or pulled files the user changed since; return
    the earlier pull's record (path -> sha256)."""
    if not folder.exists():
        return {}
    if not folder.is_dir():
        raise NotAFocusAdapterError(f"Cannot pull into {str(folder)!r}: it is a file, not a folder.")
    written = _read_pull_record(folder)
    others = sorted(
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if (path.is_file() or path.is_symlink())
        and path.name != PULL_RECORD_NAME
        and path.relative_to(folder).as_posix() not in written
    )
    changed = sorted(
        path for path, digest in written.items() if (folder / path).is_file() and _sha256(folder / path) != digest
    )
    if others or changed:
        reasons = []
        if others:
            listed = ", ".join(others[:8]) + (", ..." if len(others) > 8 else "")
            reasons.append(f"it holds files no pull wrote ({listed})")
        if changed:
            reasons.append(f"pulled files were changed since ({', '.join(changed)})")
        raise NotAFocusAdapterError(
            f"Refusing to pull into {str(folder)!r}: {' and '.join(reasons)}. A pull writes only into an empty folder "
            "or one an earlier pull wrote, and never overwrites or deletes a file it did not write: choose a new "
            "folder, or use the verified snapshot in the huggingface_hub cache that `pull` prints without a folder."
        )
    return written


def _copy_into(snapshot: Path, rel_paths: list[str], folder: Path, earlier: dict[str, str], record: dict) -> None:
    """Copy verified snapshot files into `folder` (each atomically), remove the files of an earlier pull that this
    revision lacks, and write the new pull record last."""
    folder.mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}
    for rel in rel_paths:
        destination = folder / rel
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
        written[rel] = _sha256(destination)
    for rel in sorted(set(earlier) - set(written)):
        logger.info("Removing %s: an earlier pull wrote it and the pulled revision does not have it.", folder / rel)
        (folder / rel).unlink(missing_ok=True)
    tmp = folder / f"{PULL_RECORD_NAME}.{secrets.token_hex(8)}.tmp"
    tmp.write_text(json.dumps({**record, "files": written}, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, folder / PULL_RECORD_NAME)


def pull_adapter(
    repo_id: str,
    *,
    revision: str | None = None,
    local_dir: str | os.PathLike[str] | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    out_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Download a Focus adapter from the Hub (or the local cache) and verify it.

    Downloads only the adapter files (``adapter_config.json``, ``adapter_model.safetensors``, ``README.md``,
    ``*.json``, ``*.png``, ``*.html``) with ``huggingface_hub.snapshot_download``, then checks that:

    - the repo has an ``adapter_config.json`` whose ``peft_type`` is ``FOCUS`` and an ``adapter_model.safetensors``;
    - the repo holds no pickle file;
    - every downloaded file is the bytes the Hub lists for that commit (`HfApi.verify_repo_checksums`; offline, the
      checksum each file was cached under), and ``adapter_model.safetensors`` is a well-formed safetensors file. A
      corrupt file is evicted from the cache, so retrying downloads it again.

    A download cut mid-transfer is resumed by huggingface_hub a few times, then fails; what was received stays under a
    temporary name that no load reads, and the next pull resumes it.

    Works offline from the cache with ``local_files_only=True`` or ``HF_HUB_OFFLINE=1`` (files already pulled
    for that revision; a branch name resolves to the commit it pointed to when last pulled).

    Args:
        repo_id (`str`): ``namespace/name`` (see [`validate_repo_id`]).
        revision (`str`, *optional*): branch, tag or commit sha. Defaults to ``main``.
        local_dir (`str` or `os.PathLike`, *optional*): if given, the verified files are also copied into this folder
            (created if needed), which is returned. It must be empty or written by an earlier pull (which records its
            files in ``.focus-hf-pull.json``): a pull never overwrites or deletes a file it did not write. Files of an
            earlier pull that this revision lacks are removed.
        token (`str` or `bool`, *optional*): Hub token; defaults to the locally saved one.
        local_files_only (`bool`, defaults to `False`): never touch the network, use the cache only.
        cache_dir (`str` or `os.PathLike`, *optional*): ``huggingface_hub`` cache folder; defaults to
            ``HF_HUB_CACHE``.
        out_dir: the former name of `local_dir` (deprecated).

    Returns:
        `pathlib.Path`: ``local_dir`` if given, else the snapshot folder in the cache (don't modify it).

    Raises:
        [`InvalidRepoIdError`]: bad ``repo_id``.
        [`NotAFocusAdapterError`]: no ``adapter_config.json`` / ``adapter_model.safetensors``, ``peft_type`` not
            ``FOCUS``, pickle files in the repo, or a `local_dir` holding files no pull wrote.
        [`AdapterIntegrityError`]: a download is truncated, cut, tampered with, or not valid safetensors, or it could
            not be checked against the Hub's listing.
        `huggingface_hub.errors.RepositoryNotFoundError` / `RevisionNotFoundError`: unknown (or private) repo or
            revision. `huggingface_hub.errors.LocalEntryNotFoundError`: offline and not in the cache.
    """
    if out_dir is not None:
        warnings.warn("pull_adapter(out_dir=...) is now local_dir=...", DeprecationWarning, stacklevel=2)
        local_dir = local_dir if local_dir is not None else out_dir
    repo_id = validate_repo_id(repo_id)
    revision = validate_revision(revision)
    label = f"{repo_id}@{revision or constants.DEFAULT_REVISION}"
    earlier = check_local_dir(Path(local_dir)) if local_dir is not None else {}
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
    except (HfHubHTTPError, LocalEntryNotFoundError):
        raise
    except transport_errors() as error:
        if isinstance(error, OSError) and error.errno is not None:
            raise  # a real filesystem error (disk full, permissions...)
        # A connection cut mid-download (after huggingface_hub's own retries), or the bare OSError("Consistency check
        # failed ...") huggingface_hub raises when a download is shorter or longer than announced.
        raise AdapterIntegrityError(
            f"Download of Focus adapter {label} did not complete ({type(error).__name__}: {error}). Nothing was "
            "copied anywhere and no partial file is used by a later load; retry the pull to complete it."
        ) from error

    commit_hash = snapshot.name
    local_files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    wanted_local = sorted(filter_repo_objects(local_files, allow_patterns=list(ADAPTER_FILE_PATTERNS)))
    try:
        verification = verify_snapshot(repo_id, snapshot, wanted_local, token=token, offline=offline)
    except transport_errors() as error:
        raise AdapterIntegrityError(
            f"Focus adapter {label} (commit {commit_hash}) was downloaded, but the Hub's checksums could not be "
            f"fetched to verify it ({type(error).__name__}: {error}). Retry the pull."
        ) from error
    repo_files = verification.remote_files if verification.remote_files is not None else local_files
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

    problems = dict(verification.problems)
    problems.update({rel: "missing from the download" for rel in wanted if rel not in local_files})
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
    if verification.unverified:
        logger.warning(
            "%s: %s not checked against the Hub's checksums (offline, and this cache keeps copies rather than links "
            "named after the checksums); pull it online once to check it.", label, ", ".join(verification.unverified),
        )  # fmt: skip

    try:
        read_focus_config(snapshot / CONFIG_NAME)
    except ConfigFormatError as error:
        raise NotAFocusAdapterError(f"{label} is not a Focus adapter: {error}.") from None

    if local_dir is None:
        return snapshot
    folder = Path(local_dir)
    record = {"repo_id": repo_id, "revision": revision or constants.DEFAULT_REVISION, "commit": commit_hash}
    _copy_into(snapshot, wanted, folder, earlier, record)
    return folder
