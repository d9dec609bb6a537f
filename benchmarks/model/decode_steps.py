"""Decoding steps of SmolLM2-135M-Instruct, full attention and Focus stepped alternately in one process.

`generate.py` times whole `generate()` calls, one variant after the other; on a shared 2-core VM two such calls
of the same code spread by 10-25%. Here each variant first reads the same prompt into a KV cache of its own (full
attention: the adapter disabled; Focus: hard mode as saved), and then the two take decoding steps in turn - one
step of full attention, one of Focus, `--steps` times - so that both see the same machine from moment to moment.
Each step feeds the variant's own greedy token of the step before; the rows report the median step time of each and
their ratio. The prefill is not timed.

    python benchmarks/model/decode_steps.py --prompt-lens 2048 8192 --json benchmarks/results/model_steps.json
    python benchmarks/model/decode_steps.py --prompt-lens 8192 --cache static \\
        --json benchmarks/results/model_steps_static.json

Rows: prompt_len, cache, variant, median step ms, speedup (full attention's median / this variant's), steps,
processor, threads, load average.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from peft import PeftModel

import focus_hf
from focus_hf import load_model_and_tokenizer
from focus_hf.aliases import DEFAULT_MODEL
from focus_hf.benchmarking.model import (
    COMMITTED_ADAPTER,
    VARIANTS,
    attention_variant,
    held_out_sequence,
    prefilled,
    saved_setting,
)
from focus_hf.benchmarking.records import log, machine_fields, repository_of, script_command, write_json

REPOSITORY = repository_of(__file__)


@torch.no_grad()
def alternate_steps(model: PeftModel, input_ids: torch.Tensor, cache_kind: str, steps: int) -> dict[str, list[float]]:
    """Seconds of each decoding step of both variants, stepped in turn."""
    state = {variant: prefilled(model, input_ids, variant, cache_kind, steps) for variant in VARIANTS}
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for _ in range(steps):
        for variant, top_k in VARIANTS.items():
            cache, token = state[variant]
            with attention_variant(model, top_k, "auto"):
                started = time.perf_counter()
                logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
                times[variant].append(time.perf_counter() - started)
            state[variant] = (cache, logits[:, -1:].argmax(-1))
    return times


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[8192])
    parser.add_argument("--steps", type=int, default=25, help="decoding steps per variant, taken in turn")
    parser.add_argument("--adapter", type=Path, default=REPOSITORY / COMMITTED_ADAPTER, help="Focus adapter folder")
    parser.add_argument("--cache", default="dynamic", choices=["dynamic", "static"], help="KV cache of both variants")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")

    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODEL)
    model = PeftModel.from_pretrained(model, args.adapter).eval()
    names = {"full": "full attention (adapter disabled)", "focus": f"Focus hard as saved ({saved_setting(model)})"}
    rows = []
    for prompt_len in args.prompt_lens:
        log(f"{prompt_len:,}-token prompt, {args.cache} cache: {args.steps} steps of each variant, in turn ...")
        times = alternate_steps(model, held_out_sequence(tokenizer, prompt_len), args.cache, args.steps)
        medians = {variant: statistics.median(seconds) for variant, seconds in times.items()}
        for variant in VARIANTS:
            rows.append(
                {
                    "prompt_len": prompt_len,
                    "cache": args.cache,
                    "variant": names[variant],
                    "step_ms": round(medians[variant] * 1e3, 2),
                    "speedup": round(medians["full"] / medians[variant], 3),
                    "steps": args.steps,
                    "adapter": str(args.adapter),
                    **machine_fields(torch.device("cpu")),
                    "command": script_command(__file__, argv),
                    "focus_hf": focus_hf.__version__,
                }
            )
        log(f"  full {medians['full'] * 1e3:.1f} ms, Focus {medians['focus'] * 1e3:.1f} ms: {rows[-1]['speedup']:.3f}x")
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
