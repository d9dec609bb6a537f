"""The benchmarks' measuring parts on tiny inputs: model/generate.py's token clock, teacher forcing and comparison,
cpu/arithmetic_ceiling.py's pair counts, cpu/prefill_parts.py's repeated timings."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from tiny_models import VOCAB, tiny_model

import focus_hf

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(path: str):
    """benchmarks/<path>.py as a module (the scripts import focus_hf.benchmarking, nothing from beside them)."""
    spec = importlib.util.spec_from_file_location(Path(path).name, BENCHMARKS / f"{path}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_decode():
    return load_benchmark("model/generate")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_teacher_forced_generation_follows_the_reference(model_decode, cache):
    model = get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, group_dim=8, window=8)).eval()
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with model.disable_adapter():
        full = model_decode.timed_generate(model, prompt, 6, cache)
    assert len(full["tokens"]) == 6 and full["log_probs"].shape == (6, model.config.vocab_size)
    assert full["prefill_s"] > 0 and full["tokens_per_s"] > 0
    # Greedy: the noted distributions' argmaxes are the tokens generated.
    assert full["log_probs"].argmax(-1).tolist() == full["tokens"]

    reference = [5, 6, 7, 8, 9, 10]
    forced = model_decode.generate_variant(model, prompt, "focus", 6, "sdpa", cache, reference)
    assert forced["tokens"] == reference
    agreement = model_decode.step_agreement(forced["log_probs"], forced["log_probs"])
    assert agreement == {"argmax_agree": 6, "mean_kl": 0.0, "max_kl": 0.0}


def test_step_agreement_counts_argmaxes_and_ignores_banned_tokens(model_decode):
    reference = torch.log(torch.tensor([[0.7, 0.3, 0.0], [0.5, 0.5, 0.0]]))  # token 2 banned (probability 0)
    other = torch.log(torch.tensor([[0.6, 0.4, 0.0], [0.1, 0.9, 0.0]]))
    agreement = model_decode.step_agreement(other, reference)
    expected_kl = torch.tensor(
        [0.7 * math.log(0.7 / 0.6) + 0.3 * math.log(0.3 / 0.4), 0.5 * math.log(0.5 / 0.1) + 0.5 * math.log(0.5 / 0.9)]
    )
    assert agreement["argmax_agree"] == 1
    assert agreement["mean_kl"] == pytest.approx(float(expected_kl.mean()), abs=1e-5)
    assert agreement["max_kl"] == pytest.approx(float(expected_kl.max()), abs=1e-5)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_decoding_steps_in_turn_keep_each_variant_on_its_own_cache(cache):
    module = load_benchmark("model/decode_steps")
    model = get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, group_dim=8, window=8)).eval()
    prompt = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    times = module.alternate_steps(model, prompt, cache, steps=4)
    assert set(times) == {"full", "focus"} and all(len(seconds) == 4 and min(seconds) > 0 for seconds in times.values())
    # Each variant's cache was read by that variant only: a Focus step on a cache that full attention had extended
    # would find its routing behind the cache and raise.
    focus_cache, _ = module.prefilled(model, prompt, "focus", cache, steps=4)
    assert int(focus_cache.get_seq_length()) == 40 + 2


def test_arithmetic_ceiling_counts_the_pairs_its_calls_attend():
    ceiling = load_benchmark("cpu/arithmetic_ceiling")
    generator = torch.Generator().manual_seed(0)
    _, causal_pairs = ceiling.causal_call(64, generator)
    assert causal_pairs == ceiling.HEADS * 64 * 65 / 2
    call, local_pairs = ceiling.local_blocks(128, window=16, block=32, generator=generator)
    # Each of the 128 queries sees itself and the 16 keys before it (the first block reads keys before the text too).
    assert local_pairs == ceiling.HEADS * 128 * 17
    output, lse = call()
    assert output.shape == (4, ceiling.HEADS, 32, ceiling.DIM) and torch.isfinite(lse).all()


def test_attention_parts_times_short_calls_repeatedly_and_its_parts_add_up(tmp_path):
    # One timed call of a few milliseconds moved by a tenth between runs: below REPEAT_MAX_LEN every figure is a
    # median of --repeats calls, and the parts of the C kernels' path (the own-group pass, local, sinks, the rest) sum
    # to it.
    import json

    attention_parts = load_benchmark("cpu/prefill_parts")
    path = tmp_path / "parts.json"
    argv = ["--seq-lens", "320", "--dtypes", "float32", "--repeats", "3", "--json", str(path)]
    assert attention_parts.main(argv) == 0
    rows = json.loads(path.read_text())
    assert [row["top_k"] for row in rows] == [1, 2]
    for row in rows:
        assert row["repeats"] == 3 and attention_parts.rounds_for(65536, 3) == 1
        parts = row["set_a_cpu_s"] + row["local_cpu_s"] + row["sinks_cpu_s"] + row["rest_cpu_s"]
        assert parts == pytest.approx(row["focus_cpu_s"])
        assert row["speedup"] == pytest.approx(row["dense_cpu_s"] / row["focus_cpu_s"])
        assert row["torch_kernels"]["capability"] == torch.backends.cpu.get_cpu_capability()


def test_a_short_timing_gets_rounds_enough_to_reach_the_minimum(model_decode):
    # 1.3 s of decoding per round: 20 s take 16 rounds; a long one keeps --repeats.
    assert model_decode.rounds_to_reach(3, 20.0, 1.3) == 16
    assert model_decode.rounds_to_reach(3, 20.0, 30.0) == 3
    assert model_decode.rounds_to_reach(2, 0.0, 1.3) == 2


def test_decode_bookkeeping_times_the_layers_outside_their_attention_and_restores_them():
    from focus_hf.tuner.layer import DecodingRun, FocusLayer

    module = load_benchmark("model/decode_bookkeeping")
    config = focus_hf.FocusConfig(num_groups=4, group_dim=8, window=8, dense_below=64)
    model = get_peft_model(tiny_model("llama"), config).eval()
    prompt = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    forward, next_state = FocusLayer.forward, DecodingRun.next_state
    with module.every_step_decided(True):
        assert DecodingRun.next_state is not next_state
    assert DecodingRun.next_state is next_state
    clock = module.LayerClock(model)
    with clock.installed():
        times = module.step_in_turn(model, clock, prompt, steps=3)
    assert FocusLayer.forward is forward and all("forward" not in vars(layer.base_layer) for layer in clock.layers)
    assert set(times) == set(module.KINDS)
    for seconds in times.values():
        assert len(seconds["step"]) == 3
        assert all(0 < bookkeeping < step for step, bookkeeping in zip(seconds["step"], seconds["bookkeeping"]))
