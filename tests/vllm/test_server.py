"""The OpenAI-compatible server with a Focus adapter fetched by Hub id from a local Hub (127.0.0.1 only): it logs
what it loaded and answers the OpenAI client with the tokens transformers + Focus gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import hub_server  # noqa: F401
from vllm_engines import engine_env, transformers_greedy

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks" / "model"))
from serving_stress import free_port, wait_until_up  # noqa: E402

pytestmark = pytest.mark.vllm
REPO = "focus-tests/tiny-llama-focus"


def test_openai_server_serves_adapter_from_hub(tmp_path, hub_server, tiny_llama_dir, tiny_adapter):  # noqa: F811
    import random

    from openai import OpenAI

    from focus_hf.hub import push_adapter

    commit = push_adapter(tiny_adapter, REPO, token="hf_local")
    port = free_port()
    log = tmp_path / "server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_llama_dir), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
        "--gpu-memory-utilization", "0.3",
        "--additional-config", json.dumps({"focus_adapter": REPO}),
    ]  # fmt: skip
    env = engine_env(hub_server.subprocess_env())
    env["HF_HUB_OFFLINE"] = "0"  # the adapter comes from the local Hub (HF_ENDPOINT is 127.0.0.1)
    with open(log, "w") as output:
        server = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        try:
            wait_until_up(server, f"http://127.0.0.1:{port}/health", log, timeout=400)
            generator = random.Random(3)
            prompt = [generator.randrange(3, 49152) for _ in range(300)]
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
            completion = client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=8,
                temperature=0.0,
                logprobs=1,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            )
        finally:
            server.terminate()
            server.wait(timeout=60)
    text = log.read_text()
    revision = getattr(commit, "oid", None) or str(commit)
    assert f"Focus adapter {REPO} @ " in text, text[-3000:]
    assert revision[:12] in text.split(f"Focus adapter {REPO} @ ")[1][:60]
    choice = completion.choices[0]
    tokens = [int(token.removeprefix("token_id:")) for token in choice.logprobs.tokens]
    reference = transformers_greedy(tiny_llama_dir, tiny_adapter, [prompt], max_tokens=8)[0]
    assert tokens == reference["tokens"]
    worst = max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs, reference["logprobs"]))
    assert worst <= 2e-3
