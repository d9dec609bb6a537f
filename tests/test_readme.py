"""The README is one screen, its commands are the ones CI runs, its figures are committed measurements, and its
Python snippets run.

The snippets run as the README shows them, one after the other in one child process (as a reader pastes them into
one session), on a tiny random-weight llama with a word-level tokenizer instead of SmolLM2 and against the loopback
Hub of tests/hub_server.py, offline. What changes for that is the table `SUBSTITUTIONS` below, nothing else: each
entry must occur in the README (so that the table cannot go stale) and is replaced verbatim.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from docs_checks import DOCS_HOOKS, fenced_blocks, figure_tokens
from hub_server import hub_server  # noqa: F401  (pytest fixture)

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
MAX_LINES = 150

sys.path.insert(0, str(DOCS_HOOKS))
import figures  # noqa: E402


def readme() -> str:
    return README.read_text(encoding="utf-8")


def substitutions(tiny_dir: Path, corpus: Path) -> dict[str, str]:
    """README text -> what the test runs instead (a tiny model and corpus; lengths that fit them)."""
    return {
        '"HuggingFaceTB/SmolLM2-135M-Instruct"': repr(str(tiny_dir)),  # the tiny llama + tokenizer of conftest
        '"my_corpus.txt"': repr(str(corpus)),  # conftest's word corpus
        "window=512": "window=8",  # the tiny model's blocks are short
        "4096, max_blocks=4": "64, max_blocks=2",
        "DistillSettings(steps=100)": "DistillSettings(steps=3, queries_per_sequence=32)",
        "max_new_tokens=20": "max_new_tokens=4",
    }


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
    """Every figure in the README's prose and table is one of the values the docs read from the committed JSON."""
    known = {figures.value(name) for name in figures.FIGURES}
    tokens = figure_tokens(readme())
    assert tokens, "the README quotes no figure: the scan is broken"
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


def test_readme_python_snippets_run(hub_server, tiny_dir, text_file, tmp_path):
    text = readme()
    table = substitutions(tiny_dir, text_file)
    for original in table:
        assert original in text, f"substitution {original!r} no longer matches the README: update the table"
    code = "\n\n".join(block for language, block in fenced_blocks(text) if language == "python")
    for call in ("distill_routers(", "PeftModel.from_pretrained(", "push_adapter("):  # the three snippets are there
        assert call in code
    for original, replacement in table.items():
        code = code.replace(original, replacement)
    env = hub_server.subprocess_env(offline=False)
    env["HF_TOKEN"] = "hf_local"
    env["FOCUS_HF_NO_CALIBRATION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    child = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    assert (tmp_path / "my-adapter" / "adapter_model.safetensors").is_file()
    assert "adapter_model.safetensors" in hub_server.list_files("your-name/smollm2-focus")


@pytest.mark.parametrize("text", ["speedup 1.34x and 97.6% in 2.2 MB, passkey 40/40, PPL 1.006"])
def test_figure_scan_sees_figures(text):
    assert figure_tokens(text) == {"1.34x", "97.6%", "2.2 MB", "40/40", "1.006"}
