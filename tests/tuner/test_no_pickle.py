"""Every local entry point that loads a Focus adapter puts the checked safetensors tensors into the model, never a
pickle: a hostile `adapter_model.bin` (NaN routers, which would leave the logits finite) lies beside the safetensors
file in each test, and NaN routers in the safetensors file itself are refused on every path with the model untouched.
The Hub entry points are tested in tests/hub/test_hub_loading.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from tiny_models import assert_unmodified, ids, make_adapter, snapshot, tiny_model
from transformers import AutoModelForCausalLM

import focus_hf  # noqa: F401  (registers Focus)
from focus_hf.files import AdapterFileError


def routers(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "focus_" in name}


def logits_of(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids()).logits


def write_hostile_bin(folder) -> None:
    """`adapter_model.bin` beside the safetensors file: the same keys, every value NaN."""
    tensors = load_file(folder / "adapter_model.safetensors")
    hostile = {key: torch.full_like(value, float("nan")) for key, value in tensors.items()}
    torch.save(hostile, folder / "adapter_model.bin")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A tiny llama base saved as a pickle (for `use_safetensors=False`, which applies to the base too) and as
    safetensors, and an adapter folder naming it, with a hostile .bin beside the adapter's safetensors."""
    root = tmp_path_factory.mktemp("no-pickle")
    base = tiny_model("llama")
    base.save_pretrained(root / "base")
    torch.save(base.state_dict(), root / "base" / "pytorch_model.bin")
    logits = make_adapter(root / "adapter")
    config_path = root / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = str(root / "base")
    config_path.write_text(json.dumps(config))
    write_hostile_bin(root / "adapter")
    return root, logits


@pytest.fixture
def no_torch_load(monkeypatch):
    """Fail the test if anything unpickles a file while the adapter loads."""

    def forbidden(*args, **kwargs):
        raise AssertionError(f"torch.load called on {args[:1]}")

    monkeypatch.setattr(torch, "load", forbidden)


def nan_copy(folder, tmp_path):
    """A copy of `folder` whose safetensors routers hold a NaN (and the hostile .bin beside)."""
    copy = tmp_path / "nan-adapter"
    shutil.copytree(folder, copy)
    tensors = load_file(copy / "adapter_model.safetensors")
    next(iter(tensors.values()))[0, 0] = float("nan")
    save_file(tensors, copy / "adapter_model.safetensors")
    return copy


def test_peft_from_pretrained_reads_the_safetensors(adapter, no_torch_load):
    root, logits = adapter
    model = PeftModel.from_pretrained(tiny_model("llama"), root / "adapter")
    assert torch.equal(logits_of(model), logits)


def test_peft_load_adapter_reads_the_safetensors(adapter, no_torch_load):
    root, logits = adapter
    model = PeftModel.from_pretrained(tiny_model("llama"), root / "adapter")
    model.load_adapter(root / "adapter", adapter_name="second")
    model.set_adapter("second")
    assert torch.equal(logits_of(model), logits)
    # Reloading into an adapter that exists (PEFT injects nothing then) still reads safetensors only.
    model.load_adapter(root / "adapter", adapter_name="second")
    assert torch.equal(logits_of(model), logits)


@pytest.mark.parametrize("use_safetensors", [None, True, False])
def test_transformers_load_adapter_reads_the_safetensors(adapter, no_torch_load, use_safetensors):
    root, logits = adapter
    model = tiny_model("llama")
    kwargs = {} if use_safetensors is None else {"use_safetensors": use_safetensors}
    model.load_adapter(str(root / "adapter"), **kwargs)
    assert all(bool(p.isfinite().all()) for p in routers(model).values())
    assert torch.equal(logits_of(model), logits)


def test_auto_model_from_adapter_folder_reads_the_safetensors(adapter):
    # use_safetensors=False also loads the base from its pytorch_model.bin (the user's choice for the base):
    # torch.load runs for the base here, so the routers are compared instead.
    root, logits = adapter
    model = AutoModelForCausalLM.from_pretrained(root / "adapter", use_safetensors=False)
    expected = load_file(root / "adapter" / "adapter_model.safetensors")
    loaded = routers(model)
    assert len(loaded) == len(expected)
    for key, value in expected.items():
        module = key.removeprefix("base_model.model.")
        assert torch.equal(loaded[f"{module}.default"], value)
    assert torch.equal(logits_of(model), logits)


def test_pickle_only_reload_into_an_existing_adapter_is_refused(adapter, tmp_path):
    root, logits = adapter
    model = PeftModel.from_pretrained(tiny_model("llama"), root / "adapter")
    pickled = tmp_path / "pickled"
    shutil.copytree(root / "adapter", pickled)
    (pickled / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterFileError, match="pickle"):
        model.load_adapter(pickled, adapter_name="default")
    assert torch.equal(logits_of(model), logits)


@pytest.mark.parametrize(
    "entry",
    ["peft_from_pretrained", "peft_load_adapter", "peft_reload", "load_adapter", "load_adapter_bin", "auto_model"],
)
def test_nan_routers_are_refused_on_every_path(adapter, tmp_path, entry):
    root, _ = adapter
    folder = nan_copy(root / "adapter", tmp_path)
    if entry == "auto_model":
        with pytest.raises(AdapterFileError, match="NaN"):
            AutoModelForCausalLM.from_pretrained(folder)
        return
    if entry.startswith("peft_"):
        model = PeftModel.from_pretrained(tiny_model("llama"), root / "adapter")
        before = routers(model)
        if entry == "peft_from_pretrained":
            model = tiny_model("llama")
            before_model = snapshot(model)
            with pytest.raises(AdapterFileError, match="NaN"):
                PeftModel.from_pretrained(model, folder)
            assert_unmodified(model, before_model)
            return
        with pytest.raises(AdapterFileError, match="NaN"):
            model.load_adapter(folder, adapter_name="other" if entry == "peft_load_adapter" else "default")
        after = routers(model)
        assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
        assert set(model.peft_config) == {"default"}
        return
    model = tiny_model("llama")
    before_model = snapshot(model)
    with pytest.raises(AdapterFileError, match="NaN"):
        model.load_adapter(str(folder), use_safetensors=entry != "load_adapter_bin")
    assert_unmodified(model, before_model)


def test_adapter_state_dict_with_nan_is_refused(adapter):
    root, _ = adapter
    tensors = load_file(root / "adapter" / "adapter_model.safetensors")
    next(iter(tensors.values()))[0, 0] = float("inf")
    model = tiny_model("llama")
    before = snapshot(model)
    config = focus_hf.FocusConfig.from_pretrained(str(root / "adapter"))
    with pytest.raises(AdapterFileError, match="NaN or infinite"):
        model.load_adapter(peft_config=config, adapter_state_dict=tensors)
    assert_unmodified(model, before)
