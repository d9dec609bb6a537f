"""The documentation: its figures come from committed JSON only and are written into the committed pages (so that a
page reads the same raw as built), its generated parts match the JSON and the code, its plots are committed PNG
files drawn from the JSON, and its links work on a code host. (`mkdocs build --strict` in .ci/run checks the site's
links and API references; this needs no mkdocs.)"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest
from docs_checks import DOCS, DOCS_HOOKS, FENCE, REPO_ROOT, fenced_blocks, figure_tokens

sys.path.insert(0, str(DOCS_HOOKS))
import figures  # noqa: E402
import generated  # noqa: E402
import plots  # noqa: E402
import reference  # noqa: E402

PAGES = sorted(path for path in DOCS.rglob("*.md") if DOCS_HOOKS not in path.parents)
CHANGELOG = REPO_ROOT / "CHANGELOG.md"
MKDOCS_YML = (REPO_ROOT / "mkdocs.yml").read_text()


def page_id(path: Path) -> str:
    return path.relative_to(DOCS).as_posix()


def test_every_page_is_in_the_navigation():
    assert PAGES
    for path in PAGES:
        assert f": {page_id(path)}" in MKDOCS_YML, f"{page_id(path)} is not in mkdocs.yml's nav"


@pytest.mark.parametrize("path", [*PAGES, CHANGELOG], ids=lambda path: path.name)
def test_pages_write_figures_only_in_generated_parts(path):
    """A measured figure in a page must sit in a generated part, written from the committed JSON."""
    assert figure_tokens(path.read_text(encoding="utf-8")) == set()


@pytest.mark.parametrize("path", [*PAGES, REPO_ROOT / "README.md", CHANGELOG], ids=lambda path: path.name)
def test_pages_read_the_same_raw_as_built(path):
    """No template syntax left for a build to fill, and every generated part as the JSON and the code say now."""
    text = path.read_text(encoding="utf-8")
    assert "{{" not in text and "}}" not in text
    assert generated.fill(text, path) == text, "stale: run python docs/hooks/generated.py"


def test_generated_constants_of_the_code_are_fresh():
    for name in generated.OTHER_FILES:
        path = REPO_ROOT / name
        if path.suffix == ".py":
            text = path.read_text(encoding="utf-8")
            assert generated.names(text), f"{name} holds no generated constant"
            assert generated.fill(text, path) == text, "stale: run python docs/hooks/generated.py"


def test_generated_parts_are_found_and_filled(tmp_path):
    page = tmp_path / "page.md"
    text = "kept <!--fig:lc.ppl_8k-->old<!--/fig--> of it\n\n<!--fig:table.sinks--><!--/fig-->\n"
    filled = generated.fill(text, page)
    assert f"<!--fig:lc.ppl_8k-->{figures.value('lc.ppl_8k')}<!--/fig-->" in filled
    assert "\n\n| " in filled and generated.names(filled) == ["lc.ppl_8k", "table.sinks"]
    with pytest.raises(ValueError, match="starts a line"):
        generated.fill("text\n<!--fig:lc.ppl_8k--><!--/fig--> more\n", page)
    python = tmp_path / "module.py"
    expected = f'X = "{figures.value("lc.ppl_8k")}"  # fig:lc.ppl_8k\n'
    assert generated.fill('X = "old"  # fig:lc.ppl_8k\n', python) == expected


def test_figure_scan_catches_a_literal_figure():
    text = "prefill 1.34x faster, 97.6% kept, `1.5x in code` and <!--fig:lc.ppl_8k-->1.006x<!--/fig-->"
    assert figure_tokens(text) == {"1.34x", "97.6%"}


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


def test_unknown_name_fails(tmp_path):
    with pytest.raises(KeyError, match="no figure or table"):
        generated.fill("a <!--fig:attn.top1_1m--><!--/fig-->", tmp_path / "page.md")


def test_architecture_lists_exactly_the_package_tree():
    """One row per folder of focus_hf/ (and per root module), each with its docstring's description."""
    package = REPO_ROOT / "focus_hf"
    folders = sorted(p.name for p in package.iterdir() if p.is_dir() and p.name != "__pycache__")
    modules = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")
    rows = re.findall(r"^\| `([^`]+)` \| (.*) \|$", reference.architecture_table(), flags=re.M)
    assert [name for name, _ in rows] == [f"{folder}/" for folder in folders] + modules
    assert all(description.strip() for _, description in rows), "a folder or module without a docstring"
    assert "<!--fig:architecture-->" in (DOCS / "architecture.md").read_text()


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
    assert "<!--fig:cli.reference-->" in (DOCS / "cli.md").read_text()


def test_module_paths_of_the_docs_exist():
    """Every focus_hf module the docs import, render (`::: focus_hf.x`) or name in code is a real source file."""
    for path in PAGES:
        text = path.read_text(encoding="utf-8")
        code = "\n".join(block for _, block in fenced_blocks(text))
        named = re.findall(r"^\s*from (focus_hf[\w.]*) import", code, flags=re.M)
        named += re.findall(r"^::: (focus_hf[\w.]*)", text, flags=re.M)
        for name in named:
            assert reference.module_file(name), f"{page_id(path)}: {name}"


@pytest.mark.parametrize("name", sorted(plots.PLOTS))
def test_committed_plots_are_drawn_from_the_committed_json(name):
    from png_checks import assert_png

    path = DOCS / "img" / name
    assert_png(path, min_size=(600, 300))
    png, digest = generated.plot_sources(name)
    assert png and generated.recorded_digest(path) == digest, f"stale: run python docs/hooks/generated.py ({name})"


@pytest.mark.parametrize("path", [*PAGES, REPO_ROOT / "README.md", CHANGELOG], ids=lambda path: path.name)
def test_links_and_images_point_at_files_of_the_repository(path):
    """Read raw on a code host, every relative link and image of a page resolves to a file of the repository."""
    text = path.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", prose_links(text)):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        resolved = (path.parent / target.split("#", 1)[0]).resolve()
        assert resolved.exists() and REPO_ROOT in resolved.parents, f"{path.name}: {target}"


def prose_links(text: str) -> str:
    """`text` without fenced code (a snippet's `[...](...)` is Python, not a link)."""
    return FENCE.sub("", text)


def test_gpu_speed_is_read_from_the_committed_gpu_run():
    # The committed GPU run (benchmarks/results/gpu/summary.json) is what the README's, the home page's and the
    # performance page's GPU figures show: written in from it, never typed, and no page says it is unmeasured.
    assert (REPO_ROOT / "benchmarks" / "results" / "gpu" / "summary.json").is_file()
    for page in (REPO_ROOT / "README.md", DOCS / "index.md", DOCS / "performance.md", DOCS / "limitations.md"):
        text = page.read_text()
        assert "<!--fig:gpu." in text, f"{page.name} shows no figure of the GPU run"
        assert "not measured yet" not in text.lower(), page.name


def test_the_performance_page_is_a_reference():
    # What Focus costs and saves, with its commands: the per-machine tables live on their own page, and how the speed
    # was won in the changelog, which the site shows beside the pages.
    text = (DOCS / "performance.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 400
    assert "<!--fig:command." in text and "(performance-machines.md)" in text
    assert "CHANGELOG.md" in MKDOCS_YML
    for page in PAGES:  # the two parts of the sparse attention go by their names
        assert not re.search(r"\bset [AB]\b", page.read_text(encoding="utf-8")), page.name
