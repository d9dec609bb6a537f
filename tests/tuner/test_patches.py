"""focus_hf's changes to peft and transformers (`focus_hf.tuner.patches`): every entry's upstream signature as the
installed libraries have it, and what focus_hf does when upstream changes under a patch."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import threading
import types
import warnings
from pathlib import Path

import pytest
from peft import PeftModel

import focus_hf  # noqa: F401  (applies the patches)
from focus_hf.errors import UpstreamChangedError
from focus_hf.tuner import adapter_load, patches
from focus_hf.tuner.patches import PATCHES, Patch

PACKAGE = Path(focus_hf.__file__).parent
WRAPPED_HERE = [p for p in PATCHES if p.where == patches.__name__ and p.change.startswith("wraps")]
MADE_ELSEWHERE = [p for p in PATCHES if p.where != patches.__name__]


def _id(patch: Patch) -> str:
    return f"{patch.target}@{patch.where}"


@pytest.mark.parametrize("patch", PATCHES, ids=_id)
def test_the_installed_upstream_has_what_the_patch_relies_on(patch):
    """Fails, naming the entry and what changed, when a peft / transformers upgrade renames or moves a parameter or an
    object a patch reads."""
    assert patches.upstream_problems(patch) == []


@pytest.mark.parametrize("patch", MADE_ELSEWHERE, ids=_id)
def test_a_patch_made_in_another_module_is_made_there(patch):
    source = inspect.getsource(importlib.import_module(patch.where))
    assert patch.target.split(".")[-1] in source


@pytest.mark.parametrize("patch", WRAPPED_HERE, ids=_id)
def test_each_wrapped_method_is_wrapped_once_over_the_upstream_one(patch):
    owner, name = patches._resolve(patch.target)
    current = patches._function(inspect.getattr_static(owner, name))
    assert getattr(current, patches._MARKER, None) == patch.target
    original = patches.upstream(patch.target)
    assert getattr(original, patches._MARKER, None) is None
    assert current.__wrapped__ is original


def test_the_table_names_each_upstream_object_once_per_change():
    keys = [(p.target, p.where) for p in PATCHES]
    assert len(keys) == len(set(keys))
    for patch in PATCHES:
        assert patch.why and patch.change
        if patch.where == patches.__name__:
            assert callable(getattr(patches, patch.make))


@pytest.fixture()
def fake_upstream(monkeypatch):
    """A module `fake_upstream` whose `Thing.method(self, model_id, renamed)` stands for an upstream method whose
    parameter `adapter_name` was renamed."""
    module = types.ModuleType("fake_upstream")

    class Thing:
        def method(self, model_id, renamed):
            return "upstream"

    module.Thing = Thing
    monkeypatch.setitem(sys.modules, "fake_upstream", module)
    return module


def _passing_through(original):
    def method(*args, **kwargs):
        return original(*args, **kwargs)

    return method


def test_a_renamed_parameter_is_named_with_the_versions(fake_upstream):
    patch = Patch("fake_upstream.Thing.method", "wraps", "a test", parameters=("model_id", "adapter_name"))
    problems = patches.upstream_problems(patch)
    assert len(problems) == 1 and "'adapter_name'" in problems[0] and "renamed" in problems[0]
    message = patches.describe(patch, problems)
    assert "fake_upstream.Thing.method" in message and "a test" in message and "pip install" in message


def test_reordered_parameters_and_a_missing_object_are_problems(fake_upstream):
    reordered = Patch("fake_upstream.Thing.method", "wraps", "a test", parameters=("renamed", "model_id"))
    assert "in that order" in patches.upstream_problems(reordered)[0]
    gone = Patch("fake_upstream.Thing.gone", "wraps", "a test")
    assert "gone" in patches.upstream_problems(gone)[0]
    relied = Patch("fake_upstream.Thing.method", "wraps", "a test", relies_on=("fake_upstream.Other",))
    assert patches.upstream_problems(relied) == ["fake_upstream.Other is gone"]


def test_an_essential_patch_that_no_longer_fits_refuses_the_import_and_changes_nothing(fake_upstream, monkeypatch):
    broken = Patch("fake_upstream.Thing.method", "wraps", "a test", parameters=("adapter_name",), make="_set_adapter")
    fitting = next(p for p in WRAPPED_HERE if p.target == "peft.PeftModel.set_adapter")
    before = inspect.getattr_static(PeftModel, "set_adapter")
    monkeypatch.setattr(patches, "PATCHES", (fitting, broken))
    monkeypatch.setattr(patches, "_applied", False)
    monkeypatch.setattr(patches, "_originals", [])
    with pytest.raises(UpstreamChangedError, match=r"fake_upstream\.Thing\.method.*'adapter_name'"):
        patches.apply()
    # Checked before anything is applied: the fitting entry was not applied twice, nor anything left half-done.
    assert inspect.getattr_static(PeftModel, "set_adapter") is before
    assert patches._originals == [] and not patches._applied


def test_a_convenience_that_no_longer_fits_is_left_out_with_a_warning(fake_upstream, monkeypatch):
    broken = Patch("fake_upstream.Thing.method", "wraps", "a test", parameters=("adapter_name",),
                   make="_passing_through", essential=False)  # fmt: skip
    monkeypatch.setattr(patches, "_passing_through", _passing_through, raising=False)
    monkeypatch.setattr(patches, "PATCHES", (broken,))
    monkeypatch.setattr(patches, "_applied", False)
    monkeypatch.setattr(patches, "_originals", [])
    with pytest.warns(RuntimeWarning, match="runs without this patch"):
        patches.apply()
    assert not hasattr(fake_upstream.Thing.method, patches._MARKER)


def test_a_fitting_patch_wraps_and_revert_puts_back(fake_upstream, monkeypatch):
    fitting = Patch("fake_upstream.Thing.method", "wraps", "a test", parameters=("model_id",),
                    make="_passing_through")  # fmt: skip
    original = fake_upstream.Thing.method
    monkeypatch.setattr(patches, "_passing_through", _passing_through, raising=False)
    monkeypatch.setattr(patches, "PATCHES", (fitting,))
    monkeypatch.setattr(patches, "_applied", False)
    monkeypatch.setattr(patches, "_originals", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patches.apply()
        patches.apply()  # idempotent
    assert fake_upstream.Thing.method is not original
    assert getattr(fake_upstream.Thing.method, patches._MARKER) == fitting.target
    assert fake_upstream.Thing().method("id", 1) == "upstream"
    assert patches.upstream(fitting.target) is original
    patches.revert()
    assert fake_upstream.Thing.method is original


def test_no_module_reads_its_callers_stack_frames():
    pattern = re.compile(r"sys\._getframe|inspect\.(currentframe|stack|getouterframes)\(|\.f_back\b|\.f_locals\b")
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in PACKAGE.rglob("*.py")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


def test_each_thread_sees_the_adapter_its_own_loader_is_loading():
    barrier = threading.Barrier(4)
    seen: dict[int, object] = {}

    def load(index: int) -> None:
        with adapter_load.loading(f"org/adapter-{index}", {"revision": str(index)}):
            barrier.wait(timeout=10)  # all four loads under way at once
            current = adapter_load.current_load()
            seen[index] = (current.source, current.download_kwargs["revision"])

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {i: (f"org/adapter-{i}", str(i)) for i in range(4)}
    assert adapter_load.current_load() is None


def test_nested_loaders_share_what_the_tuner_checked():
    tensors = {"weight": object()}
    with adapter_load.loading("outer", {}):
        assert not adapter_load.loading_focus_adapter()
        with adapter_load.loading("inner", {"subfolder": "x"}):
            assert adapter_load.current_load().source == "inner"
            adapter_load.hand_over(tensors)
        assert adapter_load.current_load().source == "outer"
        assert adapter_load.checked_tensors() is tensors and adapter_load.loading_focus_adapter()
    assert adapter_load.checked_tensors() is None and not adapter_load.loading_focus_adapter()
