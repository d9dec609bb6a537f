import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import focus_hf  # noqa: E402,F401  registers the adapter type before any test builds a model


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
