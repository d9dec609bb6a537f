"""What a Focus server refuses at start-up, checked on vLLM's configuration before any worker starts.

Every refusal is an error, never a fallback to dense attention: a server that answers without the adapter it was
asked to run would look like Focus and not be it.
"""

from __future__ import annotations

from typing import Any, Optional

from focus_hf.errors import FocusServingError

# Model classes whose attention modules `model_hooks` gives a router: vLLM's Llama attention (SmolLM2, Llama 2/3).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
ADAPTER_KEY = "focus_adapter"
REVISION_KEY = "focus_adapter_revision"
KNOWN_KEYS = (ADAPTER_KEY, REVISION_KEY)


def requested_adapter(additional_config: Any) -> Optional[tuple[str, Optional[str]]]:
    """(adapter, revision) named in vLLM's `additional_config`, or None when the server runs no Focus adapter."""
    if not isinstance(additional_config, dict) or ADAPTER_KEY not in additional_config:
        unknown = [key for key in (additional_config or {}) if str(key).startswith("focus")]
        if unknown:
            raise FocusServingError(
                f"additional_config has {unknown} but no {ADAPTER_KEY!r}: name the adapter with "
                f'{{"{ADAPTER_KEY}": "org/repo"}} (a Hub id or a local folder).'
            )
        return None
    unknown = [key for key in additional_config if str(key).startswith("focus") and key not in KNOWN_KEYS]
    if unknown:
        raise FocusServingError(f"Unknown Focus keys in additional_config: {unknown}; known: {list(KNOWN_KEYS)}.")
    revision = additional_config.get(REVISION_KEY)
    if revision is not None and not isinstance(revision, str):
        raise FocusServingError(f"{REVISION_KEY!r} must be a branch, tag or commit string, got {revision!r}.")
    return additional_config[ADAPTER_KEY], revision


def refusals(vllm_config: Any) -> list[str]:
    """The reasons this engine configuration cannot serve a Focus adapter exactly (empty: it can)."""
    problems = []
    model_config = vllm_config.model_config
    architectures = list(getattr(model_config, "architectures", None) or [])
    if not any(name in SUPPORTED_ARCHITECTURES for name in architectures):
        problems.append(
            f"the model family {architectures or '(unknown)'} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}); Focus needs the router wired into its attention layers"
        )
    if vllm_config.lora_config is not None:
        problems.append("LoRA is enabled (--enable-lora): Focus serves one adapter per server and no LoRA beside it")
    if vllm_config.speculative_config is not None:
        problems.append(
            "speculative decoding is configured: the draft tokens' routing would have to be rolled back on rejection,"
            " which the side cache does not do"
        )
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        problems.append(
            f"pipeline parallelism ({parallel.pipeline_parallel_size} stages) is not supported; serve on one stage"
        )
    if parallel.tensor_parallel_size > 1:
        problems.append(
            f"tensor parallelism ({parallel.tensor_parallel_size} ranks) is not supported yet: the routers read the "
            "full hidden state, which is replicated, but the kv heads of `dense_heads` would be split across ranks"
        )
    if getattr(model_config, "runner_type", "generate") != "generate":
        problems.append(f"runner {model_config.runner_type!r}: Focus serves text generation only")
    sliding = getattr(model_config.hf_text_config, "sliding_window", None)
    if sliding:
        problems.append(f"the model uses a sliding window ({sliding}), which the Focus backend does not apply")
    positions = getattr(model_config.hf_text_config, "max_position_embeddings", None)
    if positions and model_config.max_model_len > positions:
        problems.append(
            f"max_model_len {model_config.max_model_len} exceeds the model's max_position_embeddings {positions}: "
            "vLLM's CPU rotary embedding reads its cos/sin table without a bound, so tokens past it get garbage keys "
            "(norms near 5e16 were seen), where transformers computes their rotation. Extend the table with "
            f'hf_overrides={{"max_position_embeddings": {model_config.max_model_len}}} (--hf-overrides), or serve '
            f"at most {positions} tokens"
        )
    kv_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if kv_dtype != "auto":
        problems.append(f"a quantized KV cache ({kv_dtype}) is not supported: keep --kv-cache-dtype auto")
    return problems


def check_engine(vllm_config: Any, platform_name: str) -> None:
    """Raise `FocusServingError` listing every reason the engine cannot serve the Focus adapter it was asked to."""
    problems = refusals(vllm_config)
    if platform_name != "cpu":
        problems.append(
            f"the {platform_name} platform: this release of focus_hf.vllm serves on vLLM's CPU engine only (its "
            "attention backend subclasses CPU_ATTN and reads that KV-cache layout); the GPU build is not measured"
        )
    if problems:
        listed = "\n  - ".join(problems)
        raise FocusServingError(
            f"vLLM cannot serve this Focus adapter exactly, so the server does not start:\n  - {listed}\n"
            "Remove those options (or serve without additional_config's 'focus_adapter' for plain dense attention)."
        )
