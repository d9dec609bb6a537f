"""`benchmarks/serving_stress.py` at a small size: 8 requests of 100 to 700 tokens from 8 concurrent streaming clients
of vLLM's OpenAI server with a Focus adapter and without one, and from 4 threads of a transformers app on one model -
every response equal to the request's alone, no error, no dropped request."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_engines import engine_env

pytestmark = pytest.mark.vllm
SCRIPT = Path(__file__).parents[2] / "benchmarks" / "model" / "serving_stress.py"


def test_concurrent_requests_get_their_tokens_alone(tmp_path, tiny_llama_dir, tiny_adapter):
    out = tmp_path / "stress.json"
    command = [
        sys.executable, str(SCRIPT), "--model", str(tiny_llama_dir), "--adapter", str(tiny_adapter),
        "--requests", "8", "--min-prompt", "100", "--max-prompt", "700", "--new-tokens", "8",
        "--clients", "8", "--threads", "4", "--json", str(out),
    ]  # fmt: skip
    env = engine_env({"VLLM_CPU_KVCACHE_SPACE": "1"})
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    assert out.is_file(), done.stdout[-3000:] + done.stderr[-6000:]
    record = json.loads(out.read_text())
    parts = {
        "vLLM + Focus": record["vllm"]["focus"],
        "vLLM dense": record["vllm"]["dense (vLLM's own attention)"],
        "transformers + Focus": record["transformers"]["focus"],
        "transformers, adapter disabled": record["transformers"]["adapter disabled"],
    }
    for name, part in parts.items():
        for run in ("alone", "concurrent"):
            assert part[run]["requests"] == 8, name
            assert part[run]["errors"] == 0, (name, run, part[run]["error_messages"])
            assert part[run]["dropped"] == 0, (name, run)
            assert part[run]["generated_tokens"] == 8 * 8 and part[run]["generated_tokens_per_s"] > 0, (name, run)
        assert part["equal_to_alone"] == 8, (name, part["unequal"])
    assert record["vllm"]["focus"]["concurrent"]["clients"] == 8
    assert record["transformers"]["focus"]["concurrent"]["threads"] == 4
    assert done.returncode == 0, done.stderr[-3000:]
