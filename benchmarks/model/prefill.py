"""Model-level prefill benchmark: SmolLM2-135M-Instruct, full attention vs Focus hard mode, same text.

For each length, one sequence of held-out Python standard-library source (`python-source`, held-out split) is run
through the decoder with the adapter disabled (full causal attention, transformers' SDPA), with the Focus adapter in
hard mode as saved (its own top_k, window, dense heads and dense_below) and once per --top-k override: the variants
take turns, one prefill each per round, for --repeats rounds, and each keeps its best time (a shared CPU's speed
drifts over minutes; timing one variant's repeats back to back would credit the drift to it).
Only the decoder forward (embeddings, 30 layers, final norm) is timed; the language-model head then scores every
next token of the same hidden states, in chunks (a 32K x 49K logits tensor would take 6 GiB), so every variant
reports perplexity on exactly the same tokens - the quality of the setting whose speed is measured.

The default adapter is the committed long-context adapter (`benchmarks/long_context/adapter`), the setting that
keeps the model's answers (`benchmarks/long_context/results/report.md`).

    python benchmarks/model/prefill.py --seq-lens 8192 16384 --json benchmarks/results/model_prefill.json

Rows: seq_len, variant, top_k, seconds (best of the rounds: --repeats, more at a length whose prefill is short with
--min-seconds), ppl, speedup (full seconds / this variant's seconds), backend, threads, load average. Wall-clock on
a shared CPU varies; the load average is recorded for that reason.
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import time
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F
from peft import PeftModel

import focus_hf
from focus_hf import load_model_and_tokenizer
from focus_hf.aliases import DEFAULT_MODEL
from focus_hf.benchmarking.model import (
    COMMITTED_ADAPTER,
    attention_variant,
    held_out_sequence,
    saved_setting,
    setting_fields,
)
from focus_hf.benchmarking.records import log, machine_fields, repository_of, script_command, write_json
from focus_hf.benchmarking.timing import rounds_to_reach

REPOSITORY = repository_of(__file__)
SCORE_CHUNK = 2048  # positions per language-model-head call


@torch.no_grad()
def timed_prefill(model: PeftModel, input_ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Wall time of one decoder forward and its last hidden states."""
    started = time.perf_counter()
    hidden = model.get_base_model().model(input_ids=input_ids, use_cache=False).last_hidden_state
    return time.perf_counter() - started, hidden


@torch.no_grad()
def perplexity_of(model: PeftModel, hidden: torch.Tensor, input_ids: torch.Tensor) -> float:
    head = model.get_base_model().lm_head
    targets = input_ids[0, 1:]
    nll = 0.0
    for start in range(0, targets.numel(), SCORE_CHUNK):
        logits = head(
            hidden[0, start : min(start + SCORE_CHUNK, targets.numel())]
        ).float()  # the last position predicts nothing
        nll += F.cross_entropy(logits, targets[start : start + SCORE_CHUNK], reduction="sum").item()
    return math.exp(nll / targets.numel())


def measure(
    model: PeftModel, input_ids: torch.Tensor, top_k: Union[str, int, None], backend: str, score: bool = True
) -> dict:
    """Time one prefill of a variant (`attention_variant`) and, with `score`, its perplexity (else None)."""
    with attention_variant(model, top_k, backend):
        seconds, hidden = timed_prefill(model, input_ids)
    return {"seconds": seconds, "ppl": perplexity_of(model, hidden, input_ids) if score else None}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument(
        "--top-k", type=int, nargs="*", default=[], help="top_k overrides timed besides the adapter as saved"
    )
    parser.add_argument("--adapter", type=Path, default=REPOSITORY / COMMITTED_ADAPTER, help="Focus adapter folder")
    parser.add_argument("--backend", default="auto", choices=["auto", "sdpa", "flash"])
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of one timed prefill per variant (alternating), best kept"
    )
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=0.0,
        help="at a length whose full-attention prefill is short, more rounds: as many as it takes its best time so "
        "far to reach this many seconds (a 1K prefill of a few seconds moves by a tenth between single runs)",
    )
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODEL)
    model = PeftModel.from_pretrained(model, args.adapter).eval()
    # First-call allocations are not what we measure, nor is "auto"'s one-time crossover measurement (once per
    # machine and head shape, then read from its cache): a prompt past dense_below runs every routed shape once.
    warm_up = held_out_sequence(tokenizer, model.peft_config["default"].dense_below + 1024)
    for top_k in [None, *args.top_k]:
        measure(model, warm_up, top_k, args.backend, score=False)
    rows = []
    names = {
        "full": "full attention (adapter disabled)",
        None: f"Focus hard as saved ({saved_setting(model)})",
        **{top_k: f"Focus hard top-{top_k} (otherwise as saved)" for top_k in args.top_k},
    }
    for seq_len in args.seq_lens:
        input_ids = held_out_sequence(tokenizer, seq_len)
        results: dict = {}
        rounds, repeat = args.repeats, 0
        while repeat < rounds:
            for top_k, variant in names.items():
                log(f"{seq_len:,} tokens, round {repeat + 1} of {rounds}: {variant} ...")
                # The perplexity is the same each round: scored once, in the first.
                result = measure(model, input_ids, top_k, args.backend, score=repeat == 0)
                log(f"  {result['seconds']:.1f} s")
                best = results.setdefault(top_k, result)
                best["seconds"] = min(best["seconds"], result["seconds"])
            # From the best round so far: a first round slowed by something else would leave too few.
            rounds = rounds_to_reach(args.repeats, args.min_seconds, results["full"]["seconds"])
            repeat += 1
        full = results["full"]
        for top_k, variant in names.items():
            result = results[top_k]
            row = {
                "seq_len": seq_len,
                "variant": variant,
                "top_k": {"full": None, None: model.peft_config["default"].top_k}.get(top_k, top_k),
                "seconds": round(result["seconds"], 3),
                "ppl": round(result["ppl"], 4),
                "speedup": round(full["seconds"] / result["seconds"], 3),
                "ppl_vs_full": round(result["ppl"] / full["ppl"], 4),
                **setting_fields(args, model, top_k == "full", REPOSITORY),
                "repeats": rounds,
                "peak_rss_mib_so_far": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                **machine_fields(torch.device("cpu")),  # processor, instruction sets, the kernels' build target
                "command": script_command(__file__, argv),
                "focus_hf": focus_hf.__version__,
            }
            rows.append(row)
            log(f"{seq_len:,} tokens, {variant}: best {row['seconds']:.1f} s, speedup {row['speedup']:.2f}x")
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
