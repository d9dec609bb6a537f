"""Registration of Focus with PEFT (adapter type) and transformers (attention and mask functions).

PEFT has no plugin discovery: `register_peft_method` accepts only names already in the `PeftType` enum, and
transformers reads `peft_type.value.lower()`, so a FOCUS member (name == value, like every other member) is
added to the enum before registering.
"""

from __future__ import annotations

from peft.utils import PeftType

PEFT_TYPE_NAME = "FOCUS"


def _add_enum_member(enum_class: type, name: str) -> object:
    if name in enum_class.__members__:
        return enum_class[name]
    member = str.__new__(enum_class, name)
    member._name_ = name
    member._value_ = name
    member.__objclass__ = enum_class
    member.__init__(name)
    type.__setattr__(enum_class, name, member)
    enum_class._member_names_.append(name)
    enum_class._member_map_[name] = member
    enum_class._value2member_map_[name] = member
    return member


FOCUS_PEFT_TYPE = _add_enum_member(PeftType, PEFT_TYPE_NAME)


def register() -> None:
    """Register the Focus adapter type with PEFT and its attention + mask functions with transformers (idempotent)."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
    from peft.utils import register_peft_method
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from .attention import ATTENTION_NAME, focus_attention_forward
    from .config import FocusConfig
    from .model import FocusModel

    if FOCUS_PEFT_TYPE not in PEFT_TYPE_TO_CONFIG_MAPPING:
        register_peft_method(name=PEFT_TYPE_NAME.lower(), config_cls=FocusConfig, model_cls=FocusModel, prefix="focus_")
    AttentionInterface.register(ATTENTION_NAME, focus_attention_forward)
    # The attention function decodes padding from the same boolean masks SDPA receives.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
