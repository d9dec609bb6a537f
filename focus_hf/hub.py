"""Share Focus adapters on the Hugging Face Hub.

A Focus adapter is a small PEFT adapter folder: ``adapter_config.json`` (with ``"peft_type": "FOCUS"``) and
``adapter_model.safetensors``, plus an optional ``README.md`` model card and interpretability files
(``*.json``, ``*.png``, ``*.html``). [`push_adapter`] uploads such a folder in a single commit and
[`pull_adapter`] downloads it back, verified, through the regular ``huggingface_hub`` cache (so it also works
offline once downloaded).

Safety rules, enforced on both sides:

- only safetensors weights: pickle files (``*.bin``, ``*.pt``, ``*.pth``, ``*.pkl``, ``*.pickle``, ``*.ckpt``,
  ``*.joblib``) are refused, whether in the folder to push or in the repo to pull;
- only the adapter: base-model weight files (``model*.safetensors``, any other ``*.safetensors``, shard
  indexes, ``*.gguf``...) are refused on push and never downloaded on pull; the ``checkpoints/`` folder that
  ``focus-hf train`` keeps for resuming is skipped on push (with a logged warning), pickles and all;
- downloads are verified: ``huggingface_hub`` itself only checks that a downloaded file has the size announced
  by the server, so [`pull_adapter`] re-checks every file against the size and checksum of the Hub's tree
  listing (git blob sha1 for regular files, sha256 for LFS files) and parses the safetensors header, and evicts
  a corrupt file from the cache before raising [`AdapterIntegrityError`].

The endpoint, cache and offline mode are those of ``huggingface_hub`` (``HF_ENDPOINT``, ``HF_HOME``/
``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``), read when each function is called.

Safetensors files are checked by `focus_hf.adapter_files.read_safetensors_header`, the same strict check the
core runs before a Focus adapter is injected into a model.

Loading straight from the Hub needs none of this module's functions: ``model.load_adapter("org/name")``
(transformers; a revision goes in ``adapter_kwargs={"revision": ...}``) and
``PeftModel.from_pretrained(base, "org/name", revision=...)`` work after ``import focus_hf``. Before injecting,
the Focus tuner runs [`resolve_adapter_weights`] with the loader's own revision / cache / token arguments: the
same revision's ``adapter_model.safetensors`` is checked against the checksum the Hub announced and the
safetensors format, so a truncated or tampered download is refused with the model left untouched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx2
from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, RepoFile, constants, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
from huggingface_hub.utils import filter_repo_objects

from .adapter_files import CONFIG_NAME as ADAPTER_CONFIG_NAME
from .adapter_files import PICKLE_SUFFIXES, AdapterFileError, read_safetensors_header
from .adapter_files import WEIGHTS_NAME as ADAPTER_WEIGHTS_NAME
from .training import CHECKPOINTS_DIR

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "ADAPTER_FILE_PATTERNS",
    "FOCUS_PEFT_TYPE",
    "PICKLE_SUFFIXES",
    "FocusHubError",
    "InvalidRepoIdError",
    "AdapterFolderError",
    "NotAFocusAdapterError",
    "AdapterIntegrityError",
    "HubPushError",
    "validate_repo_id",
    "push_adapter",
    "pull_adapter",
    "resolve_adapter_weights",
]

logger = logging.getLogger(__name__)

README_NAME = "README.md"
FOCUS_PEFT_TYPE = "FOCUS"
# Files pushed and pulled (fnmatch patterns on top-level names, as `huggingface_hub` `allow_patterns`).
ADAPTER_FILE_PATTERNS: tuple[str, ...] = (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    README_NAME,
    "*.json",
    "*.png",
    "*.html",
)
# Full-model weight formats; any *.safetensors other than the adapter's is treated as base-model weights.
_BASE_WEIGHT_SUFFIXES: tuple[str, ...] = (".safetensors", ".gguf", ".h5", ".msgpack", ".onnx", ".tflite")
_BASE_WEIGHT_INDEX_SUFFIXES: tuple[str, ...] = (".safetensors.index.json", ".bin.index.json")

_REPO_PART_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
_COMMIT_SHA_RE = re.compile(r"[0-9a-f]{40}")


# ---------------------------------------------------------------------------------------------- errors
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


# ---------------------------------------------------------------------------------------------- validation
def validate_repo_id(repo_id: str) -> str:
    """Check that ``repo_id`` is a Hub model id of the form ``namespace/name`` and return it unchanged.

    Stricter than ``huggingface_hub.utils.validate_repo_id``: the namespace is required, and anything that
    looks like a filesystem path or a URL is refused with an explicit message (a common mistake is to pass
    the adapter folder where the repo id is expected).

    Rules: exactly one ``/``; each part 1-96 ASCII letters, digits, ``-``, ``_`` or ``.``, starting and ending
    with a letter or digit; no ``--`` or ``..``; the name does not end with ``.git``.

    Args:
        repo_id (`str`): e.g. ``"my-org/qwen3-0.6b-focus"``.

    Returns:
        `str`: ``repo_id``.

    Raises:
        [`InvalidRepoIdError`] (a `ValueError`): if ``repo_id`` is invalid.
    """
    if isinstance(repo_id, os.PathLike):
        raise InvalidRepoIdError(
            f"repo_id must be a Hub id like 'namespace/name', got a path object {os.fspath(repo_id)!r}."
        )
    if not isinstance(repo_id, str):
        raise InvalidRepoIdError(f"repo_id must be a str like 'namespace/name', got {type(repo_id).__name__}.")
    hint = "Expected a Hub id of the form 'namespace/name', e.g. 'my-org/my-focus-adapter'."
    if not repo_id:
        raise InvalidRepoIdError(f"repo_id is empty. {hint}")
    if any(ch.isspace() or ord(ch) < 32 for ch in repo_id):
        raise InvalidRepoIdError(f"Invalid repo_id {repo_id!r}: it contains whitespace or control characters. {hint}")
    if "://" in repo_id:
        raise InvalidRepoIdError(f"Invalid repo_id {repo_id!r}: it looks like a URL, not a repo id. {hint}")
    if (
        "\\" in repo_id
        or repo_id.startswith(("/", "~", "./", "../"))
        or re.match(r"[A-Za-z]:", repo_id)
        or any(part in (".", "..") for part in repo_id.split("/"))
    ):
        raise InvalidRepoIdError(f"Invalid repo_id {repo_id!r}: it looks like a filesystem path, not a repo id. {hint}")
    parts = repo_id.split("/")
    if len(parts) != 2:
        raise InvalidRepoIdError(f"Invalid repo_id {repo_id!r}: it must contain exactly one '/'. {hint}")
    for part in parts:
        if not _REPO_PART_RE.fullmatch(part):
            raise InvalidRepoIdError(
                f"Invalid repo_id {repo_id!r}: {part!r} must be 1-96 ASCII letters, digits, '-', '_' or '.', "
                f"starting and ending with a letter or digit. {hint}"
            )
        if "--" in part or ".." in part:
            raise InvalidRepoIdError(f"Invalid repo_id {repo_id!r}: '--' and '..' are not allowed. {hint}")
    if repo_id.endswith(".git"):
        raise InvalidRepoIdError(f"Invalid repo_id {repo_id!r}: it must not end with '.git'. {hint}")
    return repo_id


def _validate_revision(revision: str | None) -> str | None:
    if revision is None:
        return None
    if not isinstance(revision, str) or not revision:
        raise ValueError(f"revision must be a non-empty str (branch, tag or commit sha) or None, got {revision!r}.")
    if (
        any(ch.isspace() or ord(ch) < 32 for ch in revision)
        or revision.startswith("/")
        or revision.endswith("/")
        or any(part in ("", ".", "..") for part in revision.split("/"))
        or len(revision) > 256
    ):
        raise ValueError(f"Invalid revision {revision!r}.")
    return revision


def _is_pickle(name: str) -> bool:
    return name.lower().endswith(PICKLE_SUFFIXES)


def _is_base_weight(name: str) -> bool:
    lowered = name.lower()
    if lowered == ADAPTER_WEIGHTS_NAME:
        return False
    return lowered.endswith(_BASE_WEIGHT_SUFFIXES) or lowered.endswith(_BASE_WEIGHT_INDEX_SUFFIXES)


def _matches_adapter_patterns(name: str) -> bool:
    return bool(list(filter_repo_objects([name], allow_patterns=list(ADAPTER_FILE_PATTERNS))))


class _FormatError(Exception):
    pass


def _read_focus_config(path: Path) -> dict[str, Any]:
    """Parse an adapter_config.json; raise `_FormatError` unless it is a JSON object with peft_type FOCUS."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise _FormatError(f"{ADAPTER_CONFIG_NAME} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise _FormatError(f"{ADAPTER_CONFIG_NAME} is not a JSON object")
    peft_type = config.get("peft_type")
    if peft_type != FOCUS_PEFT_TYPE:
        raise _FormatError(
            f"{ADAPTER_CONFIG_NAME} has peft_type {peft_type!r}, expected {FOCUS_PEFT_TYPE!r} (not a Focus adapter)"
        )
    return config


