"""Serving Focus adapters with vLLM's CPU engine (the `vllm` extra), a vLLM plugin: `plugin` (the entry point vLLM
loads), `checks` (what is refused at start-up), `adapter` (fetched, verified, split into routers), `model_hooks` (the
routers in vLLM's attention modules), `backend` (the CPU_ATTN subclass), `side_cache` (each cached token's group and
each block's Sinkhorn state, paged like the KV cache), `decode` (a decoding step read from the paged cache in place)
and `versions`.

One adapter per server, named when the engine starts::

    LLM(base, additional_config={"focus_adapter": "org/repo"})
    python -m vllm.entrypoints.openai.api_server --model BASE --additional-config '{"focus_adapter": "org/repo"}'

vLLM loads `focus_hf.vllm.plugin.register` in every one of its processes through the `vllm.general_plugins` entry
point. It checks the engine's configuration before any worker starts (`checks`), fetches and verifies the adapter
with the project's Hub code (`adapter`), gives each attention layer of the served model its router (`model_hooks`),
and replaces the CPU engine's attention backend by one that keeps each cached token's group in a side cache sharing
vLLM's block table (`side_cache`) and runs the Focus pattern over the paged keys (`backend`).

Nothing here imports vLLM at import time except `backend` and `model_hooks`, which run inside vLLM.
"""

from focus_hf.errors import FocusServingError
from focus_hf.vllm.adapter import ServedAdapter, load_served_adapter
from focus_hf.vllm.checks import ADAPTER_KEY as ADDITIONAL_CONFIG_KEY
from focus_hf.vllm.versions import SUPPORTED_VLLM, check_vllm_version

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "SUPPORTED_VLLM",
    "FocusServingError",
    "ServedAdapter",
    "check_vllm_version",
    "load_served_adapter",
]
