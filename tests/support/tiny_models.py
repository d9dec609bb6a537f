"""Tiny random-weight models of every architecture family Focus is tested on (built locally, no download)."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import get_peft_model
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


# --- shared adapter helpers -------------------------------------------------------------------------------
def snapshot(model):
    return (
        [name for name, _ in model.named_modules()],
        {k: v.clone() for k, v in model.state_dict().items()},
        model.config._attn_implementation,
    )


def assert_unmodified(model, before):
    names, state, attention = snapshot(model)
    assert names == before[0] and attention == before[2]
    assert state.keys() == before[1].keys() and all(torch.equal(state[k], before[1][k]) for k in state)
    from focus_hf.tuner.layer import FocusLayer

    assert not any(isinstance(m, FocusLayer) for m in model.modules())


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(seed))


def make_adapter(folder: Path, seed: int = 0) -> torch.Tensor:
    """Save a Focus adapter with perturbed routers for tiny llama to `folder`; return its logits on ids()."""
    from focus_hf.tuner.config import FocusConfig

    model = get_peft_model(tiny_model("llama"), FocusConfig(num_groups=4, window=8))
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "focus_" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator))
    model.eval()
    model.save_pretrained(folder)
    with torch.no_grad():
        return model(input_ids=ids()).logits