# ---------------------------------------------------------------------------------------------- push
def _collect_adapter_files(adapter_dir: str | os.PathLike[str]) -> dict[str, bytes]:
    """Validate an adapter folder and read the files to upload (path in repo -> bytes)."""
    folder = Path(adapter_dir)
    if not folder.is_dir():
        raise AdapterFolderError(f"Adapter folder {str(folder)!r} does not exist or is not a directory.")
    for required in (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME):
        if not (folder / required).is_file():
            raise AdapterFolderError(
                f"{str(folder)!r} is not a Focus adapter folder: {required} is missing. "
                "Save the adapter first with `peft_model.save_pretrained(folder)`."
            )
    # `focus-hf train` keeps resumable Trainer checkpoints (optimizer and RNG state: pickles) in
    # <adapter>/checkpoints. They are never part of the adapter, so they are skipped rather than refused.
    checkpoints = folder / CHECKPOINTS_DIR
    if checkpoints.is_dir():
        logger.warning(
            "Not pushing %s/: training checkpoints are not part of the adapter (delete the folder once training "
            "is finished, or train with `focus-hf train --clean-checkpoints`).", checkpoints,
        )  # fmt: skip
    pickles: list[str] = []
    base_weights: list[str] = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        parts = rel.split("/")
        if any(part.startswith(".") for part in parts) or not path.is_file():
            continue  # hidden files/folders (.git, .cache) are never uploaded
        if len(parts) > 1 and parts[0] == CHECKPOINTS_DIR:
            continue
        if _is_pickle(path.name):
            pickles.append(rel)
        elif _is_base_weight(path.name):
            base_weights.append(rel)
    if pickles:
        raise AdapterFolderError(
            f"Refusing to push {str(folder)!r}: it contains pickle files {pickles}. Pickles can run arbitrary code "
            "when loaded; Focus adapters are safetensors-only. Remove them (or push from a clean folder)."
        )
    if base_weights:
        raise AdapterFolderError(
            f"Refusing to push {str(folder)!r}: it contains base-model weight files {base_weights}. Only the "
            f"adapter ({ADAPTER_WEIGHTS_NAME}) is pushed; push from a folder holding just the saved adapter."
        )
    try:
        _read_focus_config(folder / ADAPTER_CONFIG_NAME)
    except _FormatError as error:
        raise AdapterFolderError(f"Refusing to push {str(folder)!r}: {error}.") from None
    try:
        read_safetensors_header(folder / ADAPTER_WEIGHTS_NAME)
    except AdapterFileError as error:
        raise AdapterFolderError(
            f"Refusing to push {str(folder)!r}: {ADAPTER_WEIGHTS_NAME} is not a valid safetensors file: {error}"
        ) from None

    files: dict[str, bytes] = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or not path.is_file():
            continue
        if _matches_adapter_patterns(path.name):
            files[path.name] = path.read_bytes()
        else:
            logger.info("Not pushing %s: only %s files are part of a Focus adapter.", path.name, ADAPTER_FILE_PATTERNS)
    return files


