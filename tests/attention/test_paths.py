"""The table of paths (`focus_hf.attention.paths`) and "auto"'s choice among its entries - on the CPU, and under
simulated CUDA: the CPU counts as a CUDA device (`paths.GPU_PATH_DEVICES`), the GPU path runs on the CPU stand-ins of
its kernels, and the crossover against flash SDPA is measured from recorded timings of an H200 (no assertion here
depends on this machine's timings)."""

from __future__ import annotations

import json

import pytest
import torch
from attention_cases import focus_llama
from tiny_models import VOCAB

import focus_hf
import focus_hf.attention.crossover as crossover
import focus_hf.attention.crossover_measurement as measurement
import focus_hf.attention.gpu.verify as verify
import focus_hf.attention.hard as hard
import focus_hf.attention.paths as paths
from focus_hf.attention.gpu.paged_keys import PagedKeys
from focus_hf.attention.pattern import FocusPattern, allowed_pairs
from focus_hf.attention.reference import dense_attention

GROUPS, WINDOW, SCALING = 4, 8, 0.25
H200 = "NVIDIA H200"

# `focus-hf bench --backend auto` on an H200 (commit 7b99d6f, benchmarks/results/gpu/auto.json): one layer of 32 / 8
# heads, d 64, K=8, w=128, bfloat16, seconds per call. The dense side is flash SDPA, the other the GPU path.
RECORDED = {
    # tokens: (flash SDPA, GPU path top-1, GPU path top-2)
    1024: (0.000244, 0.004938, 0.004352),
    2048: (0.000271, 0.005443, 0.008965),
    4096: (0.000435, 0.007343, 0.015225),
    8192: (0.001157, 0.012290, 0.028076),
    16384: (0.003972, 0.022508, 0.054768),
    32768: (0.014270, 0.042411, 0.106346),
    65536: (0.054937, 0.085186, 0.219120),
    131072: (0.220694, 0.182343, 0.462821),
    262144: (0.934035, 0.422004, 1.078077),
}


