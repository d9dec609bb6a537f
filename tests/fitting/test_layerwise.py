"""Layer-by-layer router distillation: one decoder layer's calibration data in memory at a time."""

from __future__ import annotations

import json
import weakref
from collections import Counter

import pytest
import torch
from peft import get_peft_model
from tiny_models import COMMON, tiny_model
from transformers import AutoModelForCausalLM, LlamaConfig

import focus_hf
import focus_hf.fitting.capture
import focus_hf.fitting.distill
import focus_hf.fitting.layerwise
from focus_hf.fitting.capture import capture_layers
from focus_hf.fitting.distill import CHECKPOINT_STATE, DistillSettings, distill_routers
from focus_hf.fitting.layerwise import distill_routers_layerwise
from focus_hf.tuner.controls import focus_layers

SETTINGS = DistillSettings(steps=25, lr=0.05, top_m=16, queries_per_sequence=96)
CONFIG = dict(num_groups=4, group_dim=8, window=8, top_k=1, sink_tokens=2, query_projection=True)
ROUTER_NAMES = ("focus_proj", "focus_centroids", "focus_query_proj")
# Both paths make the same dense computation in another order; on CPU they agree bit for bit, 1e-5 leaves room for
# kernels that reduce in another order.
TOLERANCE = dict(rtol=0, atol=1e-5)


def sequences(count=3, length=192):
    return [torch.randint(3, 128, (length,), generator=torch.Generator().manual_seed(i)) for i in range(count)]


def with_adapter(base, **options):
    torch.manual_seed(0)
    return get_peft_model(base, focus_hf.FocusConfig(**{**CONFIG, **options})).eval()


def routers(model):
    return {
        f"{layer.layer_index}.{name}": getattr(layer, name)["default"].detach().clone()
        for layer in focus_layers(model)
        for name in ROUTER_NAMES
    }


def assert_same_fit(results, reference_results, model, reference):
    assert [r.layer for r in results] == [r.layer for r in reference_results]
    for result, expected in zip(results, reference_results):
        for field in ("kept_before", "kept_after", "largest_group", "loss"):
            assert getattr(result, field) == pytest.approx(getattr(expected, field), abs=1e-5), field
    found, expected = routers(model), routers(reference)
    assert found.keys() == expected.keys()
    for name in found:
        torch.testing.assert_close(found[name], expected[name], **TOLERANCE)


@pytest.mark.parametrize(
    "architecture, options",
    [
        ("llama", {"dense_heads": [[1, 0]]}),
        ("llama", {"target_modules": r".*layers\.1\.self_attn"}),  # layer 0 is not routed but still runs
        ("gpt2", {}),  # the hidden states and the mask are positional arguments of a GPT-2 block
        ("mistral", {}),  # a model sliding window: the mask differs from the plain causal one
    ],
)
def test_layerwise_equals_whole_model_distillation(architecture, options):
    data = sequences()
    whole = with_adapter(tiny_model(architecture), **options)
    start = routers(whole)
    whole_results = distill_routers(whole, data, SETTINGS, progress=False)
    layerwise = with_adapter(tiny_model(architecture), **options)
    assert all(torch.equal(a, b) for a, b in zip(routers(layerwise).values(), start.values()))
    results = distill_routers_layerwise(layerwise, data, SETTINGS, progress=False)
    assert_same_fit(results, whole_results, layerwise, whole)
    assert all(not torch.equal(a, b) for a, b in zip(routers(layerwise).values(), start.values()))
    # The decoder layers are back in place: the model runs with its distilled routers.
    focus_hf.set_routing(layerwise, "hard")
    focus_hf.set_routing(whole, "hard")
    with torch.no_grad():
        torch.testing.assert_close(
            layerwise(input_ids=data[0][None]).logits, whole(input_ids=data[0][None]).logits, **TOLERANCE
        )


def test_layerwise_resumes_from_its_checkpoint(tmp_path):
    data = sequences(2)
    full = with_adapter(tiny_model("llama"))
    distill_routers_layerwise(full, data, SETTINGS, checkpoint_dir=tmp_path, progress=False)
    state = json.loads((tmp_path / CHECKPOINT_STATE).read_text())
    state["layers_done"] = state["layers_done"][:1]  # a run that stopped after layer 0
    (tmp_path / CHECKPOINT_STATE).write_text(json.dumps(state))
    resumed = with_adapter(tiny_model("llama"))
    results = distill_routers_layerwise(resumed, data, SETTINGS, checkpoint_dir=tmp_path, progress=False)
    assert [r.layer for r in results] == [0, 1]
    for name, value in routers(full).items():
        torch.testing.assert_close(routers(resumed)[name], value, **TOLERANCE)


def test_layerwise_needs_equal_lengths_and_an_active_adapter():
    model = with_adapter(tiny_model("llama"))
    with pytest.raises(ValueError, match="one length"):
        distill_routers_layerwise(model, [torch.arange(3, 100), torch.arange(3, 120)], SETTINGS, progress=False)
    with model.disable_adapter(), pytest.raises(ValueError, match="disabled"):
        distill_routers_layerwise(model, sequences(1), SETTINGS, progress=False)


# --- a dispatched base with disk offload -------------------------------------------------------------------
LAYERS = 4
# Tiny llama, 4 decoder layers (fp32): embeddings 24.6 kB, each decoder layer 83 kB. "all-disk" sends everything to
# disk; "mixed" keeps the embeddings and layer 0 in memory and offloads layers 1-3, the norm and the lm_head.
MEMORY = {"all-disk": {"cpu": 60_000}, "mixed": {"cpu": 200_000}}


