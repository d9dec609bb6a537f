"""The package layout's rules: no import cycle, the library never imports the CLI, light imports stay light; the
tests' folders mirror the package's."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "focus_hf"
REPO_ROOT = PACKAGE_ROOT.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _import_statements(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at module level, in functions and classes; `if TYPE_CHECKING:` bodies
    (never run) are left out, their `else:` branches kept."""
    found = []
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        children = node.orelse if _is_type_checking_block(node) else ast.iter_child_nodes(node)
        pending.extend(children)
    return found


def _imports(path: Path, module: str) -> set[str]:
    """focus_hf modules that `module` imports, wherever the import statement stands."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    known = _modules()
    for node in _import_statements(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [source] + [f"{source}.{alias.name}" for alias in node.names]
        for name in names:
            if name.startswith("focus_hf"):
                while name and name not in known:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    found.add(name)
    return found


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycle_between_package_modules():
    """Imports inside functions count too: a circle there still ties the two modules into one."""
    graph = {module: _imports(path, module) for module, path in _modules().items()}
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph))}"


def test_import_reader_counts_function_level_imports_but_not_type_checking_blocks(tmp_path):
    source = tmp_path / "example.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from focus_hf import errors\n"
        "if TYPE_CHECKING:\n"
        "    from focus_hf.tuner.model import FocusModel\n"
        "else:\n"
        "    import focus_hf.aliases\n"
        "def load():\n"
        "    from focus_hf.hub.loading import resolve_adapter_weights\n"
        "class Holder:\n"
        "    def method(self):\n"
        "        from focus_hf.fitting import distill\n",
        encoding="utf-8",
    )
    assert _imports(source, "focus_hf.example") == {
        "focus_hf",
        "focus_hf.errors",
        "focus_hf.aliases",
        "focus_hf.hub.loading",
        "focus_hf.fitting",
        "focus_hf.fitting.distill",
    }


def test_package_root_holds_at_most_twelve_modules():
    """Concerns live in folders that name them (attention/, tuner/, fitting/, hub/, interpret/, commands/)."""
    root_modules = sorted(path.name for path in PACKAGE_ROOT.glob("*.py"))
    assert len(root_modules) <= 12, root_modules


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_library_never_imports_the_cli():
    offenders = {
        module: sorted(name for name in _imports(path, module) if name.startswith("focus_hf.commands"))
        for module, path in _modules().items()
        if not module.startswith("focus_hf.commands") and module != "focus_hf.cli"
    }
    assert {module: names for module, names in offenders.items() if names} == {}


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return result.stdout.strip()


def test_import_focus_hf_does_not_import_the_trainer():
    code = "import sys, focus_hf; print('transformers.trainer' in sys.modules)"
    assert _run(code) == "False"


def test_import_focus_hf_then_peft_registers_the_adapter_type():
    code = (
        "import focus_hf\n"
        "from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING\n"
        "from transformers import AttentionInterface\n"
        "print('FOCUS' in PEFT_TYPE_TO_CONFIG_MAPPING, 'focus' in AttentionInterface._global_mapping)"
    )
    assert _run(code) == "True True"


def test_public_names():
    import focus_hf

    for name in focus_hf.__all__:
        assert getattr(focus_hf, name) is not None, name
    assert issubclass(focus_hf.AdapterFileError, (focus_hf.FocusError, ValueError))
    assert issubclass(focus_hf.AdapterIntegrityError, (focus_hf.FocusHubError, OSError))
    from focus_hf import errors

    classes = [value for value in vars(errors).values() if isinstance(value, type) and issubclass(value, Exception)]
    assert all(issubclass(cls, errors.FocusError) for cls in classes)


def test_cli_help_imports_no_heavy_library_and_is_fast():
    code = (
        "import sys, contextlib, io\n"
        "from focus_hf.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    )
    assert _run(code) == "[]"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "focus_hf.cli", "--help"], capture_output=True, check=True, env=env)
    elapsed = time.perf_counter() - started
    if elapsed > 1.0:
        pytest.fail(f"`focus-hf --help` took {elapsed:.2f} s")


@pytest.mark.parametrize("old_name", sorted(__import__("focus_hf").MOVED_MODULES))
def test_moved_module_imports_from_its_old_path_with_a_warning_naming_the_new_one(old_name, monkeypatch):
    import importlib

    import focus_hf

    new_name = focus_hf.MOVED_MODULES[old_name]
    assert not (REPO_ROOT / (old_name.replace(".", "/") + ".py")).exists()  # no shim module left behind
    monkeypatch.delitem(sys.modules, old_name, raising=False)
    script = compile(f"import {old_name}", "old_script.py", "exec")  # an import statement, as a user's script has
    with pytest.warns(DeprecationWarning, match=f"{old_name} moved to {new_name}") as caught:
        exec(script, {})
    assert sys.modules[old_name] is importlib.import_module(new_name)
    assert caught[0].filename == "old_script.py"  # the warning points at the importing line, not at importlib


def test_attention_engines_keep_to_their_folders():
    """The CPU engine (attention/cpu/) and the GPU engine (attention/gpu/) never import each other: what both need
    (the pattern, routing, reference, kernel choice) lives in attention/ itself."""
    engines = {"focus_hf.attention.cpu": "focus_hf.attention.gpu", "focus_hf.attention.gpu": "focus_hf.attention.cpu"}
    crossings = {}
    for module, path in _modules().items():
        for engine, other in engines.items():
            if module.startswith(engine):
                found = sorted(name for name in _imports(path, module) if name.startswith(other))
                if found:
                    crossings[module] = found
    assert crossings == {}


def test_every_package_folder_is_installed():
    """pyproject lists the packages by name: a folder missing there is left out of a non-editable install."""
    import tomllib

    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {_module_name(path) for path in PACKAGE_ROOT.rglob("__init__.py")}
    assert folders - listed == set()


TESTS_ROOT = REPO_ROOT / "tests"
# Folders of tests/ that hold no tests: the helpers every test imports, files tests read, the kernels' C test driver.
NOT_TEST_FOLDERS = {"support", "data", "csrc", "__pycache__"}


def _test_tree_paths(pattern: str) -> list[Path]:
    """Paths under tests/ outside NOT_TEST_FOLDERS and hidden folders, relative to tests/."""
    paths = (path.relative_to(TESTS_ROOT) for path in sorted(TESTS_ROOT.rglob(pattern)))
    return [path for path in paths if not any(part in NOT_TEST_FOLDERS or part.startswith(".") for part in path.parts)]


def test_test_folders_mirror_the_package():
    """Each folder of tests/ tests the package folder of the same path (tests/attention/cpu: focus_hf/attention/cpu);
    the tests of focus_hf's root modules and of the whole project sit in tests/ itself."""
    folders = [path for path in _test_tree_paths("*") if (TESTS_ROOT / path).is_dir()]
    assert folders
    assert [str(folder) for folder in folders if not (PACKAGE_ROOT / folder).is_dir()] == []


def test_test_helpers_live_in_tests_support():
    """A module of tests/ that is not a test file is a helper: it belongs in tests/support/, imported by name."""
    python_files = _test_tree_paths("*.py")
    assert python_files
    helpers = [str(path) for path in python_files if path.name != "conftest.py" and not path.name.startswith("test_")]
    assert helpers == []
