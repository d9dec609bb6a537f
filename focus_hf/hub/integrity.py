"""Checks that downloaded files are the bytes the Hub lists for their commit, through huggingface_hub's public API.

Online, `HfApi.verify_repo_checksums` compares the files of a cached snapshot with the checksums of the Hub's listing
of that commit (the git blob sha1 of a regular file, the sha256 of an LFS file). Offline that listing cannot be
fetched; the cache still files each download under the checksum the Hub announced for it (the cache layout that
huggingface_hub documents: ``snapshots/<commit>/<path>`` links to ``blobs/<etag>``), and a file is compared with that
name. A cache without symbolic links (copies instead) keeps no such name: then the check cannot run, and the result
says so (`SnapshotVerification.unverified`) for the caller to warn or refuse.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from collections.abc import Sequence
from pathlib import Path

from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError

logger = logging.getLogger(__name__)

_SHA1_RE = re.compile(r"[0-9a-f]{40}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class SnapshotVerification:
    """What `verify_snapshot` found for the files asked about.

    Attributes:
        commit: the commit of the snapshot.
        problems: path -> why it is not the file the Hub lists (a checksum mismatch, missing, not in the listing).
        unverified: paths whose checksum could not be compared (offline, in a cache without symbolic links).
        remote_files: every file of the commit on the Hub (online), or None (offline: the listing is not known).
    """

    commit: str
    problems: dict[str, str]
    unverified: list[str]
    remote_files: list[str] | None


def transport_errors() -> tuple[type[BaseException], ...]:
    """The errors a Hub request can raise: `OSError` (huggingface_hub's `HfHubHTTPError` is one) and the base error of
    the HTTP client this huggingface_hub version uses (a connection cut mid-transfer), read off `HfHubHTTPError`'s own
    bases so that focus_hf imports no HTTP client and no private module of huggingface_hub."""
    client_errors = [
        base
        for base in HfHubHTTPError.__mro__[1:]
        if base.__name__ == "HTTPError" and not base.__module__.startswith("huggingface_hub")
    ]
    return (OSError, HfHubHTTPError, *client_errors)


def snapshot_commit(path: Path) -> tuple[Path, str]:
    """(the snapshot folder, its commit) of a file that `hf_hub_download` returned (``.../snapshots/<commit>/...``)."""
    for parent in path.parents:
        if parent.parent.name == "snapshots":
            return parent, parent.name
    raise ValueError(f"{path} is not a file of a huggingface_hub cache snapshot.")


def _digest(path: Path, algorithm: str) -> str:
    digest = hashlib.sha256() if algorithm == "sha256" else hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _cached_blob_problem(path: Path) -> str | None:
    """Why a cached file does not match the checksum its blob is named after; "" when the name is no checksum (the
    check cannot run); None when it matches."""
    if not path.is_symlink():
        return ""
    blob = path.resolve()
    algorithm = "sha256" if _SHA256_RE.fullmatch(blob.name) else "git-sha1" if _SHA1_RE.fullmatch(blob.name) else None
    if algorithm is None:
        return ""
    actual = _digest(blob, algorithm)
    return None if actual == blob.name else f"its {algorithm} is {actual}, the Hub announced {blob.name}"


def verify_snapshot(
    repo_id: str,
    snapshot: Path,
    paths: Sequence[str],
    *,
    repo_type: str = "model",
    token: str | bool | None = None,
    offline: bool = False,
    endpoint: str | None = None,
) -> SnapshotVerification:
    """Compare `paths` (relative to the cached `snapshot` folder of `repo_id`) with the checksums the Hub lists.

    Online the Hub's listing of the snapshot's commit is fetched (`HfApi.verify_repo_checksums`); offline each file is
    compared with the checksum its cached blob is named after.

    Raises:
        The transport errors of `transport_errors` when the Hub's listing cannot be fetched online.
    """
    commit = snapshot.name
    local = {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()}
    problems = {path: "missing from the download" for path in paths if path not in local}
    if offline:
        unverified = []
        for path in paths:
            if path in problems:
                continue
            problem = _cached_blob_problem(snapshot / path)
            if problem == "":
                unverified.append(path)
            elif problem is not None:
                problems[path] = problem
        return SnapshotVerification(commit, problems, unverified, None)
    api = HfApi(endpoint=endpoint, token=token)
    if not snapshot.is_dir():  # nothing of the commit was downloaded (no file matched): only the listing matters
        remote = api.list_repo_files(repo_id, repo_type=repo_type, revision=commit)
        return SnapshotVerification(commit, problems, [], sorted(remote))
    result = api.verify_repo_checksums(
        repo_id, repo_type=repo_type, revision=commit, cache_dir=snapshot.parents[2], token=token
    )
    for mismatch in result.mismatches:
        if mismatch["path"] in paths:
            problems[mismatch["path"]] = (
                f"{mismatch['algorithm']} {mismatch['actual']}, the Hub lists {mismatch['expected']}"
            )
    for path in result.extra_paths:
        if path in paths:
            problems[path] = f"not a file of commit {commit} on the Hub"
    remote = sorted((local - set(result.extra_paths)) | set(result.missing_paths))
    return SnapshotVerification(commit, problems, [], remote)


def evict_cached_file(entry: Path) -> None:
    """Remove a corrupt cached file so that the next online download fetches it again: the snapshot entry and, when
    it links into the same repo cache's ``blobs/``, the blob (best effort: failures are logged)."""
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