def push_adapter(
    adapter_dir: str | os.PathLike[str],
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool = False,
    commit_message: str | None = None,
    token: str | bool | None = None,
    create_pr: bool = False,
) -> CommitInfo:
    """Upload a saved Focus adapter folder to the Hub in a single commit.

    Uploads the top-level ``adapter_config.json``, ``adapter_model.safetensors``, ``README.md`` and any
    ``*.json`` / ``*.png`` / ``*.html`` (interpretability files such as ``group_balance.png``) of ``adapter_dir``;
    other files are skipped, and so is the training ``checkpoints/`` folder (with a logged warning).
    The repo is created if needed (an existing repo keeps its visibility), and so is the branch ``revision``.
    Files identical to the ones already on the branch are not re-uploaded; if nothing changed, no commit is
    created and the current head is returned. The folder is only read, never modified.

    Args:
        adapter_dir (`str` or `os.PathLike`): folder written by ``peft_model.save_pretrained``.
        repo_id (`str`): ``namespace/name`` (see [`validate_repo_id`]).
        revision (`str`, *optional*): branch to commit to (created from ``main`` if missing). Defaults to ``main``.
        private (`bool`, defaults to `False`): visibility of the repo if it is created.
        commit_message (`str`, *optional*): defaults to ``"Upload Focus adapter"``.
        token (`str` or `bool`, *optional*): Hub token; defaults to the locally saved one (``huggingface_hub``).
        create_pr (`bool`, defaults to `False`): open a pull request against ``revision`` instead of committing.

    Returns:
        [`huggingface_hub.CommitInfo`]: a `str` (the commit URL) with ``.oid`` (commit sha) and, with
        ``create_pr=True``, ``.pr_url`` / ``.pr_revision``.

    Raises:
        [`InvalidRepoIdError`]: bad ``repo_id``.
        [`AdapterFolderError`]: missing adapter files, pickle or base-model weight files in the folder, config
            whose ``peft_type`` is not ``FOCUS``, or invalid safetensors weights. Nothing is sent to the Hub.
        [`HubPushError`]: the Hub failed (HTTP error, connection error); the original error is chained.
        `ValueError`: invalid ``revision`` (e.g. a commit sha: commits go to branches).
    """
    repo_id = validate_repo_id(repo_id)
    revision = _validate_revision(revision)
    if revision is not None and _COMMIT_SHA_RE.fullmatch(revision):
        raise ValueError(f"revision must be a branch name to commit to, not a commit sha ({revision!r}).")
    files = _collect_adapter_files(adapter_dir)
    target = revision or constants.DEFAULT_REVISION

    api = HfApi(token=token)  # endpoint read from huggingface_hub.constants now, not at import
    step = "creating the repo"
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        if target != constants.DEFAULT_REVISION and not target.startswith("refs/pr/"):
            step = f"creating branch {target!r}"
            api.create_branch(repo_id, branch=target, repo_type="model", exist_ok=True)
        step = "committing"
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=data) for name, data in files.items()]
        commit = api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or "Upload Focus adapter",
            repo_type="model",
            revision=revision,
            create_pr=create_pr,
        )
    except (OSError, httpx2.HTTPError) as error:  # HfHubHTTPError is an OSError
        status = getattr(getattr(error, "response", None), "status_code", None)
        answer = f"HTTP {status}" if status is not None else type(error).__name__
        raise HubPushError(
            f"Pushing {str(adapter_dir)!r} to {repo_id!r} (revision {target!r}) failed while {step}: the Hub "
            f"answered {answer}. The local folder was not modified; the push can be retried.\nHub error: {error}"
        ) from error
    logger.info("Pushed Focus adapter %s to %s@%s: %s", adapter_dir, repo_id, target, commit.oid)
    return commit


