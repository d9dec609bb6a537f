"""The mkdocs hook of the focus_hf docs (named in mkdocs.yml): what the site shows is read from the repository at
build time, offline.

* `{{ name }}` in a page becomes a figure or a table from the committed JSON, a module's import path, the CLI
  reference or the package tree (`placeholders.py`); an unknown name fails the build.
* The committed measurements (JSON, the generated reports and their PNGs, under benchmarks/) join the site at
  their repository paths, so pages link to the files the figures come from.
* The plots (`plots.py`) are drawn from the same JSON into `img/`.
"""

from __future__ import annotations

import sys
from pathlib import Path

HOOKS = Path(__file__).resolve().parent
ROOT = HOOKS.parents[1]
for path in (str(HOOKS), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

import plots  # noqa: E402
from mkdocs.exceptions import PluginError  # noqa: E402
from mkdocs.structure.files import File, Files  # noqa: E402
from placeholders import render  # noqa: E402

# The measurement files that join the site, at their repository paths (globs relative to the repository root).
ARTIFACTS = (
    "benchmarks/results/**/*.json",
    "benchmarks/results/**/*.png",
    "benchmarks/results/**/*.md",
    "benchmarks/long_context/results/*",
    "benchmarks/long_context/*.json",
    "benchmarks/long_context/*.png",
    "benchmarks/long_context/adapter/*.json",
    "benchmarks/quality/adapters*/*/*.json",
    "benchmarks/quality/adapters*/*/*.png",
)


def on_files(files: Files, config) -> Files:
    for pattern in ARTIFACTS:
        for path in sorted(ROOT.glob(pattern)):
            uri = path.relative_to(ROOT).as_posix()
            if path.is_file() and files.get_file_from_path(uri) is None:
                files.append(File.generated(config, uri, abs_src_path=str(path)))
    for name, draw in plots.PLOTS.items():
        files.append(File.generated(config, f"img/{name}", content=draw()))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    try:
        return render(markdown)
    except (KeyError, LookupError, FileNotFoundError) as error:
        raise PluginError(f"{page.file.src_uri}: {error}") from error
