"""Registration of Focus with PEFT (adapter type) and transformers (attention and mask functions).

The FOCUS member of peft's `PeftType` enum is added first (`focus_hf.tuner.peft_type`).
"""

from __future__ import annotations

from focus_hf.files import PEFT_TYPE_NAME
from focus_hf.tuner.peft_type import FOCUS_PEFT_TYPE


def register() -> None:
    """Register the Focus adapter type with PEFT and its attention + mask functions with transformers (idempotent)."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
    from peft.utils import register_peft_method
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from focus_hf.attention.function import ATTENTION_NAME, focus_attention_forward
    from focus_hf.tuner import checked_weights, dispatch, model
    from focus_hf.tuner.config import FocusConfig
    from focus_hf.tuner.model import FocusModel

    if FOCUS_PEFT_TYPE not in PEFT_TYPE_TO_CONFIG_MAPPING:
        register_peft_method(name=PEFT_TYPE_NAME.lower(), config_cls=FocusConfig, model_cls=FocusModel, prefix="focus_")
    # PeftModel.from_pretrained on a base dispatched with disk/CPU offload (device_map="auto").
    dispatch.install()
    # PeftModel.set_adapter([a, b]) and save_pretrained(safe_serialization=False): refused with our errors.
    model.install()
    # Every loader puts into the model the tensors the tuner checked, from safetensors, never a pickle.
    checked_weights.install()
    AttentionInterface.register(ATTENTION_NAME, focus_attention_forward)
    # The attention function decodes padding from the same boolean masks SDPA receives.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
