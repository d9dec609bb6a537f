"""What the whole-model benchmarks share: the held-out text they read, the two variants they compare (the base model
with the adapter disabled, and Focus hard mode), the setting a row names, a KV cache read by one variant, and a timed
greedy `generate()` (`timed_generate`: a streamer stamps every new token)."""

from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, ContextManager, Optional, Union

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StaticCache
from transformers.generation.streamers import BaseStreamer

from focus_hf.data import load_texts, split_texts, token_blocks
from focus_hf.evaluation import routing_mode

if TYPE_CHECKING:
    import argparse

    from peft import PeftModel

# The committed long-context adapter, the setting that keeps the model's answers (relative to the repository).
COMMITTED_ADAPTER = Path("benchmarks") / "long_context" / "adapter"
# `attention_variant`'s top_k per variant: "full" disables the adapter; None runs it as saved.
VARIANTS = {"full": "full", "focus": None}


@functools.lru_cache(maxsize=1)
def held_out_texts() -> tuple[str, ...]:
    """The held-out split of the standard-library source (read once: it is the whole stdlib)."""
    _, heldout = split_texts(load_texts("python-source"), heldout_fraction=0.1, seed=0)
    return tuple(heldout)


def held_out_sequence(tokenizer, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of the held-out standard-library source, [1, seq_len]."""
    return token_blocks(tokenizer, held_out_texts(), seq_len, max_blocks=1)


def attention_variant(model: PeftModel, top_k: Union[str, int, None], backend: str) -> ContextManager:
    """Run `model` with top_k "full": the adapter disabled (full attention); else Focus hard mode with that top_k
    (None: the adapter as saved)."""
    return model.disable_adapter() if top_k == "full" else routing_mode(model, "hard", top_k, backend)


def saved_setting(model: PeftModel) -> str:
    """The adapter's own hard-mode setting, in words."""
    config = model.peft_config["default"]
    parts = [f"top-{config.top_k}", f"w={config.window}", f"{len(config.dense_heads or [])} dense heads"]
    if config.dense_below:
        parts.append(f"dense below {config.dense_below}")
    return ", ".join(parts)


def setting_fields(args: argparse.Namespace, model: PeftModel, full_attention: bool, repository: Path) -> dict:
    """Row fields that name what was run: backend, repeats, adapter (relative to `repository`), text and the model's
    trained positions."""
    return {
        "backend": "sdpa (transformers)" if full_attention else args.backend,
        "repeats": args.repeats,
        "adapter": os.path.relpath(args.adapter, repository),
        "text": "python-source held-out split (seed 0), first tokens",
        "model_max_positions": model.config.max_position_embeddings,
    }


@torch.no_grad()
def prefilled(model: PeftModel, input_ids: torch.Tensor, variant: str, cache_kind: str, steps: int):
    """(cache, next token) after reading `input_ids` with `variant` (a key of VARIANTS) into a KV cache of its own
    (`cache_kind` "static": room for `steps` more), and two untimed steps (warm-up)."""
    with attention_variant(model, VARIANTS[variant], "auto"):
        length = input_ids.shape[1]
        if cache_kind == "static":
            cache = StaticCache(config=model.config, max_cache_len=length + steps + 8)
        else:
            cache = DynamicCache()
        token = model(input_ids=input_ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(2):
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return cache, token


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
