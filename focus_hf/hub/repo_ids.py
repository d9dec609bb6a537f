"""Validation of Hub repo ids and revisions, before any request is made.

Stricter than ``huggingface_hub``'s own check: the namespace is required and local paths or URLs passed where a
repo id is expected (a common mistake: the adapter folder) are refused with a message that says so.
"""

from __future__ import annotations

import os
import re

from focus_hf.errors import InvalidRepoIdError

# One part of a Hub id (`namespace` or `name`), as the Hub accepts it.
REPO_PART_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
COMMIT_SHA_RE = re.compile(r"[0-9a-f]{40}")


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
        if not REPO_PART_RE.fullmatch(part):
            raise InvalidRepoIdError(
                f"Invalid repo_id {repo_id!r}: {part!r} must be 1-96 ASCII letters, digits, '-', '_' or '.', "
                f"starting and ending with a letter or digit. {hint}"
            )
        if "--" in part or ".." in part:
            raise InvalidRepoIdError(f"Invalid repo_id {repo_id!r}: '--' and '..' are not allowed. {hint}")
    if repo_id.endswith(".git"):
        raise InvalidRepoIdError(f"Invalid repo_id {repo_id!r}: it must not end with '.git'. {hint}")
    return repo_id


def validate_revision(revision: str | None) -> str | None:
    """Check a branch, tag or commit sha (None: the default branch) and return it unchanged.

    Raises:
        `ValueError`: empty, not a str, whitespace or control characters, empty / ``.`` / ``..`` path parts, or
            longer than 256 characters.
    """
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
