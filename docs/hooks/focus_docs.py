"""The mkdocs hook of the focus_hf docs (named in mkdocs.yml): the site is built from the committed pages as they are.

* The generated parts of a page (figures, tables, the CLI reference, the package tree, between `<!--fig:NAME-->`
  markers) are written into the committed Markdown by `generated.py`; a page whose generated parts are stale fails
  the build (run `python docs/hooks/generated.py`). The plots are committed PNG files of docs/img/.
* The changelog and the committed measurements (JSON, the generated reports and their PNGs, under benchmarks/) join
  the site at their repository paths. A page links them relative to its own place in the repository
  (`../benchmarks/...`, as a code host resolves it); the hook points those links at the copies in the site.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

HOOKS = Path(__file__).resolve().parent
ROOT = HOOKS.parents[1]
DOCS = ROOT / "docs"
for path in (str(HOOKS), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

import generated  # noqa: E402
from mkdocs.exceptions import PluginError  # noqa: E402
from mkdocs.structure.files import File, Files  # noqa: E402

# The files outside docs/ that join the site, at their repository paths (globs relative to the repository root): the
# changelog, and the measurements.
ARTIFACTS = (
    "CHANGELOG.md",
    "benchmarks/results/**/*.json",
    "benchmarks/results/**/*.png",
    "benchmarks/results/**/*.md",
    "benchmarks/results/**/*.txt",
    "benchmarks/long_context/results/*",
    "benchmarks/long_context/*.json",
    "benchmarks/long_context/*.png",
    "benchmarks/long_context/adapter/*.json",
    "benchmarks/quality/adapters*/*/*.json",
    "benchmarks/quality/adapters*/*/*.png",
)
LINK = re.compile(r"(\]\()([^)\s]+)")


def on_files(files: Files, config) -> Files:
    for pattern in ARTIFACTS:
        for path in sorted(ROOT.glob(pattern)):
            uri = path.relative_to(ROOT).as_posix()
            if path.is_file() and files.get_file_from_path(uri) is None:
                files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def site_links(markdown: str, page: Path) -> str:
    """Links of `markdown` (the page `page`) to repository files outside docs/ pointed at their copies in the site,
    which holds them at their repository paths."""

    def rewrite(match: re.Match) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("#", "/", "mailto:")):
            return match.group(0)
        resolved = (page.parent / target.split("#", 1)[0]).resolve()
        if DOCS in resolved.parents or ROOT not in resolved.parents:
            return match.group(0)
        in_site = DOCS / resolved.relative_to(ROOT)
        fragment = "#" + target.split("#", 1)[1] if "#" in target else ""
        return match.group(1) + os.path.relpath(in_site, page.parent).replace(os.sep, "/") + fragment

    return LINK.sub(rewrite, markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    source = Path(page.file.abs_src_path)
    if DOCS not in source.parents:
        return markdown  # a generated report of benchmarks/, already linked as the site holds it
    try:
        filled = generated.fill(markdown, source)
    except (KeyError, LookupError, FileNotFoundError, ValueError) as error:
        raise PluginError(f"{page.file.src_uri}: {error}") from error
    if filled != markdown:
        raise PluginError(f"{page.file.src_uri}: generated parts are stale; run python docs/hooks/generated.py")
    return site_links(markdown, source)
