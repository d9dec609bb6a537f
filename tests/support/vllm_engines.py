"""What the vLLM tests share: the models and adapters they serve, the engine runner and the transformers reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

RUNNER = Path(__file__).with_name("run_vllm_engine.py")
# The CPU engine's KV cache, in GiB (vLLM sizes it from this variable on CPU): small, the tests' prompts are short.
KV_CACHE_GIB = "1"


def engine_env(extra: Optional[dict] = None) -> dict:
    """The environment of a vLLM process: offline (no Hub traffic), a small KV cache, deterministic Focus paths."""
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
            "FOCUS_HF_NO_CALIBRATION": "1",
        }
    )
    env.update(extra or {})
    return env


def run_engine(
    tmp_path: Path,
    model: Path,
    engine: dict,
    calls: list,
    max_tokens: int,
    timeout: int = 900,
    log: Optional[list] = None,
    stats: Optional[dict] = None,
) -> list:
    """Run vLLM on `calls` (lists of prompts, each a list of token ids) in a fresh process; the per-call results
    (the engine's output lines are appended to `log` when one is given, and its counts - "preemptions" - put in
    `stats`)."""
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"model": str(model), "engine": engine, "calls": calls, "max_tokens": max_tokens}))
    done = subprocess.run(
        [sys.executable, str(RUNNER), str(job)],
        env=engine_env({"VLLM_LOG_STATS_INTERVAL": "1"}),  # the engine's stats lines (used when it keeps stats)
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if log is not None:
        log.extend((done.stdout + done.stderr).splitlines())
    if done.returncode != 0:
        raise AssertionError(f"vLLM failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not results:
        raise AssertionError(f"vLLM printed no result:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    result = json.loads(results[-1].removeprefix("RESULT "))
    if stats is not None:
        stats["preemptions"] = result["preemptions"]
    return result["calls"]


def engine_log(tmp_path: Path, model: Path, engine: dict) -> subprocess.CompletedProcess:
    """Start an engine on one short prompt and return the finished process (for refusals and start-up logs)."""
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"model": str(model), "engine": engine, "calls": [[[1, 2, 3]]], "max_tokens": 1}))
    return subprocess.run(
        [sys.executable, str(RUNNER), str(job)], env=engine_env(), capture_output=True, text=True, timeout=600
    )


def transformers_greedy(model_dir: Path, adapter: Path, prompts: list, max_tokens: int) -> list:
    """Greedy continuations of `prompts` with transformers + the Focus adapter: tokens and their log-probabilities."""
    from peft import PeftModel

    import focus_hf

    model, _ = focus_hf.load_model_and_tokenizer(model_dir)
    model = PeftModel.from_pretrained(model, str(adapter)).eval()
    results = []
    for ids in prompts:  # a plain greedy loop over the KV cache (generate() would mask EOS under min_new_tokens)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
            tokens, logprobs = [], []
            for _ in range(max_tokens):
                scores = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                token = int(scores.argmax())
                tokens.append(token)
                logprobs.append(float(scores[token]))
                out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
        results.append({"tokens": tokens, "logprobs": logprobs})
    return results


def assert_same_continuations(served: list, reference: list, tolerance: float) -> float:
    """Greedy tokens equal, log-probabilities within `tolerance`; returns the largest log-probability difference."""
    worst = 0.0
    for index, (got, want) in enumerate(zip(served, reference, strict=True)):
        if got["tokens"] != want["tokens"]:
            step = next(i for i, (a, b) in enumerate(zip(got["tokens"], want["tokens"])) if a != b)
            raise AssertionError(
                f"prompt {index}: vLLM {got['tokens']} != transformers {want['tokens']} from step {step}; "
                f"log-probabilities up to there: vLLM {got['logprobs'][: step + 1]}, "
                f"transformers {want['logprobs'][: step + 1]}"
            )
        worst = max([worst] + [abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)])
    assert worst <= tolerance, f"log-probabilities differ by up to {worst:.2e} (tolerance {tolerance:.0e})"
    return worst
