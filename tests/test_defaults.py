"""`focus_hf.defaults` (read by the CLI without peft) is what FocusConfig uses."""

import dataclasses

from focus_hf.defaults import FOCUS_DEFAULTS
from focus_hf.tuner.config import FocusConfig


def test_defaults_match_the_config_dataclass():
    fields = {field.name: field.default for field in dataclasses.fields(FocusConfig)}
    assert {name: fields[name] for name in FOCUS_DEFAULTS} == FOCUS_DEFAULTS
