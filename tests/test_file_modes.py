"""Every file of an adapter folder gets the mode `open()` gives a new file under the umask (0644 under the usual
022), as the config beside it: safetensors 0.8 writes its files 0600, through a temporary file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from peft import get_peft_model
from tiny_models import tiny_model

import focus_hf


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield 0o644
    os.umask(previous)


def modes(folder: Path) -> dict[str, int]:
    return {path.name: stat.S_IMODE(path.stat().st_mode) for path in folder.iterdir() if path.is_file()}


def test_peft_save_pretrained(tmp_path, umask_022):
    model = get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, window=8))
    model.add_adapter("second", focus_hf.FocusConfig(num_groups=4, window=8))
    model.save_pretrained(tmp_path)
    assert set(modes(tmp_path).values()) == {umask_022}, modes(tmp_path)
    assert set(modes(tmp_path / "second").values()) == {umask_022}, modes(tmp_path / "second")  # PEFT's subfolder


def test_transformers_save_pretrained_of_a_loaded_adapter(tmp_path, umask_022):
    get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, window=8)).save_pretrained(tmp_path / "a")
    base = tiny_model("llama")
    base.load_adapter(str(tmp_path / "a"))
    base.save_pretrained(tmp_path / "b")
    assert modes(tmp_path / "b")["adapter_model.safetensors"] == umask_022, modes(tmp_path / "b")


def test_a_narrower_umask_is_kept(tmp_path):
    previous = os.umask(0o077)
    try:
        get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, window=8)).save_pretrained(tmp_path)
    finally:
        os.umask(previous)
    assert set(modes(tmp_path).values()) == {0o600}  # the user asked for owner-only files: they stay so
