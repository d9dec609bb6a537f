"""vLLM + Focus gives the tokens and log-probabilities of transformers + Focus, with chunked prefill and prefix
caching on: the side cache resumes routing exactly after every chunk, every cached prefix and every decoding step."""

from __future__ import annotations

import random

import pytest
from conftest import REAL_ADAPTER
from vllm_engines import assert_same_continuations, run_engine, transformers_greedy

pytestmark = pytest.mark.vllm

# float32 throughout; vLLM's matmuls and the CPU kernels sum in another order than torch's: a few 1e-5 observed.
TOLERANCE = 2e-3


def _engine(adapter, **options) -> dict:
    engine = {
        "dtype": "float32",
        "seed": 0,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "additional_config": {"focus_adapter": str(adapter)},
    }
    engine.update(options)
    return engine


def _random_prompts(lengths, seed=0):
    generator = random.Random(seed)
    return [[generator.randrange(3, 49152) for _ in range(length)] for length in lengths]


@pytest.mark.parametrize("adapter_fixture", ["tiny_adapter", "tiny_adapter_probes"])
def test_tiny_model_matches_transformers(request, tmp_path, tiny_llama_dir, adapter_fixture):
    """A batch of mixed lengths in chunks of 96 tokens (most prompts span several chunks), then a call whose prompts
    share the batch's prefixes (prefix-cache hits: routing resumes from the side cache at a block boundary)."""
    adapter = request.getfixturevalue(adapter_fixture)
    batch = _random_prompts([20, 150, 333, 700])
    again = [batch[3][:600] + batch[1][:50], batch[2] + batch[0]]
    calls = run_engine(
        tmp_path,
        tiny_llama_dir,
        _engine(adapter, max_model_len=1024, max_num_batched_tokens=96, max_num_seqs=8, block_size=32),
        [batch, again],
        max_tokens=12,
    )
    assert calls[1][0]["cached"] > 0 and calls[1][1]["cached"] > 0, "the second call should hit the prefix cache"
    reference = transformers_greedy(tiny_llama_dir, adapter, batch + again, max_tokens=12)
    assert_same_continuations(calls[0] + calls[1], reference, TOLERANCE)


def test_preempted_requests_resume_routing_exactly(tmp_path, tiny_llama_dir, tiny_adapter):
    """A KV cache too small for the batch: the scheduler preempts running requests (their blocks freed, the side
    cache's records with them) and recomputes them later in other blocks; the continuations are still those of
    transformers."""
    batch = _random_prompts([300, 280, 260, 240], seed=3)
    stats: dict = {}
    engine = _engine(
        tiny_adapter,
        max_model_len=512,
        max_num_batched_tokens=96,
        max_num_seqs=4,
        block_size=32,
        num_gpu_blocks_override=20,  # 640 token slots for four requests of ~330 tokens each
        enable_prefix_caching=False,
        disable_log_stats=False,
    )
    calls = run_engine(tmp_path, tiny_llama_dir, engine, [batch], max_tokens=60, stats=stats)
    assert stats["preemptions"] > 0, "the engine should have preempted a request"
    reference = transformers_greedy(tiny_llama_dir, tiny_adapter, batch, max_tokens=60)
    assert_same_continuations(calls[0], reference, TOLERANCE)


@pytest.mark.integration
def test_smollm2_distilled_adapter_matches_transformers(tmp_path, smollm2_dir):
    """The committed distilled adapter on SmolLM2-135M-Instruct at 1K, 4K and 8K-token prompts of real text, in one
    batch, chunked by 2,048 tokens; then the 8K prompt again, served mostly from the prefix cache."""
    from transformers import AutoTokenizer

    from focus_hf.data import load_texts

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "\n".join(load_texts("python-docs"))
    ids = tokenizer(text[: 8300 * 6])["input_ids"]
    assert len(ids) >= 8184
    offset = 5000  # the three prompts start at different places: no prefix is shared inside the batch
    batch = [ids[offset : offset + 1024], ids[: 8184], ids[2000 : 2000 + 4096]]
    max_tokens = 8
    calls = run_engine(
        tmp_path,
        smollm2_dir,
        _engine(REAL_ADAPTER, max_model_len=8192, max_num_batched_tokens=2048, max_num_seqs=4),
        [batch, [batch[1]]],
        max_tokens=max_tokens,
        timeout=1500,
    )
    assert calls[1][0]["cached"] >= 4096, "the repeated 8K prompt should come from the prefix cache"
    reference = transformers_greedy(smollm2_dir, REAL_ADAPTER, batch, max_tokens=max_tokens)
    worst = assert_same_continuations(calls[0] + calls[1], reference + [reference[1]], TOLERANCE)
    print(f"SmolLM2 1K/8K/4K: greedy tokens equal, log-probabilities within {worst:.1e}")