# ---------------------------------------------------------------------------------------------- pull
@dataclasses.dataclass(frozen=True)
class _RemoteFile:
    size: int
    blob_id: str  # git blob sha1 (of the LFS pointer for LFS files)
    sha256: str | None = None  # LFS files only: sha256 of the content


def _load_remote_tree(
    storage_folder: Path, commit_hash: str, api: HfApi | None, repo_id: str
) -> dict[str, _RemoteFile] | None:
    """The Hub's listing (size + checksums) of the repo at ``commit_hash``.

    ``snapshot_download`` stores it in ``<repo cache>/trees/<commit>.json`` (``format_version`` 1, documented in
    ``huggingface_hub._tree_cache``); read it from there so verification also works offline. Online, fall back to
    ``HfApi.list_repo_tree``. Returns None if neither is available.
    """
    try:
        data = json.loads((storage_folder / "trees" / f"{commit_hash}.json").read_text(encoding="utf-8"))
        if data.get("format_version") == 1:
            return {
                path: _RemoteFile(
                    size=int(info.get("lfs_size") or info["size"]),
                    blob_id=str(info["blob_id"]),
                    sha256=info.get("lfs_sha256"),
                )
                for path, info in data["files"].items()
            }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    if api is None:
        return None
    try:
        return {
            entry.path: _RemoteFile(
                size=int(entry.lfs.size if entry.lfs else entry.size),
                blob_id=entry.blob_id,
                sha256=entry.lfs.sha256 if entry.lfs else None,
            )
            for entry in api.list_repo_tree(repo_id, revision=commit_hash, recursive=True, repo_type="model")
            if isinstance(entry, RepoFile)
        }
    except (OSError, httpx2.HTTPError):
        return None