@pytest.fixture
def simulated_cuda(monkeypatch, tmp_path):
    """The CPU taken for a CUDA device named H200: "auto" runs the GPU path's choices on the kernels' CPU stand-ins;
    calibration on, an empty crossover cache."""
    monkeypatch.setattr(paths, "GPU_PATH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(crossover, "processor_name", lambda device=None: H200)
    monkeypatch.delenv(crossover.NO_CALIBRATION_ENV, raising=False)
    monkeypatch.delenv(crossover.CROSSOVER_ENV, raising=False)
    monkeypatch.setenv("FOCUS_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(crossover, "_known", {})
    verify.forget_verdicts()
    hard.forget_fallbacks()
    yield
    verify.forget_verdicts()
    hard.forget_fallbacks()


def case(length=300, q_len=None, top_k=1, seed=0, padded=False):
    """A routed call: states [batch 2, heads 4 on 2 kv heads, dim 16] and its pattern (own-group routing)."""
    q_len = length if q_len is None else q_len
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(2, 4, q_len, 16, generator=generator)
    key, value = (torch.randn(2, 2, length, 16, generator=generator) for _ in range(2))
    scores = torch.rand(2, length, GROUPS, generator=generator)
    key_groups = scores.argmax(-1)
    query_groups = scores.argsort(-1, descending=True)[:, length - q_len :, :top_k]
    sink = (torch.arange(length) < 2).expand(2, length)
    mask = None
    if padded:
        valid = torch.ones(2, length, dtype=torch.bool)
        valid[1, :23] = False
        sink = valid & (valid.cumsum(1) - 1 < 2)
        positions = torch.arange(length)
        causal = positions[length - q_len :, None] >= positions[None, :]
        mask = (causal[None] & valid[:, None, :])[:, None]
    # As a model's routing hands it over: the sinks' count (`FocusConfig.sink_tokens`), own-group routing.
    options = dict(model_mask=mask, sink_tokens=2, own_group=True)
    pattern = FocusPattern(query_groups, key_groups, sink, GROUPS, WINDOW, **options)
    return query, key, value, pattern


def pattern_oracle(query, key, value, pattern):
    """The Focus pattern (and the model's mask) by dense float64 attention: [batch, q, heads, dim]."""
    q_len, length = query.shape[2], key.shape[2]
    positions = torch.arange(length)
    groups = (pattern.query_groups, pattern.key_groups, pattern.key_sink)
    allowed = allowed_pairs(*groups, positions[length - q_len :], positions, WINDOW)[:, None]
    if pattern.model_mask is not None:
        allowed = allowed & pattern.model_mask
    return dense_attention(query.double(), key.double(), value.double(), allowed, scaling=SCALING).float()


def base_oracle(query, key, value, mask=None):
    """The base model's causal attention (the queries the last of the keys): [batch, q, heads, dim]."""
    q_len, length = query.shape[2], key.shape[2]
    positions = torch.arange(length)
    allowed = (positions[length - q_len :, None] >= positions[None, :])[None, None]
    if mask is not None:
        allowed = allowed & mask
    return dense_attention(query.double(), key.double(), value.double(), allowed, scaling=SCALING).float()


@pytest.fixture
def chosen(monkeypatch):
    """Every entry `hard_attention` runs, with the kernels it was handed: (entry, kernels)."""
    runs = []
    real = hard._run

    def recording(entry, call):
        runs.append((entry, call.kernels, call.query.device, call.query.dtype, call.query.shape, call.key.shape))
        return real(entry, call)

    monkeypatch.setattr(hard, "_run", recording)
    return runs


def assert_registered_and_verified(runs):
    """Every entry that ran is the table's own, of a platform the call could take, and one that needs verifying ran
    on kernels `verify` had shown exact for that device, dtype and head shape."""
    assert runs
    for entry, kernels, device, dtype, query_shape, key_shape in runs:
        assert paths.PATHS[entry.name] is entry
        if entry.verified:
            assert kernels is not None
            per_kv = query_shape[1] // key_shape[1]
            assert verify.is_verified(device, dtype, per_kv, query_shape[3], "auto")
            states = (torch.zeros(1, per_kv, 1, query_shape[3], dtype=dtype), torch.zeros(1, 1, 1, query_shape[3]))
            assert verify.verify(*states) is None


# --- the table ---


def test_the_table_lists_each_path_once_with_what_it_applies_to():
    assert len(paths.PATHS) == len({entry.name for entry in paths.PATHS.values()})
    for entry in paths.PATHS.values():
        assert entry.platform in ("cpu", "gpu", "any") and set(entry.calls) <= {"prefill", "decode"} and entry.summary
        assert entry.measured_as in (None, *measurement.SIDES)
        assert not entry.verified or entry.platform == "gpu"  # only the GPU path's kernels are checked on a device
    assert [name for name, entry in paths.PATHS.items() if not entry.exact] == ["base"]
    # Each crossover has its two sides in the table, per platform and kind of call.
    for platform in ("cpu", "gpu"):
        for decode in (False, True):
            sides = paths.measured_paths(platform, decode)
            assert {"dense", "sparse"} <= set(sides) and all(entry.platform == platform for entry in sides.values())
    assert paths.measured_paths("gpu", False)["dense"].name == "base"
    assert paths.measured_paths("gpu", True)["sparse"].name == "gpu-paged-decode"
    assert paths.measured_paths("cpu", False)["dense"].name == "cpu-masked"


@pytest.mark.parametrize("name", [name for name, entry in paths.PATHS.items() if entry.platform != "gpu"])
def test_every_cpu_entry_named_runs_the_pattern_exactly(name):
    q_len = 150 if "prefill" in paths.PATHS[name].calls else 1
    query, key, value, pattern = case(length=150, q_len=q_len, padded=True)
    if name == "causal":
        every_group = torch.arange(GROUPS).expand(2, q_len, GROUPS)
        pattern = FocusPattern(every_group, pattern.key_groups, pattern.key_sink, GROUPS, WINDOW)
        pattern_mask = None
    else:
        pattern_mask = pattern.model_mask
    output = hard.hard_attention(query, key, value, pattern, scaling=SCALING, path=name)
    rows = slice(None) if pattern_mask is None else pattern_mask[:, 0, :, -1]
    torch.testing.assert_close(output[rows], pattern_oracle(query, key, value, pattern)[rows], atol=1e-4, rtol=0)


def test_auto_on_the_cpu_picks_registered_entries_only(chosen, monkeypatch):
    for forced in ("0", str(10**6)):  # the sparse side, then the dense masked call
        monkeypatch.setenv(crossover.CROSSOVER_ENV, forced)
        for length, q_len, padded in ((200, 200, False), (200, 200, True), (200, 1, False), (200, 5, True)):
            query, key, value, pattern = case(length, q_len, padded=padded)
            output = hard.hard_attention(query, key, value, pattern, scaling=SCALING)
            rows = slice(None) if not padded else pattern.model_mask[:, 0, :, -1]
            expected = pattern_oracle(query, key, value, pattern)
            torch.testing.assert_close(output[rows], expected[rows], atol=1e-4, rtol=0)
    assert_registered_and_verified(chosen)
    assert {entry.platform for entry, *_ in chosen} <= {"cpu", "any"}
    assert {entry.name for entry, *_ in chosen} >= {"cpu-sparse", "cpu-masked", "cpu-decode"}


# --- "auto" on CUDA, simulated ---


def test_without_a_measurement_auto_on_cuda_is_the_base_model(simulated_cuda, chosen, monkeypatch):
    monkeypatch.setenv(crossover.NO_CALIBRATION_ENV, "1")  # as a failed or refused measurement leaves it
    for padded in (False, True):
        query, key, value, pattern = case(padded=padded)
        output = hard.hard_attention(query, key, value, pattern, scaling=SCALING)
        real = slice(None) if pattern.model_mask is None else pattern.model_mask[:, 0, :, -1]  # padding queries aside
        expected = base_oracle(query, key, value, pattern.model_mask)
        torch.testing.assert_close(output[real], expected[real], atol=1e-4, rtol=0)
    assert [entry.name for entry, *_ in chosen] == ["base", "base"]
    assert hard.fallback_calls() == {}


def test_auto_on_cuda_splits_a_call_at_the_crossover_by_query(simulated_cuda, chosen, monkeypatch):
    """Queries with fewer keys than the crossover attend as the base model, the others take the GPU path; a prefill
    at once equals the same prefill in two chunks."""
    monkeypatch.setenv(crossover.CROSSOVER_ENV, "150")
    query, key, value, pattern = case(length=300, padded=True)
    output = hard.hard_attention(query, key, value, pattern, scaling=SCALING)
    mask = pattern.model_mask
    real = mask[:, 0, :, -1]
    # position p has p + 1 keys: positions 0 .. 148 are below 150 keys
    base = base_oracle(query[:, :, :149], key[:, :, :149], value[:, :, :149], mask[..., :149, :149])
    routed = pattern_oracle(query, key, value, pattern)[:, 149:]
    expected = torch.cat([base, routed], dim=1)
    torch.testing.assert_close(output[real], expected[real], atol=1e-4, rtol=0)
    assert [entry.name for entry, *_ in chosen] == ["base", "gpu-sparse"]
    chosen.clear()
    first = hard.hard_attention(
        query[:, :, :200],
        key[:, :, :200],
        value[:, :, :200],
        FocusPattern(
            pattern.query_groups[:, :200], pattern.key_groups[:, :200], pattern.key_sink[:, :200], GROUPS, WINDOW,
            model_mask=mask[..., :200, :200], own_group=True,
        ),
        scaling=SCALING,
    )  # fmt: skip
    second = hard.hard_attention(query[:, :, 200:], key, value, pattern.later_queries(200), scaling=SCALING)
    chunks = torch.cat([first, second], dim=1)
    torch.testing.assert_close(chunks[real], output[real], atol=1e-4, rtol=0)
    assert [entry.name for entry, *_ in chosen] == ["base", "gpu-sparse", "gpu-sparse"]
    assert_registered_and_verified(chosen)


def test_auto_on_cuda_decoding_steps_take_the_base_attention_or_the_paged_copy(simulated_cuda, chosen, monkeypatch):
    monkeypatch.setenv(crossover.CROSSOVER_ENV, "280")
    query, key, value, pattern = case(length=300, q_len=300)
    store = PagedKeys(GROUPS, WINDOW)
    for n in (278, 279, 280, 281, 282):  # consecutive steps, as generate() makes them
        step = FocusPattern(
            pattern.query_groups[:, n - 1 : n], pattern.key_groups[:, :n], pattern.key_sink[:, :n], GROUPS, WINDOW,
            own_group=True,
        )  # fmt: skip
        q = query[:, :, n - 1 : n]
        output = hard.hard_attention(q, key[:, :, :n], value[:, :, :n], step, scaling=SCALING, key_copy=store)
        states = (q, key[:, :, :n], value[:, :, :n])
        expected = pattern_oracle(*states, step) if n >= 280 else base_oracle(*states)
        torch.testing.assert_close(output, expected, atol=1e-4, rtol=0)
    names = [entry.name for entry, *_ in chosen]
    assert names == ["base", "base", "gpu-paged-decode", "gpu-paged-decode", "gpu-paged-decode"]
    assert_registered_and_verified(chosen)


def test_auto_on_cuda_never_runs_an_unverified_gpu_path(simulated_cuda, chosen, monkeypatch, capsys):
    monkeypatch.setenv(crossover.CROSSOVER_ENV, "0")  # the GPU path everywhere, were it shown exact
    monkeypatch.setattr(verify, "check", lambda kernels, config, checks=None: "a kernel that differs")
    query, key, value, pattern = case()
    output = hard.hard_attention(query, key, value, pattern, scaling=SCALING)
    torch.testing.assert_close(output, base_oracle(query, key, value), atol=1e-4, rtol=0)
    assert [entry.name for entry, *_ in chosen] == ["base"]
    assert hard.fallback_calls() == {"unverified": 1}
    assert "a kernel that differs" in capsys.readouterr().err


def test_a_model_on_simulated_cuda_without_a_measurement_is_the_base_model(simulated_cuda, monkeypatch):
    monkeypatch.setenv(crossover.NO_CALIBRATION_ENV, "1")
    model = focus_llama(1)
    ids = torch.randint(3, VOCAB, (2, 120), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    focus_hf.set_routing(model, "hard", backend="auto")
    with torch.no_grad():
        focus = model(input_ids=ids, attention_mask=mask).logits
        with model.disable_adapter():
            base = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(focus[real], base[real], atol=1e-5, rtol=0)
    assert set(hard.paths_run()) == {"base"}


# --- the crossover on CUDA: measured from recorded timings, cached per device, torch and shape ---


def recorded_measurement(top_k, out_of_memory_from=None):
    """A `measure` whose calls take the recorded H200 seconds (a fake clock), after a first call per length that
    takes a minute (FlexAttention's compilation, which the budget does not count)."""
    now, warmed = [0.0], set()

    def clock():
        return now[0]

    def call(query, key, value, pattern, *, path, **options):
        length = key.shape[2]
        if out_of_memory_from is not None and length >= out_of_memory_from:
            raise torch.OutOfMemoryError("CUDA out of memory (recorded)")
        dense, *sparse = RECORDED[length]
        now[0] += dense if path == "base" else sparse[top_k - 1]
        if (path, length) not in warmed:
            warmed.add((path, length))
            now[0] += 60.0
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])

    return call, clock


def simulated_shape(top_k, kind="shared"):
    query, key = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)  # small states: the timings are the H200's
    return crossover.make_shape(query, key, top_k, 8, 128, kind)


