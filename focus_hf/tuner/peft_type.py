"""The FOCUS member of peft's `PeftType` enum.

PEFT has no plugin discovery: `register_peft_method` accepts only names already in the `PeftType` enum, and
transformers reads `peft_type.value.lower()`, so a FOCUS member (name == value, like every other member) is
added to the enum when this module is imported.
"""

from __future__ import annotations

from peft.utils import PeftType

from focus_hf.files import PEFT_TYPE_NAME


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
