"""Upload a saved Focus adapter folder to the Hub in one commit (`push_adapter`), after checking the folder.

Only the adapter goes up: the files of `ADAPTER_FILE_PATTERNS` and the ``.eval_results/*.yaml`` files of the Hub's
evaluation-results format; a folder holding pickles or base-model weights is refused before any request, and the
training ``checkpoints/`` folder is skipped. A push adds and updates files; it deletes files of the repo only when
asked (`plan_push` lists them first), and a README edited on the Hub keeps its edits (`focus_hf.hub.cards`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, CommitOperationDelete, HfApi, constants
from huggingface_hub.utils import filter_repo_objects

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
from focus_hf.hub.cards import hand_written_parts, update_card
from focus_hf.hub.integrity import transport_errors
from focus_hf.hub.repo_ids import COMMIT_SHA_RE, validate_repo_id, validate_revision

logger = logging.getLogger(__name__)

# The Hub's evaluation-results files (https://huggingface.co/docs/hub/eval-results), pushed with the adapter.
EVAL_RESULTS_PATTERN = ".eval_results/*.yaml"
README_NAME = "README.md"


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
    for path in sorted(folder.glob(EVAL_RESULTS_PATTERN)):
        if path.is_file() and not path.is_symlink():
            files[path.relative_to(folder).as_posix()] = path.read_bytes()
    return files


def _is_pushed_file(path: str) -> bool:
    """Whether a repo path is one push manages: a top-level adapter file or an evaluation-results file."""
    if "/" not in path:
        return matches_adapter_patterns(path)
    return bool(list(filter_repo_objects([path], allow_patterns=[EVAL_RESULTS_PATTERN])))


@dataclasses.dataclass
class PushPlan:
    """What a push will do to a branch, worked out before it commits (`plan_push`).

    Attributes:
        repo_id, branch: where it commits; `head` is the branch's commit it was planned against (None: new branch).
        uploads: repo path -> the bytes to upload (new or changed files; files equal to the branch's are left out).
        unchanged: files of the folder the branch already holds as they are.
        deletions: files of the branch the folder lacks that the push deletes (only with `delete=True`).
        kept: files of the branch the folder lacks that the push leaves in place.
        readme_note: what was done with a README.md edited on the Hub (None when nothing was to say).
    """

    repo_id: str
    branch: str
    head: str | None
    uploads: dict[str, bytes]
    unchanged: list[str]
    deletions: list[str]
    kept: list[str]
    readme_note: str | None = None


def _readme_to_push(local: bytes, remote: bytes | None, overwrite: bool, where: str) -> tuple[bytes, str | None]:
    """The README.md to upload and what to say about it: the local one, or the Hub's with the local card's metadata
    and generated sections applied when the Hub's carries edits the local one lacks."""
    if remote is None or remote == local:
        return local, None
    local_text, remote_text = local.decode("utf-8"), remote.decode("utf-8", errors="replace")
    try:
        edited = hand_written_parts(remote_text) != hand_written_parts(local_text)
    except ValueError:
        edited = True  # the Hub's card does not parse: someone wrote it by hand
    if not edited:
        return local, None
    if overwrite:
        return local, (
            f"README.md on {where} differed from the local card outside the sections focus-hf generates (edited on "
            "the Hub?); it was replaced by the local README.md, as asked (overwrite_readme)."
        )
    try:
        merged = update_card(remote_text, local_text)
    except ValueError as error:
        raise AdapterFolderError(
            f"README.md on {where} was edited and cannot be merged with the local card ({error}); push with "
            "overwrite_readme=True (--overwrite-readme) to replace it, or fix it on the Hub first."
        ) from None
    return merged.encode("utf-8"), (
        f"README.md on {where} holds edits the local card lacks (made on the Hub?): they were kept, and only the "
        "metadata and the sections focus-hf generates were updated from the local README.md. Pull the adapter to "
        "get the merged card, or push with overwrite_readme=True (--overwrite-readme) to replace it."
    )


def plan_push(
    adapter_dir: str | os.PathLike[str],
    repo_id: str,
    *,
    revision: str | None = None,
    delete: bool = False,
    overwrite_readme: bool = False,
    token: str | bool | None = None,
) -> PushPlan:
    """Work out what `push_adapter` would do, without changing anything: the folder is checked (as by
    `push_adapter`) and the branch read, if the repo exists. The arguments are those of `push_adapter`.

    Raises:
        AdapterFolderError: the folder is refused, as by `push_adapter`; a Hub error while reading the branch is
            raised as huggingface_hub raises it.
    """
    repo_id = validate_repo_id(repo_id)
    branch = _branch(revision)
    files = _collect_adapter_files(adapter_dir)
    return _plan(HfApi(token=token), files, repo_id, branch, delete=delete, overwrite_readme=overwrite_readme)


def _branch(revision: str | None) -> str:
    revision = validate_revision(revision)
    if revision is not None and COMMIT_SHA_RE.fullmatch(revision):
        raise ValueError(f"revision must be a branch name to commit to, not a commit sha ({revision!r}).")
    return revision or constants.DEFAULT_REVISION


def _plan(
    api: HfApi, files: dict[str, bytes], repo_id: str, branch: str, *, delete: bool, overwrite_readme: bool
) -> PushPlan:
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = api.repo_info(repo_id, revision=branch, repo_type="model", files_metadata=True)
    except (RepositoryNotFoundError, RevisionNotFoundError):
        info = None
    remote = {sibling.rfilename: sibling.blob_id for sibling in (info.siblings or [])} if info is not None else {}
    plan = PushPlan(repo_id, branch, info.sha if info is not None else None, {}, [], [], [])
    files = dict(files)
    if README_NAME in files and README_NAME in remote:
        remote_readme = Path(api.hf_hub_download(repo_id, README_NAME, revision=plan.head, repo_type="model"))
        files[README_NAME], plan.readme_note = _readme_to_push(
            files[README_NAME], remote_readme.read_bytes(), overwrite_readme, f"{repo_id}@{branch}"
        )
    for path, data in files.items():
        if remote.get(path) == _git_blob_id(data):
            plan.unchanged.append(path)
        else:
            plan.uploads[path] = data
    missing = sorted(path for path in remote if _is_pushed_file(path) and path not in files)
    (plan.deletions if delete else plan.kept).extend(missing)
    return plan


def _git_blob_id(data: bytes) -> str:
    import hashlib

    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _landed(api: HfApi, plan: PushPlan) -> str | None:
    """After a commit whose answer was lost: the branch's new commit if it holds exactly this push, else None."""
    info = api.repo_info(plan.repo_id, revision=plan.branch, repo_type="model", files_metadata=True)
    if info.sha == plan.head:
        return None
    remote = {sibling.rfilename: sibling.blob_id for sibling in (info.siblings or [])}
    complete = all(remote.get(path) == _git_blob_id(data) for path, data in plan.uploads.items())
    return info.sha if complete and not any(path in remote for path in plan.deletions) else None


def push_adapter(
    adapter_dir: str | os.PathLike[str],
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool | None = None,
    commit_message: str | None = None,
    token: str | bool | None = None,
    create_pr: bool = False,
    delete: bool = False,
    overwrite_readme: bool = False,
) -> CommitInfo:
    """Upload a saved Focus adapter folder to the Hub in a single commit.

    Uploads the top-level ``adapter_config.json``, ``adapter_model.safetensors``, ``README.md`` and any
    ``*.json`` / ``*.png`` / ``*.html`` (interpretability files such as ``group_balance.png``) of ``adapter_dir``, and
    its ``.eval_results/*.yaml`` (the Hub's evaluation results); other files are skipped, and so is the training
    ``checkpoints/`` folder (with a logged warning). Symbolic links out of the folder are refused.

    The push adds and updates files. Files of the branch that the folder lacks stay, unless ``delete=True``: then the
    adapter files among them (those patterns) are deleted in the same commit, listed in a warning first. A README.md
    edited on the Hub (hand-written text or metadata the local card lacks) keeps its edits: the local card's metadata
    and generated sections are applied to it, with a warning, unless ``overwrite_readme=True``. Files identical to the
    branch's are not re-uploaded; if nothing changed, no commit is made and the current head is returned. The commit
    names the branch head it was planned against (``parent_commit``), so a branch moved meanwhile is refused rather
    than overwritten; a connection cut mid-commit leaves the branch as it was or holding the whole push, and the
    error says which. The folder is only read, never modified.

    Args:
        adapter_dir (`str` or `os.PathLike`): folder written by ``peft_model.save_pretrained``.
        repo_id (`str`): ``namespace/name`` (see [`validate_repo_id`]).
        revision (`str`, *optional*): branch to commit to (created from ``main`` if missing). Defaults to ``main``.
        private (`bool`, *optional*): visibility of the repo if it is created; None (the default) leaves it to the
            Hub (public, unless the organisation makes new repos private). An existing repo keeps its visibility.
        commit_message (`str`, *optional*): defaults to ``"Upload Focus adapter"``.
        token (`str` or `bool`, *optional*): Hub token; defaults to the locally saved one (``huggingface_hub``).
        create_pr (`bool`, defaults to `False`): open a pull request against ``revision`` instead of committing.
        delete (`bool`, defaults to `False`): also delete the branch's adapter files that the folder lacks.
        overwrite_readme (`bool`, defaults to `False`): replace a README.md edited on the Hub by the local one.

    Returns:
        [`huggingface_hub.CommitInfo`]: a `str` (the commit URL) with ``.oid`` (commit sha) and, with
        ``create_pr=True``, ``.pr_url`` / ``.pr_revision``.

    Raises:
        [`InvalidRepoIdError`]: bad ``repo_id``.
        [`AdapterFolderError`]: missing adapter files, pickle or base-model weight files in the folder, config
            whose ``peft_type`` is not ``FOCUS``, or invalid safetensors weights. Nothing is sent to the Hub.
        [`HubPushError`]: the Hub failed (HTTP error, connection cut); the message says whether the push landed.
        `ValueError`: invalid ``revision`` (e.g. a commit sha: commits go to branches).
    """
    repo_id = validate_repo_id(repo_id)
    target = _branch(revision)
    files = _collect_adapter_files(adapter_dir)  # a bad folder is refused before any request
    api = HfApi(token=token)  # endpoint read from huggingface_hub.constants now, not at import
    step = "creating the repo"
    plan = None
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        if target != constants.DEFAULT_REVISION and not target.startswith("refs/pr/"):
            step = f"creating branch {target!r}"
            api.create_branch(repo_id, branch=target, repo_type="model", exist_ok=True)
        step = "reading the branch"
        plan = _plan(api, files, repo_id, target, delete=delete, overwrite_readme=overwrite_readme)
        if plan.readme_note:
            logger.warning(plan.readme_note)
        if plan.deletions:
            logger.warning("Deleting from %s@%s (the folder lacks them): %s", repo_id, target,
                           ", ".join(plan.deletions))  # fmt: skip
        if plan.kept:
            logger.info("Left on %s@%s (the folder lacks them; delete=True removes them): %s", repo_id, target,
                        ", ".join(plan.kept))  # fmt: skip
        operations: list = [
            CommitOperationAdd(path_in_repo=path, path_or_fileobj=data) for path, data in plan.uploads.items()
        ]
        operations += [CommitOperationDelete(path_in_repo=path) for path in plan.deletions]
        step = "committing"
        commit = api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or "Upload Focus adapter",
            repo_type="model",
            revision=revision,
            create_pr=create_pr,
            parent_commit=plan.head,
        )
    except transport_errors() as error:
        raise HubPushError(_push_failure(api, plan, adapter_dir, repo_id, target, step, create_pr, error)) from error
    logger.info("Pushed Focus adapter %s to %s@%s: %s", adapter_dir, repo_id, target, commit.oid)
    return commit


def _push_failure(api, plan, adapter_dir, repo_id, target, step, create_pr, error) -> str:
    """The message of a failed push: where it failed, what the Hub answered, and what the branch now holds."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    broke = f"the connection broke ({type(error).__name__})"
    answer = f"the Hub answered HTTP {status}" if status is not None else broke
    state = "Nothing was committed; the push can be retried."
    if step == "committing" and status is None and plan is not None and not create_pr:
        try:
            landed = _landed(api, plan)
        except transport_errors():
            state = (
                f"Whether the commit landed is unknown (the Hub cannot be reached now): {repo_id}@{target} either is "
                f"still at {plan.head} or holds this whole push as one commit. Check it, then retry."
            )
        else:
            state = (
                f"The commit landed all the same: {repo_id}@{target} is at {landed}, holding this whole push."
                if landed
                else f"Nothing was committed: {repo_id}@{target} is still at {plan.head}; the push can be retried."
            )
    elif status == 412:
        state = f"{repo_id}@{target} moved while pushing; nothing was committed. Push again to commit on its new head."
    return (
        f"Pushing {str(adapter_dir)!r} to {repo_id!r} (revision {target!r}) failed while {step}: {answer}. {state} "
        f"The local folder was not modified.\nHub error: {error}"
    )
