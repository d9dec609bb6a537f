"""Perplexity of a model with or without its Focus adapter, over strided windows of held-out text.

The windows follow the sliding-window scheme of the Hugging Face perplexity guide: windows of `seq_len` tokens
start every `stride` tokens, and each window scores only the tokens the previous window did not (the first window
scores all its predictable tokens), so every token after the first is scored exactly once, with at least
`seq_len - stride` tokens of context from the second window on.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from focus_hf.data import token_blocks
from focus_hf.tuner.controls import focus_layers, set_routing

__all__ = ["MODES", "perplexity", "routing_mode", "strided_windows"]

MODES = ("full", "soft", "hard")


def strided_windows(
    data: Any,
    texts: Optional[Sequence[str]],
    seq_len: int,
    stride: int,
    max_blocks: Optional[int],
) -> torch.Tensor:
    """The [n, seq_len] windows to score: from a tokenizer + texts, a 1-D token stream, or ready windows."""
    if isinstance(data, torch.Tensor):
        if data.dim() == 1:
            if data.numel() < seq_len:
                raise ValueError(f"the token stream has {data.numel()} tokens, fewer than seq_len={seq_len}")
            windows = data.long().unfold(0, seq_len, stride)
        elif data.dim() == 2:
            if data.shape[1] != seq_len:
                raise ValueError(f"the blocks are {data.shape[1]} tokens long, but seq_len={seq_len}")
            windows = data.long()
        else:
            raise ValueError(f"expected a 1-D token stream or 2-D windows, got shape {tuple(data.shape)}")
        return windows[:max_blocks] if max_blocks is not None else windows
    if texts is None:
        raise ValueError("pass the texts to score along with the tokenizer (texts=...), or a tensor of tokens")
    return token_blocks(data, texts, seq_len, stride=stride, max_blocks=max_blocks)


def _adapter_off(model: nn.Module) -> contextlib.AbstractContextManager:
    """Context in which `model` runs as its base model (PEFT's disable_adapter, or transformers' integration)."""
    if hasattr(model, "disable_adapter") and hasattr(model, "peft_config") and hasattr(model, "base_model"):
        return model.disable_adapter()
    if getattr(model, "_hf_peft_config_loaded", False):

        @contextlib.contextmanager
        def disabled() -> Iterator[None]:
            model.disable_adapters()
            try:
                yield
            finally:
                model.enable_adapters()

        return disabled()
    return contextlib.nullcontext()


@contextlib.contextmanager
def routing_mode(
    model: nn.Module, mode: str, top_k: Optional[int] = None, backend: Optional[str] = None
) -> Iterator[None]:
    """Run `model` with routing `mode` ("soft"/"hard"/"auto") and `top_k`, restoring each layer's overrides after."""
    layers = focus_layers(model)
    saved = [(layer.mode_override, layer.top_k_override, layer.backend) for layer in layers]
    try:
        if backend is None:
            for layer in layers:
                layer.set_routing(mode, top_k, layer.backend)
        else:
            set_routing(model, mode, top_k, backend)
        yield
    finally:
        for layer, (mode_override, top_k_override, layer_backend) in zip(layers, saved):
            layer.mode_override, layer.top_k_override, layer.backend = mode_override, top_k_override, layer_backend


@torch.no_grad()
def perplexity(
    model: nn.Module,
    data: Any,
    texts: Optional[Sequence[str]] = None,
    *,
    seq_len: int,
    stride: Optional[int] = None,
    mode: str = "hard",
    top_k: Optional[int] = None,
    max_blocks: Optional[int] = None,
    batch_size: int = 1,
    backend: Optional[str] = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Perplexity over strided windows.

    Args:
        model: a PeftModel (or transformers model) with a Focus adapter; for `mode="full"` any causal LM.
        data: a tokenizer (then pass `texts`), a 1-D LongTensor token stream, or a 2-D LongTensor of windows
            [n, seq_len] taken every `stride` tokens of one stream (what `data.token_blocks(tokenizer, texts,
            seq_len, stride=stride)` returns; with the default stride these are disjoint blocks).
        texts: the documents to score when `data` is a tokenizer (concatenated with eos between them).
        seq_len: tokens per window.
        stride: distance between window starts (1..seq_len); default `seq_len` (disjoint windows).
        mode: "full" (the base model, adapter disabled), "soft" (differentiable routing, dense cost) or
            "hard" (the sparse pattern used at inference).
        top_k: groups each query probes in hard mode; None keeps the adapter's configured value.
        max_blocks: score at most this many windows.
        batch_size: windows per forward pass.
        backend: hard-mode attention backend (None keeps each layer's current one).
        progress: show a progress bar.

    Returns:
        {"ppl", "nll", "tokens", "windows", "mode", "top_k", "seq_len", "stride", "seconds"}.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    stride = seq_len if stride is None else stride
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be between 1 and seq_len={seq_len}, got {stride}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    windows = strided_windows(data, texts, seq_len, stride, max_blocks)
    if mode == "full":
        context = _adapter_off(model)
        reported_top_k = None
    else:
        context = routing_mode(model, mode, top_k, backend)
        reported_top_k = top_k if top_k is not None else _configured_top_k(model)

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_nll = 0.0
    total_tokens = 0
    started = time.perf_counter()
    batches = range(0, windows.shape[0], batch_size)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc=f"perplexity ({mode})", unit="batch")
    try:
        with context:
            for start in batches:
                batch = windows[start : start + batch_size].to(device)
                logits = model(input_ids=batch, use_cache=False).logits
                # Window w > 0 scores only its last `stride` tokens; window 0 every token after the first.
                for row in range(batch.shape[0]):
                    first_target = 1 if start + row == 0 else seq_len - stride
                    first_target = max(first_target, 1)
                    predicted = logits[row, first_target - 1 : seq_len - 1].float()
                    targets = batch[row, first_target:seq_len]
                    total_nll += F.cross_entropy(predicted, targets, reduction="sum").item()
                    total_tokens += targets.numel()
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - started
    nll = total_nll / max(total_tokens, 1)
    return {
        "ppl": math.exp(nll),
        "nll": nll,
        "tokens": total_tokens,
        "windows": int(windows.shape[0]),
        "mode": mode,
        "top_k": reported_top_k,
        "seq_len": seq_len,
        "stride": stride,
        "seconds": round(seconds, 3),
    }


def _configured_top_k(model: nn.Module) -> Optional[int]:
    values = {
        layer.top_k_override or settings.top_k
        for layer in focus_layers(model)
        for settings in layer.focus_settings.values()
    }
    return values.pop() if len(values) == 1 else None


# Tokens generated for a passkey answer: a five-digit key (one token per digit for SmolLM2's tokenizer), its full
# stop, and one to spare.
PASSKEY_ANSWER_TOKENS = 7


@torch.no_grad()
def passkey_answer(
    model: nn.Module, tokenizer: Any, input_ids: torch.Tensor, max_new_tokens: int = PASSKEY_ANSWER_TOKENS
) -> str:
    """The model's greedy continuation of one prompt `input_ids` [n] (e.g. `focus_hf.data.passkey_prompt`)."""
    output = model.generate(
        input_ids=input_ids[None],
        attention_mask=torch.ones_like(input_ids)[None],
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(output[0, input_ids.numel() :], skip_special_tokens=True)
