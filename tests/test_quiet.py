"""`import focus_hf` holds back what optional packages print while they are imported, and only then; peft's wrapping
of a Focus model raises no FutureWarning, while its wrapping of other adapters is left as it is."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model
from tiny_models import tiny_model

import focus_hf

REPO_ROOT = Path(__file__).resolve().parents[1]
NOISY = [name for name in ("torchao", "bitsandbytes") if importlib.util.find_spec(name) is not None]


def run(code: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not NOISY, reason="neither torchao nor bitsandbytes is installed (the 'quant' / 'test' extras)")
def test_importing_peft_after_focus_hf_prints_nothing():
    child = run("import focus_hf, peft, transformers\n" + "".join(f"import {name}\n" for name in NOISY))
    assert child.returncode == 0, child.stderr
    assert child.stderr == ""


@pytest.mark.skipif("torchao" not in NOISY, reason="torchao is not installed")
def test_only_the_import_is_quiet():
    """After the import, the same logger's records print again: nothing is filtered for good."""
    code = (
        "import logging, focus_hf, torchao\n"
        "logging.getLogger('torchao').warning('Failed to load /x/_C.so: after the import')\n"
    )
    child = run(code)
    assert child.returncode == 0, child.stderr
    assert child.stderr.strip() == "Failed to load /x/_C.so: after the import"


def test_the_hook_holds_back_only_the_listed_messages():
    import logging

    from focus_hf.quiet import quiet_logs

    logger = logging.getLogger("focus_hf.test_quiet")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger.addHandler(handler)
    try:
        with quiet_logs({"focus_hf.test_quiet": (r"Failed to load",)}):
            logger.warning("Failed to load x.so")
            logger.warning("something else")
        logger.warning("Failed to load y.so")
    finally:
        logger.removeHandler(handler)
    assert records == ["something else", "Failed to load y.so"]


def test_wrapping_a_focus_model_raises_no_future_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, window=8))
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]


def test_wrapping_another_adapter_type_is_left_as_peft_does_it():
    """The hold-back is Focus's own: a LoRA model gets whatever peft and transformers say."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_peft_model(tiny_model("llama"), LoraConfig(target_modules=["q_proj"]))
    assert [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
