"""The generated parts of the committed text, written into it so that a page reads the same raw (on a code host, in
an editor) as built: `python docs/hooks/generated.py` writes them, `python docs/hooks/generated.py --check` lists
the stale ones (tests/test_docs.py runs the check, and the mkdocs hook refuses to build a stale page).

* In Markdown (the README and the pages of docs/), `<!--fig:NAME-->TEXT<!--/fig-->` holds the text of NAME: a
  figure or a table from the committed JSON (`figures.py`), the CLI reference (`cli.reference`), the package tree
  (`architecture`) or the patches to peft and transformers (`patches`, all three `reference.py`). A renderer hides
  the markers. A text of several lines (a table) stands between markers on lines of their own; an inline marker
  never starts a line (CommonMark would read a line that starts with `<!--` as raw HTML). Links of generated text
  to repository files are made relative to the page.
* In Python, `NAME_OF_CONSTANT = "TEXT"  # fig:NAME` holds it as a string literal (the demo's measured time and
  memory in its `--help`), with `  # noqa: E501` after it where the text makes the line long.
* The plots (`plots.py`) are PNG files in docs/img/; each records the digest of the JSON files it was drawn from
  (PNG text `Source-Digest`), so the check redraws nothing to know that one is stale.

Pure Python and matplotlib, no mkdocs.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import sys
from pathlib import Path

import figures
import reference

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
IMAGES = DOCS / "img"
MARKER = re.compile(r"<!--fig:([A-Za-z0-9_.:-]+)-->(.*?)<!--/fig-->", re.S)
PYTHON_MARKER = re.compile(
    r'^(?P<lead>[ \t]*\w+ = )(?P<literal>"(?:[^"\\\n]|\\.)*")(?P<tail>  # fig:(?P<name>[\w.:-]+)(?:  # noqa: E501)?)$',
    re.M,
)
DIGEST_KEY = "Source-Digest"
# Files whose generated parts this module writes, besides the pages of docs/ (paths relative to the repository root).
OTHER_FILES = ("README.md", "CHANGELOG.md", "focus_hf/commands/demo.py")


def expand(name: str) -> str:
    """The text of NAME."""
    if name == "cli.reference":
        return reference.cli_reference()
    if name == "architecture":
        return reference.architecture_table()
    if name == "patches":
        return reference.patches_table()
    return figures.value(name)


def _relative_links(text: str, page_dir: Path) -> str:
    """Links of `text` to repository files (written from the repository root) made relative to `page_dir`."""
    prefix = os.path.relpath(ROOT, page_dir).replace(os.sep, "/")
    if prefix == ".":
        return text
    return re.sub(r"\]\((benchmarks|focus_hf|examples|tests)/", lambda m: f"]({prefix}/{m.group(1)}/", text)


def fill(text: str, page: Path) -> str:
    """`text` (of the file `page`) with the text of every marker written in."""

    def markdown(match: re.Match) -> str:
        value = _relative_links(expand(match.group(1)), page.parent).strip("\n")
        if "\n" in value:
            value = f"\n\n{value}\n\n"
        return f"<!--fig:{match.group(1)}-->{value}<!--/fig-->"

    def python(match: re.Match) -> str:
        return f"{match['lead']}{json.dumps(expand(match['name']), ensure_ascii=False)}{match['tail']}"

    if page.suffix == ".py":
        return PYTHON_MARKER.sub(python, text)
    filled = MARKER.sub(markdown, text)
    inline_at_start = re.search(r"^[ \t]*<!--fig:[^>]*-->[^\n]", filled, re.M)
    if inline_at_start:
        line = filled[inline_at_start.start() :].split("\n", 1)[0]
        raise ValueError(f"{page}: an inline marker starts a line (a renderer reads it as raw HTML): {line!r}")
    return filled


def names(text: str) -> list[str]:
    """The NAMEs of the markers of `text` (Markdown or Python), in order."""
    return [match.group(1) for match in MARKER.finditer(text)] + [m["name"] for m in PYTHON_MARKER.finditer(text)]


def pages() -> list[Path]:
    """The Markdown pages of docs/ (the hooks' folder excluded)."""
    return sorted(path for path in DOCS.rglob("*.md") if "hooks" not in path.relative_to(DOCS).parts)


def text_files() -> list[Path]:
    """Every file with generated parts."""
    return pages() + [ROOT / name for name in OTHER_FILES]


# --- plots -------------------------------------------------------------------------------------------------------


def plot_sources(name: str) -> tuple[bytes, str]:
    """The PNG of plot `name` and the digest of the JSON files its drawing read."""
    import plots

    with figures.recording() as read:
        png = plots.PLOTS[name]()
    return png, source_digest(read)


def source_digest(paths: set[str]) -> str:
    """sha256 over the names and bytes of the files `paths` (relative to the repository root)."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.encode() + b"\0" + (ROOT / path).read_bytes() + b"\0")
    return digest.hexdigest()


def recorded_digest(path: Path) -> str | None:
    """The digest a committed plot records, or None (no file, or none recorded)."""
    from PIL import Image

    if not path.is_file():
        return None
    with Image.open(path) as image:
        return image.text.get(DIGEST_KEY)


def write_plot(name: str, png: bytes, digest: str) -> Path:
    """Write the PNG of plot `name` into docs/img/, recording `digest`."""
    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text(DIGEST_KEY, digest)
    path = IMAGES / name
    path.parent.mkdir(exist_ok=True)
    with Image.open(io.BytesIO(png)) as image:
        image.save(path, pnginfo=info)
    return path


# --- the command line --------------------------------------------------------------------------------------------


def stale() -> list[str]:
    """The files (repository paths) whose generated parts differ from what `fill` or the plots would write."""
    found = [
        path.relative_to(ROOT).as_posix()
        for path in text_files()
        if fill(path.read_text(encoding="utf-8"), path) != path.read_text(encoding="utf-8")
    ]
    import plots

    for name in plots.PLOTS:
        _png, digest = plot_sources(name)
        if recorded_digest(IMAGES / name) != digest:
            found.append((IMAGES / name).relative_to(ROOT).as_posix())
    return found


def _reload(path: Path) -> None:
    """Reload the module of `path` if it is imported, so that what reads it next sees the new text."""
    import importlib

    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if name in sys.modules:
        importlib.reload(sys.modules[name])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="list stale files and exit 1 when there is one")
    args = parser.parse_args(argv)
    if args.check:
        found = stale()
        for path in found:
            print(f"stale: {path} (run python docs/hooks/generated.py)")
        return 1 if found else 0
    # Python first: the CLI reference of the pages shows the help texts these constants go into.
    for path in sorted(text_files(), key=lambda path: path.suffix != ".py"):
        text = path.read_text(encoding="utf-8")
        filled = fill(text, path)
        if filled != text:
            path.write_text(filled, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
            if path.suffix == ".py":
                _reload(path)
    import plots

    for name in plots.PLOTS:
        png, digest = plot_sources(name)
        if recorded_digest(IMAGES / name) != digest:
            print(f"drew {write_plot(name, png, digest).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
