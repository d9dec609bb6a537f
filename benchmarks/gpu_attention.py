"""GPU benchmark (issue 15, part 6): one attention layer, dense flash/SDPA against Focus hard mode, up to 1M tokens.

A one-layer Llama-shaped model (hidden 2048, 32 query / 8 kv heads, head dim 64, a tiny MLP and vocabulary so that
attention dominates) in bf16 runs a prefill of N tokens: dense with `attn_implementation` flash_attention_2 (when
flash-attn is installed) or sdpa, and with a Focus adapter in hard mode (K groups, window, top-k) on the `flash`
backend (or `sdpa` without flash-attn). Both are timed alternately after a warm-up; peak GPU memory is recorded.

    python benchmarks/gpu_attention.py --lengths 4096 16384 65536 262144 1048576 \\
        --out benchmarks/results/attention_gpu.json

Needs CUDA; without it the script exits with a message and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time


def timing_row(tokens: int, dense: list[tuple[float, int]], focus: list[tuple[float, int]]) -> dict:
    """One result row from repeated (seconds, peak bytes) measurements: best times, their ratio, peak memory."""
    dense_s, focus_s = min(t for t, _ in dense), min(t for t, _ in focus)
    return {
        "tokens": tokens,
        "dense_s": dense_s,
        "focus_s": focus_s,
        "speedup": dense_s / focus_s,
        "dense_peak_bytes": max(m for _, m in dense),
        "focus_peak_bytes": max(m for _, m in focus),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536, 262144, 1048576])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/attention_gpu.json")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("benchmarks/gpu_attention.py needs a CUDA GPU; none is available here, nothing was measured.")
        return 2
    import importlib.util

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    import focus_hf

    flash = importlib.util.find_spec("flash_attn") is not None
    dense_impl = "flash_attention_2" if flash else "sdpa"
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=2048,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=max(args.lengths) + 1,
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation=dense_impl, dtype=torch.bfloat16)
    model = get_peft_model(base.cuda().eval(), focus_hf.FocusConfig(num_groups=args.groups, window=args.window))
    model.eval()

    def run(n: int, focus: bool, top_k: int) -> tuple[float, int]:
        ids = torch.randint(0, config.vocab_size, (1, n), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            start = time.perf_counter()
            if focus:
                focus_hf.set_routing(model, "hard", top_k=top_k, backend="flash" if flash else "sdpa")
                model(input_ids=ids, use_cache=False)
            else:
                with model.disable_adapter():
                    model(input_ids=ids, use_cache=False)
            torch.cuda.synchronize()
        return time.perf_counter() - start, torch.cuda.max_memory_allocated()

    rows = []
    for n in args.lengths:
        for top_k in args.top_k:
            try:
                run(min(n, 4096), True, top_k), run(min(n, 4096), False, top_k)  # warm-up
                dense, focus = [], []
                for _ in range(args.repeats):
                    dense.append(run(n, False, top_k))
                    focus.append(run(n, True, top_k))
            except torch.cuda.OutOfMemoryError as error:
                rows.append({"tokens": n, "top_k": top_k, "error": f"out of memory: {error}"[:200]})
                torch.cuda.empty_cache()
                continue
            rows.append({**timing_row(n, dense, focus), "top_k": top_k})
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "dense_attention": dense_impl,
        "focus_backend": "flash" if flash else "sdpa",
        "dtype": "bfloat16",
        "layer": {"hidden": 2048, "heads": 32, "kv_heads": 8, "head_dim": 64},
        "focus": {"num_groups": args.groups, "window": args.window},
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "rows": rows,
    }
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
