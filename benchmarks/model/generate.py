"""Model-level decoding benchmark: tokens/s of `generate()` on SmolLM2-135M-Instruct after a long prompt.

For each prompt length, the first tokens of held-out Python standard-library source (`python-source`, held-out
split, as in `prefill.py`) are given to `model.generate` (greedy, `max_new_tokens`) once with the adapter
disabled (full attention, transformers' SDPA) and once with the Focus adapter in hard mode as saved, alternately,
`--repeats` times each. A streamer stamps the time of every new token: the first comes after the prefill, so
decoding speed is (new tokens - 1) / (time of the last - time of the first), which the prompt's prefill does not
enter. Quality of the setting whose speed is measured: Focus's generation is teacher-forced on full attention's
greedy tokens (a logits processor notes each step's distribution, then forces the reference token, so that both
variants decode the same text; a free-running comparison would part for good at the first near-tie), and each step
is compared with full attention's at the same position: whether the argmax agrees, and the KL divergence
KL(full || Focus) of the next-token distributions.

    python benchmarks/model/generate.py --prompt-lens 16384 --json benchmarks/results/model_decode.json
    python benchmarks/model/generate.py --prompt-lens 16384 --cache static \\
        --json benchmarks/results/model_decode_static.json

With transformers' default DynamicCache every step concatenates each layer's keys and values with the new token's,
a copy of the whole cache that both variants pay; `--cache static` pre-allocates the cache
(`cache_implementation="static"`), so that a step costs the model's weights and its attention.

Rows: prompt_len, cache, variant, prefill_s, decode_tokens_per_s (best of the rounds: --repeats, more after a short
prompt with --min-seconds), repeats (the rounds run), speedup (this variant's tokens/s /
full attention's), argmax_agree (steps whose greedy token is full attention's), mean_kl / max_kl (nats per step),
processor, threads, load average.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch
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
    timed_generate,
)
from focus_hf.benchmarking.records import log, machine_fields, repository_of, script_command, write_json
from focus_hf.benchmarking.timing import rounds_to_reach

REPOSITORY = repository_of(__file__)


def generate_variant(
    model: PeftModel,
    input_ids: torch.Tensor,
    variant: str,
    new_tokens: int,
    backend: str,
    cache: str,
    reference: Optional[list[int]] = None,
) -> dict:
    """`timed_generate` with the adapter disabled ("full") or in hard mode as saved ("focus")."""
    with attention_variant(model, "full" if variant == "full" else None, backend):
        return timed_generate(model, input_ids, new_tokens, cache, reference)


def step_agreement(log_probs: torch.Tensor, reference: torch.Tensor) -> dict:
    """Per-step comparison of next-token distributions [steps, vocab] with the reference's on the same prefixes:
    how many argmaxes agree and the mean / largest KL(reference || these) in nats."""
    # Tokens a logits processor bans (end of sequence before min_new_tokens) have probability 0 in both: no term.
    kl = torch.where(reference.isfinite(), reference.exp() * (reference - log_probs), 0.0).sum(-1)
    return {
        "argmax_agree": int((log_probs.argmax(-1) == reference.argmax(-1)).sum()),
        "mean_kl": round(float(kl.mean()), 5),
        "max_kl": round(float(kl.max()), 5),
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[16384])
    parser.add_argument(
        "--new-tokens", type=int, default=32, help="tokens generated per run (the first is timed apart)"
    )
    parser.add_argument("--adapter", type=Path, default=REPOSITORY / COMMITTED_ADAPTER, help="Focus adapter folder")
    parser.add_argument("--backend", default="auto", choices=["auto", "sdpa", "flash"])
    parser.add_argument(
        "--cache", default="dynamic", choices=["dynamic", "static"], help="KV cache of both variants (see above)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="generations per variant (alternating), best kept")
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=0.0,
        help="after a short prompt, more rounds: as many as it takes full attention's best decoding time so far to "
        "reach this many seconds (32 tokens after 1K decode in about a second, which moves by a tenth between runs)",
    )
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2: decoding speed is timed from the second new token on")

    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODEL)
    model = PeftModel.from_pretrained(model, args.adapter).eval()
    # "auto"'s one-time crossover measurements (prefill and decode shapes) are not what we time.
    warm_up = held_out_sequence(tokenizer, model.peft_config["default"].dense_below + 1024)
    for variant in ("full", "focus"):
        generate_variant(model, warm_up, variant, 4, args.backend, args.cache)
    names = {"full": "full attention (adapter disabled)", "focus": f"Focus hard as saved ({saved_setting(model)})"}
    rows = []
    for prompt_len in args.prompt_lens:
        input_ids = held_out_sequence(tokenizer, prompt_len)
        best: dict[str, dict] = {}
        rounds, repeat = args.repeats, 0
        while repeat < rounds:
            for variant in ("full", "focus"):
                log(f"{prompt_len:,}-token prompt, round {repeat + 1} of {rounds}: {names[variant]} ...")
                # Focus follows full attention's greedy tokens (the first round's: greedy decoding is deterministic).
                reference = None if variant == "full" else best["full"]["tokens"]
                result = generate_variant(
                    model, input_ids, variant, args.new_tokens, args.backend, args.cache, reference
                )
                log(f"  prefill {result['prefill_s']:.1f} s, {result['tokens_per_s']:.2f} tokens/s")
                if variant not in best or result["tokens_per_s"] > best[variant]["tokens_per_s"]:
                    best[variant] = result
            # From the best round so far: a first round slowed by something else would leave too few.
            decoding_seconds = (args.new_tokens - 1) / best["full"]["tokens_per_s"]
            rounds = rounds_to_reach(args.repeats, args.min_seconds, decoding_seconds)
            repeat += 1
        full = best["full"]
        for variant in ("full", "focus"):
            result = best[variant]
            rows.append(
                {
                    "prompt_len": prompt_len,
                    "cache": args.cache,
                    "variant": names[variant],
                    "new_tokens": args.new_tokens,
                    "prefill_s": round(result["prefill_s"], 3),
                    "decode_tokens_per_s": round(result["tokens_per_s"], 3),
                    "decode_step_ms": round(1e3 / result["tokens_per_s"], 2),
                    "speedup": round(result["tokens_per_s"] / full["tokens_per_s"], 3),
                    **step_agreement(result["log_probs"], full["log_probs"]),
                    **setting_fields(args, model, variant == "full", REPOSITORY),
                    "repeats": rounds,  # the rounds run, --repeats or more (--min-seconds)
                    **machine_fields(torch.device("cpu")),
                    "command": script_command(__file__, argv),
                    "focus_hf": focus_hf.__version__,
                }
            )
        log(
            f"  decode speedup {rows[-1]['speedup']:.2f}x; Focus's greedy token agrees with full attention's at "
            f"{rows[-1]['argmax_agree']} of {args.new_tokens} steps, mean KL {rows[-1]['mean_kl']:.4f} nats"
        )
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
