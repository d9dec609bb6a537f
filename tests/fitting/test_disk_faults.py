"""Faults on disk: saving an adapter or a distillation checkpoint onto a full disk leaves the files saved before as
they were and raises `FileWriteError`; a distillation stopped by Ctrl-C (KeyboardInterrupt) resumes from its last
finished layer and ends where an uninterrupted run does."""

from __future__ import annotations

import errno
import json
import subprocess
from pathlib import Path

import peft.peft_model
import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from tiny_models import tiny_model

import focus_hf
import focus_hf.fitting.distill as distill
import focus_hf.fitting.layerwise as layerwise
from focus_hf.errors import FileWriteError
from focus_hf.fitting.distill import CHECKPOINT_STATE, CHECKPOINT_WEIGHTS, DistillSettings, distill_routers
from focus_hf.fitting.layerwise import distill_routers_layerwise
from focus_hf.tuner.controls import focus_layers

SETTINGS = DistillSettings(steps=10, lr=0.05, top_m=16, queries_per_sequence=64)
ROUTERS = ("focus_proj", "focus_centroids", "focus_query_proj")


def focus_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = focus_hf.FocusConfig(num_groups=4, group_dim=8, window=8, top_k=1, sink_tokens=2, query_projection=True)
    return get_peft_model(tiny_model("llama"), config).eval()


def sequences() -> list[torch.Tensor]:
    return [torch.randint(3, 128, (160,), generator=torch.Generator().manual_seed(i)) for i in range(2)]


def routers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "focus_" in name}


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too) by relative path."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def full_disk_after(half: bool):
    """A stand-in for safetensors' save_file that writes part of the file (when `half`), then fails as a full disk
    does (safetensors reports it as an OSError-like error of its own; an OSError here)."""

    def save_file(tensors, filename, metadata=None):
        if half:
            Path(filename).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    return save_file


def test_saving_an_adapter_onto_a_full_disk_keeps_the_previous_one(tmp_path, monkeypatch):
    folder = tmp_path / "adapter"
    focus_model(seed=1).save_pretrained(folder)
    before = folder_bytes(folder)
    monkeypatch.setattr(peft.peft_model, "safe_save_file", full_disk_after(half=True))
    with pytest.raises(FileWriteError, match="No space left on device.*unchanged"):
        focus_model(seed=2).save_pretrained(folder)
    assert folder_bytes(folder) == before  # nothing written over, no temporary file left


def tmpfs(folder: Path, size: str) -> Path:
    """A tmpfs of `size` mounted on `folder`; the test skips where none can be mounted (mounting needs root)."""
    folder.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"a tmpfs cannot be mounted here ({result.stderr.decode().strip() or 'mount failed'})")
    return folder