def test_the_recorded_h200_timings_put_the_crossover_where_the_gpu_path_wins(simulated_cuda):
    found = {}
    for top_k in (1, 2):
        call, clock = recorded_measurement(top_k)
        shape = simulated_shape(top_k)
        found[top_k], rows = crossover.measure(shape, torch.device("cpu"), call, clock=clock)
        assert [row["length"] for row in rows] == list(measurement.GPU_LENGTHS)  # compilation is not budgeted
        # "auto" never runs the GPU path at a length where it was measured slower than flash SDPA
        for row in rows:
            if row["sparse_s"] > row["dense_s"]:
                assert row["length"] < found[top_k]
    assert found[1] == 131072  # 1.21x at 128K, 2.21x at 256K: the first of two wins by WIN_MARGIN
    assert found[2] == measurement.NEVER  # top-2 never won up to 256K: the base model at every length


def test_a_measurement_that_runs_out_of_memory_keeps_the_base_attention(simulated_cuda):
    call, clock = recorded_measurement(1, out_of_memory_from=131072)
    found, rows = crossover.measure(simulated_shape(1), torch.device("cpu"), call, clock=clock)
    assert found == measurement.NEVER and rows[-1]["length"] == 65536


def test_the_cuda_crossover_is_cached_by_device_name_torch_version_and_shape(simulated_cuda, tmp_path, monkeypatch):
    measured = []
    real = crossover.measure

    def recorded(shape, device, call, lengths=None, clock=None):
        measured.append(shape)
        fake_call, fake_clock = recorded_measurement(shape.top_k)
        return real(shape, device, fake_call, clock=fake_clock)

    monkeypatch.setattr(crossover, "measure", recorded)
    monkeypatch.setattr(crossover, "other_cores_meter", lambda: lambda: 0.0)
    query, key = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)

    def dense_below(top_k=1, heads=(query, key)):
        return crossover.dense_below(*heads, top_k, 8, 128, "shared", hard.hard_attention)

    assert dense_below() == 131072 and dense_below(2) == measurement.NEVER
    entries = json.loads((tmp_path / crossover.CACHE_FILE).read_text())["entries"]
    shapes = [entry["shape"] for entry in entries.values()]
    assert {(shape["processor"], shape["torch"], shape["top_k"]) for shape in shapes} == {
        (H200, torch.__version__, 1),
        (H200, torch.__version__, 2),
    }
    assert all(shape["kernels"] == "CPU stand-ins" for shape in shapes)  # the GPU path's kernels
    crossover._known.clear()  # a new process on the same machine reads the file
    assert dense_below() == 131072 and len(measured) == 2
    crossover._known.clear()  # another GPU, another torch, another head shape: measured again
    monkeypatch.setattr(crossover, "processor_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    dense_below()
    crossover._known.clear()
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    dense_below()
    dense_below(heads=(torch.zeros(1, 4, 1, 8), key))
    assert len(measured) == 5
    assert len(json.loads((tmp_path / crossover.CACHE_FILE).read_text())["entries"]) == 5


def test_a_failed_cuda_measurement_falls_back_to_the_base_attention(simulated_cuda, monkeypatch, capsys):
    def broken(shape, device, call, lengths=None, clock=None):
        raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(crossover, "measure", broken)
    query, key, value, pattern = case()
    output = hard.hard_attention(query, key, value, pattern, scaling=SCALING)
    torch.testing.assert_close(output, base_oracle(query, key, value), atol=1e-4, rtol=0)
    assert hard.paths_run() == {"base": 1}
    assert "calibration failed" in capsys.readouterr().err


def test_the_real_measurement_times_flash_sdpa_against_the_gpu_path(simulated_cuda):
    """The measurement's own calls, on the kernels' CPU stand-ins at tiny lengths: both sides run, through the table."""
    query, key = torch.zeros(1, 4, 1, 16), torch.zeros(1, 2, 1, 16)
    runs = []
    real = hard.hard_attention

    def watched(*arguments, path=None, **options):
        runs.append(path)
        return real(*arguments, path=path, **options)

    shape = crossover.make_shape(query, key, 1, GROUPS, WINDOW, "shared")
    found, rows = crossover.measure(shape, torch.device("cpu"), watched, lengths=(64, 128))
    assert set(runs) == {"base", "gpu-sparse"}
    assert found in (64, measurement.NEVER) and all(row["dense_s"] > 0 and row["sparse_s"] > 0 for row in rows)


def test_a_compiled_call_on_cuda_takes_the_crossover_the_eager_calls_measured(simulated_cuda, monkeypatch):
    monkeypatch.setattr(
        crossover, "measure", lambda shape, device, call, lengths=None, clock=None: (150, [])
    )  # fmt: skip
    query, key, value, pattern = case(padded=True)

    def attention(query, key, value):
        return hard.hard_attention(query, key, value, pattern, scaling=SCALING)

    eager = attention(query, key, value)  # measures: 150
    torch._dynamo.reset()
    compiled = torch.compile(attention, backend="eager")(query, key, value)
    real = pattern.model_mask[:, 0, :, -1]
    torch.testing.assert_close(compiled[real], eager[real], atol=1e-5, rtol=0)
    torch._dynamo.reset()
    assert torch._dynamo.explain(attention)(query, key, value).graph_break_count == 0
