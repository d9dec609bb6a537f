"""The README is one screen, its commands are the ones CI runs, and its figures are committed measurements (its
Python snippets run in tests/test_snippets.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from docs_checks import DOCS_HOOKS, fenced_blocks, figure_tokens

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
MAX_LINES = 150

sys.path.insert(0, str(DOCS_HOOKS))
import figures  # noqa: E402
import generated  # noqa: E402


def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_readme_fits_one_screen():
    assert len(readme().splitlines()) <= MAX_LINES


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_command():
    commands = [block for language, block in fenced_blocks(readme()) if language == "bash"]
    demo, tests = commands[0].strip(), commands[1].strip()
    assert re.fullmatch(r"pip install .*&&.*focus-hf demo", demo), demo
    assert re.fullmatch(r"pip install .*&&.*python -m pytest -q", tests), tests
    ci_lines = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines, ".ci/run must run the README's test command exactly"
    assert "mkdocs build --strict" in (REPO_ROOT / ".ci" / "run").read_text()


def test_readme_figures_are_committed_measurements():
    """The README's figures are generated parts, written from the committed JSON (tests/test_docs.py checks them
    fresh); any other figure of its prose is one of their values."""
    text = readme()
    assert {"demo.measured", "lc.passkey", "lc.ppl_8k"} <= set(generated.names(text))
    known = {figures.value(name) for name in figures.FIGURES}
    tokens = figure_tokens(text)
    assert not [token for token in tokens if token not in known], f"not from a committed JSON: {tokens - known}"


def test_readme_links_exist():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme()):
        if not target.startswith("http"):
            assert (REPO_ROOT / target).exists(), target


def test_readme_imports_real_modules():
    """The snippets import modules where they live (not through an alias left behind by a move)."""
    code = "\n".join(block for language, block in fenced_blocks(readme()) if language == "python")
    for name in re.findall(r"^\s*(?:from|import) (focus_hf[\w.]*)", code, flags=re.M):
        path = REPO_ROOT.joinpath(*name.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), name


@pytest.mark.parametrize("text", ["speedup 1.34x and 97.6% in 2.2 MB, passkey 40/40, PPL 1.006"])
def test_figure_scan_sees_figures(text):
    assert figure_tokens(text) == {"1.34x", "97.6%", "2.2 MB", "40/40", "1.006"}
