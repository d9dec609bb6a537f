"""The package layout's rules: no import cycle, the library never imports the CLI, light imports stay light."""

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


def _imports(path: Path, module: str, *, top_level_only: bool) -> set[str]:
    """focus_hf modules imported by `module` (module-level statements only when `top_level_only`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = []
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.If) and top_level_only:  # `if TYPE_CHECKING:` blocks are not run
            continue
        nodes.append(node)
    found = set()
    known = _modules()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [source] + [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
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
    graph = {module: _imports(path, module, top_level_only=True) for module, path in _modules().items()}
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph))}"


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_library_never_imports_the_cli():
    offenders = {
        module: sorted(
            name for name in _imports(path, module, top_level_only=False) if name.startswith("focus_hf.commands")
        )
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