def _file_mismatch(path: Path, expected: _RemoteFile) -> str | None:
    """Why ``path`` does not match the Hub's listing, or None if it does."""
    size = path.stat().st_size
    if size != expected.size:
        return f"size {size} bytes, the Hub lists {expected.size}"
    if expected.sha256 is not None:
        digest = hashlib.sha256()
        algo, want = "sha256", expected.sha256
    else:
        digest = hashlib.sha1(b"blob %d\0" % size)
        algo, want = "git-sha1", expected.blob_id
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != want:
        return f"{algo} {digest.hexdigest()}, the Hub lists {want}"
    return None


def _evict_from_cache(snapshot: Path, rel_paths: list[str]) -> None:
    """Remove corrupt files (snapshot entry and its blob) so that the next online pull downloads them again."""
    blobs_dir = (snapshot.parent.parent / "blobs").resolve()
    for rel in rel_paths:
        entry = snapshot / rel
        try:
            if entry.is_symlink():
                blob = entry.resolve()
                entry.unlink()
                if blob.parent == blobs_dir:
                    blob.unlink(missing_ok=True)
            elif entry.exists():
                entry.unlink()
        except OSError as error:  # pragma: no cover - best effort
            logger.warning("Could not evict corrupt cached file %s: %s", entry, error)


