"""Configurations Focus cannot serve exactly are refused when the engine is configured, before any worker starts,
with an error that names the problem - never served with dense attention."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import REAL_ADAPTER

from focus_hf.errors import FocusServingError

pytestmark = pytest.mark.vllm


def _configure(model, adapter, **options):
    """Build the engine configuration as `LLM(...)` / `vllm serve` do (plugins loaded, platform hook run)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model), dtype="float32", additional_config={"focus_adapter": str(adapter)}, **options)
    return args.create_engine_config()


def test_plain_configuration_is_accepted_and_run_eagerly(tiny_llama_dir, tiny_adapter, capsys):
    config = _configure(tiny_llama_dir, tiny_adapter)
    assert config.model_config.enforce_eager
    logged = capsys.readouterr().out
    assert "Focus adapter" in logged and "K=4" in logged and "window=16" in logged and "sinks=2" in logged
    assert "dense heads=1" in logged and "local folder" in logged


def test_lora_is_refused(tiny_llama_dir, tiny_adapter):
    with pytest.raises(FocusServingError, match="LoRA is enabled"):
        _configure(tiny_llama_dir, tiny_adapter, enable_lora=True)


def test_speculative_decoding_is_refused(tiny_llama_dir, tiny_adapter):
    speculative = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with pytest.raises(FocusServingError, match="speculative decoding"):
        _configure(tiny_llama_dir, tiny_adapter, speculative_config=speculative)


def test_pipeline_parallel_is_refused(tiny_llama_dir, tiny_adapter):
    with pytest.raises(FocusServingError, match="pipeline parallelism"):
        _configure(tiny_llama_dir, tiny_adapter, pipeline_parallel_size=2, distributed_executor_backend="mp")


def test_tensor_parallel_is_refused(tiny_llama_dir, tiny_adapter):
    with pytest.raises(FocusServingError, match="tensor parallelism"):
        _configure(tiny_llama_dir, tiny_adapter, tensor_parallel_size=2, distributed_executor_backend="mp")


def test_quantized_kv_cache_is_refused(tiny_llama_dir, tiny_adapter):
    with pytest.raises(FocusServingError, match="quantized KV cache"):
        _configure(tiny_llama_dir, tiny_adapter, kv_cache_dtype="fp8")


def test_sliding_window_model_is_refused(tmp_path, tiny_llama_dir, tiny_adapter):
    folder = tmp_path / "windowed"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["sliding_window"] = 64
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(FocusServingError, match="sliding window"):
        _configure(folder, tiny_adapter)


def test_positions_past_the_rotary_table_are_refused_unless_it_is_extended(tiny_llama_dir, tiny_adapter, monkeypatch):
    positions = json.loads((tiny_llama_dir / "config.json").read_text())["max_position_embeddings"]
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own check lets it through then
    with pytest.raises(FocusServingError, match="rotary embedding reads its cos/sin table without a bound"):
        _configure(tiny_llama_dir, tiny_adapter, max_model_len=2 * positions)
    overrides = {"max_position_embeddings": 2 * positions}
    config = _configure(tiny_llama_dir, tiny_adapter, max_model_len=2 * positions, hf_overrides=overrides)
    assert config.model_config.max_model_len == 2 * positions


def test_unsupported_model_family_is_refused(tmp_path, tiny_llama_dir, tiny_adapter):
    folder = tmp_path / "qwen2"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(FocusServingError, match="model family"):
        _configure(folder, tiny_adapter)


def test_adapter_for_another_model_is_refused(tiny_llama_dir):
    with pytest.raises(FocusServingError, match="hidden_size: adapter has 576, served model has 128"):
        _configure(tiny_llama_dir, REAL_ADAPTER)


def test_missing_adapter_is_refused(tmp_path, tiny_llama_dir):
    with pytest.raises(FocusServingError, match="neither an existing folder nor a Hub id"):
        _configure(tiny_llama_dir, tmp_path / "no" / "such" / "adapter")


def test_pickled_adapter_is_refused(tmp_path, tiny_llama_dir, tiny_adapter):
    folder = tmp_path / "pickled"
    shutil.copytree(tiny_adapter, folder)
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FocusServingError, match="refuses pickle"):
        _configure(tiny_llama_dir, folder)


def test_unknown_focus_key_is_refused(tiny_llama_dir, tiny_adapter):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(tiny_llama_dir), additional_config={"focus_adaptor": str(tiny_adapter)})
    with pytest.raises(FocusServingError, match="no 'focus_adapter'"):
        args.create_engine_config()
