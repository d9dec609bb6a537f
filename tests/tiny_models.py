"""Tiny random-weight models of every architecture family Focus is tested on (built locally, no download)."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 128
TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
COMMON = dict(
    **TOKENS,
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
)

CONFIGS = {
    "gpt2": lambda: GPT2Config(**TOKENS, vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=512),
    "llama": lambda: LlamaConfig(**COMMON, num_key_value_heads=2),
    "qwen2": lambda: Qwen2Config(**COMMON, num_key_value_heads=2),  # q/k/v projections carry biases
    "olmo2": lambda: Olmo2Config(**COMMON, num_key_value_heads=4),  # QK-norm
    "gemma2": lambda: Gemma2Config(
        **COMMON,
        num_key_value_heads=2,
        head_dim=12,
        sliding_window=24,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=12,
    ),
    "mistral": lambda: MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=40),
    "qwen3": lambda: Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=12),
    "phi3": lambda: Phi3Config(**COMMON, num_key_value_heads=2),
}
ARCHITECTURES = sorted(CONFIGS)


def tiny_model(architecture: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer random-weight causal LM of `architecture` in fp32 eval mode."""
    torch.manual_seed(seed)
    config = CONFIGS[architecture]()
    attn = "eager" if architecture == "gemma2" else "sdpa"
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