def _copy_files(snapshot: Path, rel_paths: list[str], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for rel in rel_paths:
        destination = out_dir / rel
        destination.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=destination.parent, prefix=f".{destination.name}.", suffix=".tmp")
        os.close(fd)
        try:
            shutil.copyfile(snapshot / rel, tmp)  # follows the cache symlink
            os.replace(tmp, destination)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


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
        out_dir (`str` or `os.PathLike`, *optional*): if given, the verified files are also copied there
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
    revision = _validate_revision(revision)
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
    remote = _load_remote_tree(storage_folder, commit_hash, None if offline else HfApi(token=token), repo_id)
    if remote is not None:
        repo_files = sorted(remote)
    else:
        logger.warning("No file listing available for %s: checksums cannot be verified, only file formats.", label)
        repo_files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    wanted = sorted(filter_repo_objects(repo_files, allow_patterns=list(ADAPTER_FILE_PATTERNS)))

    if ADAPTER_CONFIG_NAME not in repo_files:
        raise NotAFocusAdapterError(
            f"{label} is not a Focus adapter repo: it has no {ADAPTER_CONFIG_NAME} (files: {repo_files[:20]})."
        )
    pickles = [name for name in repo_files if _is_pickle(name)]
    if pickles:
        raise NotAFocusAdapterError(
            f"Refusing {label}: it contains pickle files {pickles}, which can run arbitrary code when loaded. "
            "Focus adapters are safetensors-only."
        )
    if ADAPTER_WEIGHTS_NAME not in repo_files:
        raise NotAFocusAdapterError(f"{label} is not a Focus adapter repo: it has no {ADAPTER_WEIGHTS_NAME}.")
    unsafe = [name for name in wanted if name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/"))]
    if unsafe:
        raise NotAFocusAdapterError(f"Refusing {label}: unsafe file paths {unsafe}.")

    problems: dict[str, str] = {}
    for rel in wanted:
        local = snapshot / rel
        if not local.is_file():
            problems[rel] = "missing from the download"
        elif remote is not None and (reason := _file_mismatch(local, remote[rel])) is not None:
            problems[rel] = reason
    if ADAPTER_WEIGHTS_NAME not in problems:
        try:
            read_safetensors_header(snapshot / ADAPTER_WEIGHTS_NAME)
        except AdapterFileError as error:
            problems[ADAPTER_WEIGHTS_NAME] = f"not a valid safetensors file: {error}"
    if problems:
        _evict_from_cache(snapshot, sorted(problems))
        details = "; ".join(f"{name}: {reason}" for name, reason in sorted(problems.items()))
        raise AdapterIntegrityError(
            f"Download of Focus adapter {label} (commit {commit_hash}) failed verification - {details}. "
            "The corrupt files were removed from the cache; retry the download."
        )

    try:
        _read_focus_config(snapshot / ADAPTER_CONFIG_NAME)
    except _FormatError as error:
        raise NotAFocusAdapterError(f"{label} is not a Focus adapter: {error}.") from None

    if out_dir is None:
        return snapshot
    out_path = Path(out_dir)
    _copy_files(snapshot, wanted, out_path)
    return out_path


# ---------------------------------------------------------------------------------------------- load hook
# Loader keyword arguments that select or fetch the file (what PEFT and transformers hand to hf_hub_download).
_HF_HUB_DOWNLOAD_KWARGS = ("subfolder", "repo_type", "revision", "cache_dir", "force_download", "etag_timeout",
                           "token", "local_files_only", "headers", "endpoint")  # fmt: skip
_SHA1_RE = re.compile(r"[0-9a-f]{40}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def _cached_blob_mismatch(path: Path) -> str | None:
    """Why a file returned by ``hf_hub_download`` does not match the checksum it was cached under, or None.

    The cache stores each download as ``blobs/<etag>``, and the Hub's ETag of a file is its git blob sha1
    (regular files) or its sha256 (LFS files), so the blob name is the checksum the Hub announced for that
    revision; ``huggingface_hub`` itself only checks the size. Caches without symlinks (or other ETag forms)
    cannot be checked this way: None.
    """
    if not path.is_symlink():
        return None
    blob = path.resolve()
    want = blob.name
    if _SHA256_RE.fullmatch(want):
        digest, algo = hashlib.sha256(), "sha256"
    elif _SHA1_RE.fullmatch(want):
        digest, algo = hashlib.sha1(b"blob %d\0" % blob.stat().st_size), "git-sha1"
    else:
        return None
    with blob.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != want:
        return f"its {algo} is {digest.hexdigest()}, the Hub announced {want}"
    return None


def resolve_adapter_weights(repo_id: str, **download_kwargs: Any) -> Path:
    """Download (or find in the cache) a Hub adapter's ``adapter_model.safetensors`` and verify it.

    This is what the Focus tuner runs before injecting an adapter loaded from the Hub by
    ``PeftModel.from_pretrained(model, repo_id, ...)``, ``PeftModel.load_adapter`` or transformers'
    ``model.load_adapter(repo_id, ...)``: the same revision / subfolder / cache / token arguments the loader got
    are used, so the file checked is the file the loader then reads (from the same cache entry).

    Checks: the repo has an ``adapter_model.safetensors`` (pickle-only adapters are refused), the downloaded
    bytes match the checksum the Hub announced (see `_cached_blob_mismatch`), and the file is well-formed
    safetensors (`focus_hf.adapter_files.read_safetensors_header`). A corrupt file is evicted from the cache.

    Args:
        repo_id (`str`): Hub repo id (any id ``huggingface_hub`` accepts).
        **download_kwargs: loader keyword arguments; those of ``hf_hub_download`` (``revision``, ``subfolder``,
            ``cache_dir``, ``token``, ``local_files_only``...) are used, ``use_auth_token`` is read as ``token``,
            the rest are ignored.

    Returns:
        `pathlib.Path`: the verified file in the cache.

    Raises:
        [`focus_hf.adapter_files.AdapterFileError`] (a `ValueError`): no safetensors weights, or a corrupt,
            truncated or tampered download.
        `huggingface_hub` errors (`RepositoryNotFoundError`, `RevisionNotFoundError`, `LocalEntryNotFoundError`...)
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
        path = Path(hf_hub_download(repo_id, ADAPTER_WEIGHTS_NAME, **kwargs))
    except LocalEntryNotFoundError:
        raise
    except EntryNotFoundError:
        raise AdapterFileError(
            f"The Hub adapter {label} has no {ADAPTER_WEIGHTS_NAME}. Focus loads safetensors only and refuses "
            "pickle files (adapter_model.bin), which can run arbitrary code."
        ) from None
    except OSError as error:
        if isinstance(error, HfHubHTTPError) or error.errno is not None:
            raise
        # huggingface_hub raises a bare OSError("Consistency check failed ...") on a short download.
        raise AdapterFileError(f"Download of {ADAPTER_WEIGHTS_NAME} from {label} is incomplete or corrupt: {error}") from error

    problem = _cached_blob_mismatch(path)
    if problem is None:
        try:
            read_safetensors_header(path)
        except AdapterFileError as error:
            problem = str(error)
    if problem is not None:
        blob = path.resolve()
        try:
            path.unlink(missing_ok=True)
            if blob != path and blob.parent.name == "blobs":
                blob.unlink(missing_ok=True)
        except OSError as error:  # pragma: no cover - best effort
            logger.warning("Could not evict corrupt cached file %s: %s", path, error)
        raise AdapterFileError(
            f"{ADAPTER_WEIGHTS_NAME} of the Hub adapter {label} is corrupt, truncated or tampered with: {problem}. "
            "The model was not modified and the file was removed from the cache; retry the download."
        )
    return path
