"""What a user sees on stderr when they run a `focus-hf` command or a snippet of the docs, and what of it they did not
ask for.

A child process started with `CHILD_PRELUDE` in front of its code records, for every write to `sys.stderr`, the
module that wrote it: the first frame outside the printing machinery (logging, warnings, tqdm, io), so a logging
record is the module that logged it, a warning the module that called `warnings.warn`, a progress bar the code
that advances it. `unrequested_lines` then keeps what a user did not ask for: anything another package wrote that is
not a progress bar (a warning, a log line such as torchao's "Failed to load ..." or transformers' "[transformers]
..."), and anything written past Python's `sys.stderr` (C code writing to the file descriptor). focus_hf's own
messages and bars, and the caller's own prints, are asked for.

The prelude also makes every warning a focus_hf module raises an error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# How the warnings module prints a warning: "path/to/file.py:123: SomeWarning: message".
WARNING_LINE = re.compile(r"^.*:\d+: \w*Warning: .*$", re.MULTILINE)
# A tqdm bar: "description:  50%|#####     | 1/2 [00:01<00:01, ...]" (the description may be empty).
PROGRESS_LINE = re.compile(r"^[^|]*\d{1,3}%\|.*\|")
STDERR_LOG_ENV = "FOCUS_HF_TEST_STDERR_LOG"
ASKED_FOR = re.compile(r"^(focus_hf(\.|$)|__main__$)")

CHILD_PRELUDE = r'''
import atexit as _atexit, json as _json, os as _os, sys as _sys, warnings as _warnings
_warnings.filterwarnings("error", module=r"focus_hf(\.|$)")  # regex: the -W option takes exact names only
_MACHINERY = ("logging", "warnings", "tqdm", "io", "_io", "codecs", "contextlib", "_pytest")


class _TaggedStderr:
    def __init__(self, stream):
        self._stream, self.chunks = stream, []

    def write(self, text):
        frame = _sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _MACHINERY:
            frame = frame.f_back
        self.chunks.append([frame.f_globals.get("__name__", "?") if frame is not None else "?", text])
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


_sys.stderr = _TaggedStderr(_sys.stderr)


@_atexit.register
def _save_stderr_log():
    with open(_os.environ["FOCUS_HF_TEST_STDERR_LOG"], "w") as _file:
        _json.dump(_sys.stderr.chunks, _file)
'''


def lines(text: str) -> list[str]:
    """The non-blank lines of `text`, each progress-bar redraw on its own."""
    return [line for line in text.replace("\r", "\n").splitlines() if line.strip()]


def python_warnings(stderr: str) -> list[str]:
    """The warning lines in `stderr`."""
    return WARNING_LINE.findall("\n".join(lines(stderr)))


def unrequested_lines(stderr: str, log: Path) -> list[str]:
    """The lines of `stderr` a user did not ask for, given the `log` a child with `CHILD_PRELUDE` wrote."""
    chunks = json.loads(log.read_text())
    found = []
    for module, text in chunks:
        if not ASKED_FOR.match(module):
            found += [f"[{module}] {line}" for line in lines(text) if not PROGRESS_LINE.match(line)]
    through_python = "".join(text for _, text in chunks).replace("\r", "\n")
    found += [f"[not through sys.stderr] {line}" for line in lines(stderr) if line not in through_python]
    return found