def deep_llama():
    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, "num_hidden_layers": LAYERS}, num_key_value_heads=2)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("layerwise") / "base"
    deep_llama().save_pretrained(folder)
    return folder


def _tensor_bytes(tensor):
    if tensor.layout == torch.sparse_csr:
        return sum(_tensor_bytes(part) for part in (tensor.values(), tensor.col_indices(), tensor.crow_indices()))
    return tensor.numel() * tensor.element_size()


class Census:
    """How many `LayerCapture` / `LayerTargets` objects are alive, and the peak count and tensor bytes of each."""

    def __init__(self):
        self.alive, self.bytes, self.peak, self.peak_bytes = Counter(), Counter(), Counter(), Counter()

    def born(self, kind, obj):
        size = sum(_tensor_bytes(v) for v in vars(obj).values() if isinstance(v, torch.Tensor))
        self.alive[kind] += 1
        self.bytes[kind] += size
        self.peak[kind] = max(self.peak[kind], self.alive[kind])
        self.peak_bytes[kind] = max(self.peak_bytes[kind], self.bytes[kind])
        weakref.finalize(obj, self.died, kind, size)

    def died(self, kind, size):
        self.alive[kind] -= 1
        self.bytes[kind] -= size


@pytest.fixture
def census(monkeypatch):
    found = Census()

    def counted(cls, kind):
        class Counted(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                found.born(kind, self)

        return Counted

    capture = counted(focus_hf.fitting.capture.LayerCapture, "captures")
    monkeypatch.setattr(focus_hf.fitting.capture, "LayerCapture", capture)
    monkeypatch.setattr(focus_hf.fitting.layerwise, "LayerCapture", capture)
    monkeypatch.setattr(
        focus_hf.fitting.distill, "LayerTargets", counted(focus_hf.fitting.distill.LayerTargets, "targets")
    )
    return found


def test_census_counts_the_whole_model_capture(census):
    # distill_routers holds every layer's capture of a sequence and every layer's targets at once.
    distill_routers(with_adapter(deep_llama()), sequences(2), SETTINGS, progress=False)
    assert census.peak["captures"] >= LAYERS and census.peak["targets"] == LAYERS
    assert census.alive["captures"] == census.alive["targets"] == 0


@pytest.mark.parametrize("memory", sorted(MEMORY))
def test_layerwise_on_a_disk_offloaded_base(base_folder, memory, tmp_path, census):
    data = sequences()
    reference = with_adapter(deep_llama())
    start = routers(reference)
    initial = {k: v.detach().clone() for k, v in reference.state_dict().items() if "focus_" in k}
    reference_results = distill_routers(reference, data, SETTINGS, progress=False)
    whole_peak = dict(census.peak), dict(census.peak_bytes)
    census.peak.clear(), census.peak_bytes.clear()

    base = AutoModelForCausalLM.from_pretrained(
        base_folder, device_map="auto", max_memory=MEMORY[memory], offload_folder=str(tmp_path / "offload")
    ).eval()
    assert base.hf_device_map.get("model.layers.3", base.hf_device_map.get("")) == "disk"
    model = with_adapter(base)
    model.load_state_dict(initial, strict=False)
    offloaded = {name for name, p in model.named_parameters() if p.device.type == "meta"}
    assert offloaded and not any("focus_" in name for name in offloaded)
    assert all(torch.equal(routers(model)[name], value) for name, value in start.items())

    results = distill_routers_layerwise(model, data, SETTINGS, progress=False)

    assert_same_fit(results, reference_results, model, reference)
    # Nothing ended on the meta device that should not be there, and nothing offloaded was loaded for good.
    assert {name for name, p in model.named_parameters() if p.device.type == "meta"} == offloaded
    assert all(p.device.type == "cpu" for p in routers(model).values())
    # One sequence's capture of one layer at a time, one layer's targets at a time.
    assert census.peak["captures"] == 1 and census.peak["targets"] == 1, (census.peak, whole_peak)
    assert census.alive["captures"] == census.alive["targets"] == 0
    held = census.peak_bytes["captures"] + census.peak_bytes["targets"]
    whole_held = whole_peak[1]["captures"] + whole_peak[1]["targets"]
    assert held * 3 < whole_held, (held, whole_held)
    # The dispatched model still runs (the decoder layers are back, hooks included) with the distilled routers.
    focus_hf.set_routing(model, "hard")
    focus_hf.set_routing(reference, "hard")
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=data[0][None]).logits, reference(input_ids=data[0][None]).logits, **TOLERANCE
        )


def test_whole_model_capture_on_a_disk_offloaded_base(base_folder, tmp_path):
    # The input ids go to the execution device, not to the device of the first weight (meta when offloaded).
    ids = sequences(1)[0]
    expected = capture_layers(with_adapter(deep_llama()), ids)
    base = AutoModelForCausalLM.from_pretrained(
        base_folder, device_map="auto", max_memory=MEMORY["all-disk"], offload_folder=str(tmp_path / "offload")
    ).eval()
    found = capture_layers(with_adapter(base), ids)
    assert sorted(found) == sorted(expected) == list(range(LAYERS))
    for index, capture in found.items():
        for name in ("hidden", "query", "key"):
            torch.testing.assert_close(getattr(capture, name), getattr(expected[index], name), **TOLERANCE)
