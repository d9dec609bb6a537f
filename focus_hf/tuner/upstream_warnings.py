"""Warnings that PEFT or transformers raise inside calls Focus makes for the user, who can do nothing about them.

Each is silenced only around the call of ours that triggers it (a `warnings.catch_warnings` block matching its
category and message), never globally: a user's own `get_peft_model` call still shows them.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

# peft 0.21 reads `model.is_gradient_checkpointing` whenever it wraps a model (`PeftModel.__init__`), a property that
# transformers 5 deprecates in favour of `is_activation_checkpointing`.
_CHECKPOINTING_DEPRECATION = r"`is_gradient_checkpointing` is deprecated"


@contextlib.contextmanager
def quiet_peft_wrapping() -> Iterator[None]:
    """Around `get_peft_model` / `PeftModel.from_pretrained`: hides transformers' FutureWarning that peft's own
    read of `is_gradient_checkpointing` raises. Other warnings pass through."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_CHECKPOINTING_DEPRECATION, category=FutureWarning)
        yield