def fill(disk: Path, leave: int) -> Path:
    """A file that takes all of `disk`'s free space but `leave` bytes."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 1024)
        except OSError:  # full
            pass
    with open(filler, "r+b") as handle:
        handle.truncate(max(filler.stat().st_size - leave, 0))
    return filler


def test_saving_onto_a_really_full_disk_keeps_the_previous_adapter_and_a_retry_completes(tmp_path):
    disk = tmpfs(tmp_path / "disk", "256k")
    try:
        folder = disk / "adapter"
        focus_model(seed=1).save_pretrained(folder)
        before = folder_bytes(folder)
        filler = fill(disk, leave=2048)  # less than the adapter's files take
        newer = focus_model(seed=2)
        with pytest.raises(FileWriteError, match="No space left on device"):
            newer.save_pretrained(folder)
        assert folder_bytes(folder) == before
        filler.unlink()
        newer.save_pretrained(folder)  # space again: the save completes
        loaded = PeftModel.from_pretrained(tiny_model("llama"), folder)
        for name, value in routers(newer).items():
            torch.testing.assert_close(dict(loaded.named_parameters())[name], value)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_checkpoint_onto_a_full_disk_keeps_the_previous_one_and_the_run_resumes(tmp_path, monkeypatch):
    data = sequences()
    uninterrupted = focus_model(seed=3)
    distill_routers(uninterrupted, data, SETTINGS, progress=False)
    real_save = distill.save_file
    saves = []

    def second_save_fails(tensors, filename, metadata=None):
        saves.append(filename)
        if len(saves) == 2:
            return full_disk_after(half=True)(tensors, filename)
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(distill, "save_file", second_save_fails)
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(FileWriteError, match="No space left on device"):
        distill_routers(focus_model(seed=3), data, SETTINGS, checkpoint_dir=checkpoints, progress=False)
    state = json.loads((checkpoints / CHECKPOINT_STATE).read_text())
    assert [row["layer"] for row in state["layers_done"]] == [0]  # the first layer's checkpoint, whole
    assert set(load_file(checkpoints / CHECKPOINT_WEIGHTS)) == {"0.proj", "0.centroids", "0.query_proj"}
    assert sorted(path.name for path in checkpoints.iterdir()) == sorted([CHECKPOINT_STATE, CHECKPOINT_WEIGHTS])
    monkeypatch.setattr(distill, "save_file", real_save)
    resumed = focus_model(seed=3)
    distill_routers(resumed, data, SETTINGS, checkpoint_dir=checkpoints, progress=False)
    assert_same_routers(resumed, uninterrupted)


def assert_same_routers(model: torch.nn.Module, want: torch.nn.Module) -> None:
    for a, b in zip(focus_layers(model), focus_layers(want)):
        for name in ROUTERS:
            torch.testing.assert_close(getattr(a, name)["default"], getattr(b, name)["default"])


@pytest.mark.parametrize("fit", [distill_routers, distill_routers_layerwise], ids=["distill", "layerwise"])
@pytest.mark.parametrize("where", ["fitting", "checkpointing"])
def test_a_distillation_stopped_by_ctrl_c_resumes_from_its_last_finished_layer(tmp_path, monkeypatch, fit, where):
    """Ctrl-C while the second layer is fitted, or while its checkpoint is written (after part of the file): the
    checkpoint holds the first layer whole, and a resumed run fits the second and ends as an uninterrupted one."""
    data = sequences()
    uninterrupted = focus_model(seed=4)
    fit(uninterrupted, data, SETTINGS, progress=False)
    fitted, saved = [], []
    real_fit, real_save = distill.fit_layer, distill.save_file

    def interrupted_fit(layer, *args, **kwargs):
        fitted.append(layer.layer_index)
        if where == "fitting" and len(fitted) == 2:
            raise KeyboardInterrupt
        return real_fit(layer, *args, **kwargs)

    def interrupted_save(tensors, filename, metadata=None):
        saved.append(filename)
        if where == "checkpointing" and len(saved) == 2:
            Path(filename).write_bytes(b"\0" * 100)
            raise KeyboardInterrupt
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(distill if fit is distill_routers else layerwise, "fit_layer", interrupted_fit)
    monkeypatch.setattr(distill, "save_file", interrupted_save)
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(KeyboardInterrupt):
        fit(focus_model(seed=4), data, SETTINGS, checkpoint_dir=checkpoints, progress=False)
    assert sorted(path.name for path in checkpoints.iterdir()) == sorted([CHECKPOINT_STATE, CHECKPOINT_WEIGHTS])
    state = json.loads((checkpoints / CHECKPOINT_STATE).read_text())
    assert [row["layer"] for row in state["layers_done"]] == [0]
    fitted.clear()
    resumed = focus_model(seed=4)
    results = fit(resumed, data, SETTINGS, checkpoint_dir=checkpoints, progress=False)
    assert fitted == [1]  # only the layer left to fit
    assert [result.layer for result in results] == [0, 1]
    assert_same_routers(resumed, uninterrupted)
