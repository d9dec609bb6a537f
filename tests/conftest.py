import os
import sys
from pathlib import Path

# Telemetry would reach the real Hub; the Hub tests point the client at a local server (tests/hub_server.py).
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import focus_hf  # noqa: E402,F401  registers the adapter type before any test builds a model


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
