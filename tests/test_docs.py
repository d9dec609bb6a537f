"""The documentation site: its figures come from committed JSON only, its generated pages match the code, and its
plots draw. (`mkdocs build --strict` in .ci/run checks links and API references; this needs no mkdocs.)"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest
from docs_checks import DOCS, DOCS_HOOKS, REPO_ROOT, fenced_blocks, figure_tokens

sys.path.insert(0, str(DOCS_HOOKS))
import figures  # noqa: E402
import placeholders  # noqa: E402
import plots  # noqa: E402
import reference  # noqa: E402

PAGES = sorted(path for path in DOCS.rglob("*.md") if DOCS_HOOKS not in path.parents)
MKDOCS_YML = (REPO_ROOT / "mkdocs.yml").read_text()


def page_id(path: Path) -> str:
    return path.relative_to(DOCS).as_posix()


def test_every_page_is_in_the_navigation():
    assert PAGES
    for path in PAGES:
        assert f": {page_id(path)}" in MKDOCS_YML, f"{page_id(path)} is not in mkdocs.yml's nav"


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_pages_write_figures_only_through_placeholders(path):
    """A measured figure in a page must be a `{{ placeholder }}`, filled from the committed JSON at build time."""
    assert figure_tokens(path.read_text(encoding="utf-8")) == set()


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_placeholders_resolve(path):
    text = path.read_text(encoding="utf-8")
    rendered = placeholders.render(text)
    assert not placeholders.names(rendered)
    for name in placeholders.names(text):
        assert placeholders.expand(name).strip(), name


def test_figure_scan_catches_a_literal_figure():
    assert figure_tokens("prefill 1.34x faster, 97.6% kept, `1.5x in code` and {{ lc.ppl_8k }}") == {"1.34x", "97.6%"}


def test_figures_are_values_of_the_committed_json():
    """Spot checks of the registry against the raw JSON, independently of its helpers."""
    import json

    rows = json.loads((REPO_ROOT / figures.ATTENTION).read_text())
    (row,) = [r for r in rows if r["seq_len"] == 65536 and r["top_k"] == 1]
    assert figures.value("attn.top1_64k") == f"{row['speedup']:.2f}x"
    log = json.loads((REPO_ROOT / figures.LC_ADAPTER_LOG).read_text())
    assert figures.value("adapter.parameters") == f"{log['trainable_parameters']:,}"
    cases = [r for r in json.loads((REPO_ROOT / figures.LC_PASSKEY).read_text()) if r["variant"] == figures.AS_SAVED]
    assert figures.value("lc.passkey") == f"{sum(c['correct'] for c in cases[0]['cases'])}/{len(cases[0]['cases'])}"
    for name in figures.names():
        assert figures.value(name), name  # every registered figure and table reads its file


def test_unknown_placeholder_fails():
    with pytest.raises(KeyError, match="no figure or table"):
        placeholders.render("{{ attn.top1_1m }}")


def test_architecture_lists_exactly_the_package_tree():
    """One row per folder of focus_hf/ (and per root module), each with its docstring's description."""
    package = REPO_ROOT / "focus_hf"
    folders = sorted(p.name for p in package.iterdir() if p.is_dir() and p.name != "__pycache__")
    modules = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")
    rows = re.findall(r"^\| `([^`]+)` \| (.*) \|$", reference.architecture_table(), flags=re.M)
    assert [name for name, _ in rows] == [f"{folder}/" for folder in folders] + modules
    assert all(description.strip() for _, description in rows), "a folder or module without a docstring"
    assert "{{ architecture }}" in (DOCS / "architecture.md").read_text()


def test_cli_reference_covers_every_command_and_option():
    from focus_hf.cli import COMMAND_MODULES, build_parser

    text = reference.cli_reference(build_parser())
    assert reference.cli_commands() == list(COMMAND_MODULES)
    for name, sub in reference._subcommands(build_parser()).items():
        section = text.split(f"## `focus-hf {name}`", 1)[1].split("\n## ", 1)[0]
        for action in sub._actions:
            if action.help != argparse.SUPPRESS and action.dest != "help":
                shown = action.option_strings[0] if action.option_strings else (action.metavar or action.dest)
                assert f"`{shown}" in section, f"focus-hf {name}: {shown} missing from the CLI reference"
    assert "{{ cli.reference }}" in (DOCS / "cli.md").read_text()


def test_module_paths_of_the_docs_exist():
    """Every module the docs name by key, and every focus_hf import in their code, is a real source file."""
    for key, dotted in reference.MODULES.items():
        assert reference.module_file(dotted).is_file(), key
    for path in PAGES:
        code = "\n".join(block for _, block in fenced_blocks(placeholders.render(path.read_text(encoding="utf-8"))))
        for name in re.findall(r"^\s*from (focus_hf[\w.]*) import", code, flags=re.M):
            assert reference.module_file(name), f"{page_id(path)}: {name}"


@pytest.mark.parametrize("name", sorted(plots.PLOTS))
def test_plots_draw_from_the_committed_json(name, tmp_path):
    from png_checks import assert_png

    path = tmp_path / name
    path.write_bytes(plots.PLOTS[name]())
    assert_png(path, min_size=(600, 300))


def test_docs_links_to_images_exist():
    """Images a page shows are files of docs/, generated plots (img/) or committed benchmark files."""
    for path in PAGES:
        for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", path.read_text(encoding="utf-8")):
            if target.startswith("img/"):
                assert target.removeprefix("img/") in plots.PLOTS, target
            else:
                assert (path.parent / target).is_file() or (REPO_ROOT / target).is_file(), f"{page_id(path)}: {target}"


def test_gpu_speed_is_reported_as_not_measured_while_no_gpu_json_is_committed():
    results = REPO_ROOT / "benchmarks" / "results"
    if any("gpu" in path.relative_to(results).as_posix() for path in results.rglob("*.json")):
        pytest.skip("GPU measurements are committed: the docs should read them like the CPU ones")
    for page in ("index.md", "performance.md", "limitations.md"):
        assert "not measured yet" in (DOCS / page).read_text().lower(), page
