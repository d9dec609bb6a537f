"""Upload a saved Focus adapter folder to the Hub in one commit (`push_adapter`), after checking the folder.

Only the adapter goes up: the files of `ADAPTER_FILE_PATTERNS`; a folder holding pickles or base-model weights is
refused before any request, and the training ``checkpoints/`` folder is skipped.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, CommitOperationDelete, HfApi, constants

from focus_hf.errors import AdapterFolderError, HubPushError
from focus_hf.files import (
    ADAPTER_FILE_PATTERNS,
    CHECKPOINTS_DIR,
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterFileError,
    ConfigFormatError,
    is_base_weight,
    is_pickle,
    matches_adapter_patterns,
    read_focus_config,
    read_safetensors_header,
)
from focus_hf.hub.integrity import transport_errors
from focus_hf.hub.repo_ids import COMMIT_SHA_RE, validate_repo_id, validate_revision

logger = logging.getLogger(__name__)


def _collect_adapter_files(adapter_dir: str | os.PathLike[str]) -> dict[str, bytes]:
    """Validate an adapter folder and read the files to upload (path in repo -> bytes)."""
    folder = Path(adapter_dir)
    if not folder.is_dir():
        raise AdapterFolderError(f"Adapter folder {str(folder)!r} does not exist or is not a directory.")
    for required in (CONFIG_NAME, WEIGHTS_NAME):
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
    root = folder.resolve()
    outside = sorted(
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if path.is_symlink() and not path.resolve().is_relative_to(root)
    )
    if outside:
        raise AdapterFolderError(
            f"Refusing to push {str(folder)!r}: {outside} are symbolic links to files outside the folder. Push "
            "never follows a link out of the adapter folder; copy the files in if they belong to the adapter."
        )
    pickles: list[str] = []
    base_weights: list[str] = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        parts = rel.split("/")
        if any(part.startswith(".") for part in parts) or not path.is_file():
            continue  # hidden files/folders (.git, .cache) are never uploaded
        if len(parts) > 1 and parts[0] == CHECKPOINTS_DIR:
            continue
        if is_pickle(path.name):
            pickles.append(rel)
        elif is_base_weight(path.name):
            base_weights.append(rel)
    if pickles:
        raise AdapterFolderError(
            f"Refusing to push {str(folder)!r}: it contains pickle files {pickles}. Pickles can run arbitrary code "
            "when loaded; Focus adapters are safetensors-only. Remove them (or push from a clean folder)."
        )
    if base_weights:
        raise AdapterFolderError(
            f"Refusing to push {str(folder)!r}: it contains base-model weight files {base_weights}. Only the "
            f"adapter ({WEIGHTS_NAME}) is pushed; push from a folder holding just the saved adapter."
        )
    try:
        read_focus_config(folder / CONFIG_NAME)
    except ConfigFormatError as error:
        raise AdapterFolderError(f"Refusing to push {str(folder)!r}: {error}.") from None
    try:
        read_safetensors_header(folder / WEIGHTS_NAME)
    except AdapterFileError as error:
        raise AdapterFolderError(
            f"Refusing to push {str(folder)!r}: {WEIGHTS_NAME} is not a valid safetensors file: {error}"
        ) from None

    files: dict[str, bytes] = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or not path.is_file():
            continue
        if matches_adapter_patterns(path.name):
            files[path.name] = path.read_bytes()
        else:
            logger.info("Not pushing %s: only %s files are part of a Focus adapter.", path.name, ADAPTER_FILE_PATTERNS)
    return files


def _remote_adapter_files(api: HfApi, repo_id: str, revision: str) -> list[str]:
    """Top-level files matching `ADAPTER_FILE_PATTERNS` on `revision` (none when the branch does not exist yet)."""
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        names = api.list_repo_files(repo_id, revision=revision, repo_type="model")
    except RevisionNotFoundError:
        return []
    return [name for name in names if "/" not in name and matches_adapter_patterns(name)]


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
    The branch mirrors the folder: adapter files (those patterns) on the branch that the folder no longer has
    are deleted in the same commit; other files of the repo are left alone. Symbolic links out of the folder are
    refused. Files identical to the ones already on the branch are not re-uploaded; if nothing changed, no
    commit is created and the current head is returned. The folder is only read, never modified.

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
    revision = validate_revision(revision)
    if revision is not None and COMMIT_SHA_RE.fullmatch(revision):
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
        step = "listing the files already on the branch"
        operations: list = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=data) for name, data in files.items()]
        # The repo mirrors the folder: adapter files the folder no longer has (a chart from an earlier push) go.
        operations += [
            CommitOperationDelete(path_in_repo=name)
            for name in _remote_adapter_files(api, repo_id, target)
            if name not in files
        ]
        step = "committing"
        commit = api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or "Upload Focus adapter",
            repo_type="model",
            revision=revision,
            create_pr=create_pr,
        )
    except transport_errors() as error:
        status = getattr(getattr(error, "response", None), "status_code", None)
        answer = f"HTTP {status}" if status is not None else type(error).__name__
        raise HubPushError(
            f"Pushing {str(adapter_dir)!r} to {repo_id!r} (revision {target!r}) failed while {step}: the Hub "
            f"answered {answer}. The local folder was not modified; the push can be retried.\nHub error: {error}"
        ) from error
    logger.info("Pushed Focus adapter %s to %s@%s: %s", adapter_dir, repo_id, target, commit.oid)
    return commit
