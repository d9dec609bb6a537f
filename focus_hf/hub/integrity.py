"""Checksums of downloaded adapter files against what the Hub announced, and eviction of corrupt cache entries.

``huggingface_hub`` only checks that a download has the announced size. The Hub lists, per file of a commit, the
git blob sha1 (regular files) or the sha256 of the content (LFS files); the cache also names each blob after the
ETag it was served with, which is one of those two checksums. These helpers compare the bytes on disk with either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from pathlib import Path

from huggingface_hub import HfApi, RepoFile

logger = logging.getLogger(__name__)

_SHA1_RE = re.compile(r"[0-9a-f]{40}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    """One file of the Hub's listing of a commit."""

    size: int
    blob_id: str  # git blob sha1 (of the LFS pointer for LFS files)
    sha256: str | None = None  # LFS files only: sha256 of the content


def file_digest(path: Path, algo: str) -> str:
    """Hex digest of a file's content as the Hub states it: ``"sha256"`` (LFS files) or ``"git-sha1"`` (the git
    blob id: sha1 of ``b"blob <size>\\0"`` followed by the content)."""
    if algo == "sha256":
        digest = hashlib.sha256()
    elif algo == "git-sha1":
        digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    else:
        raise ValueError(f"Unknown checksum {algo!r}: expected 'sha256' or 'git-sha1'.")
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_remote_tree(
    storage_folder: Path, commit_hash: str, api: HfApi | None, repo_id: str
) -> dict[str, RemoteFile] | None:
    """The Hub's listing (size + checksums) of the repo at ``commit_hash``.

    ``snapshot_download`` stores it in ``<repo cache>/trees/<commit>.json`` (``format_version`` 1, documented in
    ``huggingface_hub._tree_cache``); read it from there so verification also works offline. Online, fall back to
    ``HfApi.list_repo_tree``. Returns None if neither is available.
    """
    try:
        data = json.loads((storage_folder / "trees" / f"{commit_hash}.json").read_text(encoding="utf-8"))
        if data.get("format_version") == 1:
            return {
                path: RemoteFile(
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
            entry.path: RemoteFile(
                size=int(entry.lfs.size if entry.lfs else entry.size),
                blob_id=entry.blob_id,
                sha256=entry.lfs.sha256 if entry.lfs else None,
            )
            for entry in api.list_repo_tree(repo_id, revision=commit_hash, recursive=True, repo_type="model")
            if isinstance(entry, RepoFile)
        }
    except transport_errors():
        return None


def file_mismatch(path: Path, expected: RemoteFile) -> str | None:
    """Why ``path`` does not match the Hub's listing, or None if it does."""
    size = path.stat().st_size
    if size != expected.size:
        return f"size {size} bytes, the Hub lists {expected.size}"
    algo, want = ("sha256", expected.sha256) if expected.sha256 is not None else ("git-sha1", expected.blob_id)
    got = file_digest(path, algo)
    if got != want:
        return f"{algo} {got}, the Hub lists {want}"
    return None


def cached_blob_mismatch(path: Path) -> str | None:
    """Why a file returned by ``hf_hub_download`` does not match the checksum it was cached under, or None.

    The cache stores each download as ``blobs/<etag>``, and the Hub's ETag of a file is its git blob sha1
    (regular files) or its sha256 (LFS files), so the blob name is the checksum the Hub announced for that
    revision. Caches without symlinks (or other ETag forms) cannot be checked this way: None.
    """
    if not path.is_symlink():
        return None
    blob = path.resolve()
    want = blob.name
    if _SHA256_RE.fullmatch(want):
        algo = "sha256"
    elif _SHA1_RE.fullmatch(want):
        algo = "git-sha1"
    else:
        return None
    got = file_digest(blob, algo)
    if got != want:
        return f"its {algo} is {got}, the Hub announced {want}"
    return None


def evict_cached_file(entry: Path) -> None:
    """Remove a corrupt cached file so that the next online download fetches it again: the snapshot entry and,
    when it links into the same repo cache's ``blobs/``, the blob (best effort: failures are logged)."""
    try:
        if entry.is_symlink():
            blob = entry.resolve()
            entry.unlink()
            # Only a blob of this repo's cache; a link elsewhere (a hand-made cache) is not followed to delete.
            if blob.parent.name == "blobs" and blob.parent.parent in entry.parent.resolve().parents:
                blob.unlink(missing_ok=True)
        elif entry.exists():
            entry.unlink()
    except OSError as error:  # pragma: no cover - best effort
        logger.warning("Could not evict corrupt cached file %s: %s", entry, error)


def transport_errors() -> tuple[type[BaseException], ...]:
    """The errors a Hub request can raise: `OSError` (huggingface_hub's `HfHubHTTPError` is one) and the base
    error of the HTTP client this huggingface_hub version uses (httpx in 1.x, httpx2 later), read from
    huggingface_hub itself so that focus_hf imports no client of its own."""
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import _http

    errors: list[type[BaseException]] = [OSError, HfHubHTTPError]
    for client_name in ("httpx2", "httpx", "requests"):
        client = getattr(_http, client_name, None)
        for error_name in ("HTTPError", "RequestException", "TransportError"):
            error = getattr(client, error_name, None)
            if isinstance(error, type) and issubclass(error, BaseException):
                errors.append(error)
    return tuple(errors)
