"""Routers in vLLM's attention modules: each routed layer scores its input tokens before its attention runs.

The routers read the hidden state that enters the attention block (before the q/k/v projections and RoPE), which
vLLM's attention backend never sees; so the attention module's `forward` is wrapped to compute the scores and leave
them on its `Attention` layer, where `backend.FocusCPUAttentionImpl` picks them up in the same call. The module's
`__init__` is wrapped to give each layer its router when the engine was started with a Focus adapter.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from focus_hf.vllm.adapter import served_adapter
from focus_hf.vllm.backend import ROUTER_ATTRIBUTE, SCORES_ATTRIBUTE

logger = logging.getLogger("focus_hf.vllm")
_WRAPPED = "_focus_wrapped"


def attention_classes() -> list[type]:
    """The attention module classes of the supported model families (`checks.SUPPORTED_ARCHITECTURES`)."""
    from vllm.model_executor.models.llama import LlamaAttention

    return [LlamaAttention]


def install() -> None:
    """Wrap `__init__` and `forward` of the supported attention modules (once per process)."""
    for cls in attention_classes():
        if getattr(cls, _WRAPPED, False):
            continue
        cls.__init__ = _routed_init(cls.__init__)
        cls.forward = _routed_forward(cls.forward)
        setattr(cls, _WRAPPED, True)


def _routed_init(original):
    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        from vllm.config import get_current_vllm_config
        from vllm.model_executor.models.utils import extract_layer_index

        adapter = served_adapter(get_current_vllm_config())
        if adapter is None:
            return
        index = extract_layer_index(self.attn.layer_name)
        setattr(self.attn, ROUTER_ATTRIBUTE, adapter.routers[index])

    return __init__


def _routed_forward(original):
    @functools.wraps(original)
    def forward(self, positions, hidden_states, *args: Any, **kwargs: Any):
        router = getattr(self.attn, ROUTER_ATTRIBUTE, None)
        if router is not None:
            router = router.to(hidden_states.device)
            setattr(self.attn, ROUTER_ATTRIBUTE, router)
            setattr(self.attn, SCORES_ATTRIBUTE, router.scores(hidden_states))
        return original(self, positions, hidden_states, *args, **kwargs)

    return forward
