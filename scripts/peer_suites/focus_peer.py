"""Focus in place of the adapter configs a peer suite builds (imported by the substituted test files).

The peer suites (PEFT's and transformers' own adapter tests) are run with a Focus adapter wherever they build a
LoRA adapter. ``peer.py`` copies this module next to the substituted test files; each substituted import line of
those files is followed by ``from focus_peer import ...`` with the same names, so ``LoraConfig(...)`` in a test
builds a ``FocusConfig``. Nothing else in the test files changes.

``PEER_OPTIONS`` is the Focus configuration of every peer case: two groups, no local window and no sink tokens,
so that routing changes the outputs of the tests' short (3 to 10 token) inputs, and one group per query.
"""

from __future__ import annotations

from typing import Any

import focus_hf  # noqa: F401  registers the Focus adapter type with PEFT and transformers
from focus_hf import FocusConfig

PEER_OPTIONS: dict[str, Any] = {"num_groups": 2, "window": 0, "sink_tokens": 0, "top_k": 1}


def LoraConfig(*, init_lora_weights: bool = True, **options: Any) -> FocusConfig:
    """``LoraConfig(...)`` of a peer test: a FocusConfig with the same PEFT options.

    ``init_lora_weights`` becomes Focus's ``init_weights`` (False: random routers, as the tests want an adapter
    that changes the outputs). Every other option is passed on as given: the PEFT options (``task_type``,
    ``modules_to_save``, ``target_modules``...) work; LoRA's own (``r``, ``lora_alpha``...) raise
    ``UnknownOptionError``, which the classification counts as LoRA-specific.
    """
    return FocusConfig(**{**PEER_OPTIONS, "init_weights": init_lora_weights, **options})


def LoKrConfig(*, init_weights: bool = True, **options: Any) -> FocusConfig:
    """``LoKrConfig(...)`` where a test uses LoKr as "a non-LoRA adapter": a FocusConfig (same ``init_weights``)."""
    return FocusConfig(**{**PEER_OPTIONS, "init_weights": init_weights, **options})


def IA3Config(*, feedforward_modules: Any = None, **options: Any) -> FocusConfig:
    """``IA3Config(...)`` where a test uses IA3 as "a non-LoRA adapter": a FocusConfig.

    ``feedforward_modules`` (which of IA3's target modules are feed-forward layers) has no Focus meaning and is
    dropped; Focus routes attention modules only.
    """
    del feedforward_modules
    return FocusConfig(**{**PEER_OPTIONS, **options})


SUBSTITUTED = ("LoraConfig", "LoKrConfig", "IA3Config")
