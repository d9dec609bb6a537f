"""Corpora read from Hub dataset repos: ``hf://datasets/ORG/NAME[@REVISION][/PATH]``.

The form is huggingface_hub's own (`HfFileSystem` paths). ``PATH`` is a file or folder of the dataset repo (a split's
files, e.g. ``test.jsonl`` or ``data/test``; the whole repo but its dataset card when left out); it is read as a local
corpus is (`focus_hf.data.load_texts`: ``.jsonl`` with a ``text`` field, or ``.txt`` / ``.md`` / ``.py`` / ``.rst``
files).
The files are downloaded through the huggingface_hub cache and checked against the Hub's checksums, and the corpus is
recorded pinned to the commit it was read at, so that an evaluation names exactly what it measured. A dataset repo
with an ``eval.yaml`` at its root is a Hub benchmark: its task ids are recorded too, for the ``.eval_results/`` files
of the model card (`focus_hf.hub.eval_results`).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Optional

from focus_hf.hub.repo_ids import validate_repo_id, validate_revision

HUB_DATASET_PREFIX = "hf://datasets/"
BENCHMARK_FILE = "eval.yaml"
_SPEC_RE = re.compile(r"hf://datasets/(?P<repo>[^/@]+/[^/@]+)(?:@(?P<revision>[^/]+))?(?:/(?P<path>.*))?")


@dataclasses.dataclass(frozen=True)
class HubDataset:
    """A corpus in a Hub dataset repo: its id, a revision (None: ``main``) and a path in it ("" for all of it)."""

    repo_id: str
    revision: Optional[str] = None
    path: str = ""

    @property
    def spec(self) -> str:
        """The ``hf://datasets/...`` form of this corpus."""
        revision = f"@{self.revision}" if self.revision else ""
        return f"{HUB_DATASET_PREFIX}{self.repo_id}{revision}" + (f"/{self.path}" if self.path else "")


@dataclasses.dataclass(frozen=True)
class HubCorpus:
    """A Hub corpus as downloaded: the dataset pinned to the commit it was read at, the local file or folder holding
    its text (in the huggingface_hub cache), and the task ids of its ``eval.yaml`` when the dataset is a Hub benchmark
    (empty otherwise)."""

    dataset: HubDataset
    path: Path
    benchmark_tasks: list[str]


def parse_hub_dataset(spec: object) -> Optional[HubDataset]:
    """The `HubDataset` that ``spec`` names, or None when it is no ``hf://datasets/`` spec.

    Raises:
        ValueError: an ``hf://datasets/`` spec with an invalid repo id, revision or path.
    """
    text = str(spec)
    if not text.startswith(HUB_DATASET_PREFIX):
        return None
    match = _SPEC_RE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a Hub dataset corpus: expected hf://datasets/ORG/NAME, optionally followed by @REVISION "
            "and /PATH (a file or folder of the dataset repo)."
        )
    path = (match["path"] or "").strip("/")
    if any(part in ("", ".", "..") for part in path.split("/")) and path:
        raise ValueError(f"{text!r}: the path in the dataset repo must not hold empty, '.' or '..' parts.")
    return HubDataset(validate_repo_id(match["repo"]), validate_revision(match["revision"]), path)


def _benchmark_tasks(snapshot: Path) -> list[str]:
    import yaml

    config = snapshot / BENCHMARK_FILE
    if not config.is_file():
        return []
    try:
        data = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError):
        return []
    tasks = data.get("tasks") if isinstance(data, dict) else None
    ids = [task.get("id") for task in tasks or [] if isinstance(task, dict)]
    return [task_id for task_id in ids if isinstance(task_id, str) and task_id]


def fetch_hub_corpus(dataset: HubDataset, *, token: str | bool | None = None) -> HubCorpus:
    """Download (or find in the cache) the files of `dataset` and check them against the Hub's checksums;
    `focus_hf.data.load_texts` reads the result's `path`.

    Raises:
        ValueError: the path is not in the dataset, or a file is not the one the Hub lists.
        huggingface_hub.errors: `RepositoryNotFoundError`, `RevisionNotFoundError`... as raised by huggingface_hub.
    """
    from huggingface_hub import constants, snapshot_download

    from focus_hf.hub.integrity import verify_snapshot

    patterns = [BENCHMARK_FILE] + ([dataset.path, f"{dataset.path}/**"] if dataset.path else ["**"])
    offline = constants.is_offline_mode()
    snapshot = Path(
        snapshot_download(
            dataset.repo_id, repo_type="dataset", revision=dataset.revision, allow_patterns=patterns, token=token,
            local_files_only=offline, ignore_patterns=None if dataset.path else ["README.md", ".gitattributes"],
        )
    )  # fmt: skip
    local = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    verification = verify_snapshot(dataset.repo_id, snapshot, local, repo_type="dataset", token=token, offline=offline)
    if verification.problems:
        details = "; ".join(f"{path}: {why}" for path, why in sorted(verification.problems.items()))
        raise ValueError(f"The Hub dataset {dataset.spec} does not match the Hub's checksums - {details}.")
    target = snapshot / dataset.path if dataset.path else snapshot
    if not target.exists():
        raise ValueError(f"The Hub dataset {dataset.repo_id} has no {dataset.path!r} at commit {snapshot.name}.")
    return HubCorpus(dataclasses.replace(dataset, revision=snapshot.name), target, _benchmark_tasks(snapshot))
