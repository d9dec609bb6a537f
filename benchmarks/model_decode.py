"""Model-level decoding benchmark: tokens/s of `generate()` on SmolLM2-135M-Instruct after a long prompt (issue 14).

For each prompt length, the first tokens of held-out Python standard-library source (`python-source`, held-out
split, as in `model_prefill.py`) are given to `model.generate` (greedy, `max_new_tokens`) once with the adapter
disabled (full attention, transformers' SDPA) and once with the Focus adapter in hard mode as saved, alternately,
`--repeats` times each. A streamer stamps the time of every new token: the first comes after the prefill, so
decoding speed is (new tokens - 1) / (time of the last - time of the first), which the prompt's prefill does not
enter. Quality of the setting whose speed is measured: Focus's generation is teacher-forced on full attention's
greedy tokens (a logits processor notes each step's distribution, then forces the reference token, so that both
variants decode the same text; a free-running comparison would part for good at the first near-tie), and each step
is compared with full attention's at the same position: whether the argmax agrees, and the KL divergence
KL(full || Focus) of the next-token distributions.

    python benchmarks/model_decode.py --prompt-lens 16384 --json benchmarks/results/model_decode.json
    python benchmarks/model_decode.py --prompt-lens 16384 --cache static \\
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
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from peft import PeftModel
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

import focus_hf
from focus_hf import load_model_and_tokenizer
from focus_hf.aliases import DEFAULT_MODEL
from focus_hf.commands.bench import machine_fields

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from model_prefill import (  # noqa: E402
    DEFAULT_ADAPTER,
    attention_variant,
    command_line,
    held_out_sequence,
    log,
    rounds_to_reach,
    saved_setting,
    setting_fields,
    write_rows,
)


class TokenClock(BaseStreamer):
    """Stamps `time.perf_counter()` at every `put` after the prompt's (one per generated token, batch 1)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.stamps.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


class FollowReference(LogitsProcessor):
    """Notes each step's next-token log-probabilities (batch 1); given `reference` tokens, forces them in turn."""

    def __init__(self, reference: Optional[list[int]] = None) -> None:
        self.reference = reference
        self.log_probs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.log_probs.append(scores[0].float().log_softmax(-1))
        if self.reference is None:
            return scores
        forced = torch.full_like(scores, -math.inf)
        forced[:, self.reference[len(self.log_probs) - 1]] = 0.0
        return forced


@torch.no_grad()
def timed_generate(
    model: PeftModel, input_ids: torch.Tensor, new_tokens: int, cache: str, reference: Optional[list[int]] = None
) -> dict:
    """One greedy generation (teacher-forced on `reference` if given): prefill seconds, decoding tokens/s after the
    first new token, the new tokens and each step's next-token log-probabilities [new_tokens, vocab]."""
    clock, follow = TokenClock(), FollowReference(reference)
    started = time.perf_counter()
    output = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        streamer=clock,
        logits_processor=LogitsProcessorList([follow]),
        cache_implementation=None if cache == "dynamic" else cache,
    )
    stamps = clock.stamps
    return {
        "prefill_s": stamps[0] - started,
        "tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
        "tokens": output[0, input_ids.shape[1] :].tolist(),
        "log_probs": torch.stack(follow.log_probs),
    }


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
    parser.add_argument("--adapter", type=Path, default=DEFAULT_ADAPTER, help="Focus adapter folder")
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
                # Focus follows full attention's greedy tokens (the first run's: greedy decoding is deterministic).
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
                    **setting_fields(args, model, variant == "full"),
                    "repeats": rounds,  # the rounds run, --repeats or more (--min-seconds)
                    **machine_fields(torch.device("cpu")),
                    "command": command_line("model_decode.py", argv),
                    "focus_hf": focus_hf.__version__,
                }
            )
        log(
            f"  decode speedup {rows[-1]['speedup']:.2f}x; Focus's greedy token agrees with full attention's at "
            f"{rows[-1]['argmax_agree']} of {args.new_tokens} steps, mean KL {rows[-1]['mean_kl']:.4f} nats"
        )
        write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
