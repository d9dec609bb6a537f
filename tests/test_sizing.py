"""Meta-device sizing: what an adapter costs for a base model that is never allocated."""

from __future__ import annotations

import json
import time

from peft import get_peft_model
from tiny_models import tiny_model

import focus_hf
from focus_hf.cli import main
from focus_hf.sizing import adapter_size

LLAMA_70B = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    num_hidden_layers=80,
    hidden_size=8192,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=28672,
    vocab_size=128256,
    max_position_embeddings=8192,
)


def test_70b_llama_adapter_size_from_the_cli(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_70B))
    start = time.perf_counter()
    assert main(["info", "--config", str(config), "--num-groups", "8", "--group-dim", "16", "--json"]) == 0
    elapsed = time.perf_counter() - start
    size = json.loads(capsys.readouterr().out)
    # 80 layers x (8192 x 16 projection + 8 x 16 centroids), fp32.
    assert size["parameters"] == 80 * (8192 * 16 + 8 * 16) == 10_496_000
    assert size["routed_layers"] == 80 and size["tensors"] == 160
    data = size["parameters"] * 4
    assert data < size["file_bytes"] < data + 30_000  # header: 160 tensor entries
    assert 70.5e9 < size["base_parameters"] < 70.6e9  # the 70B base was built on meta, never allocated
    assert elapsed < 30, elapsed
    assert main(["info", "--config", str(config), "--num-groups", "4", "--group-dim", "8"]) == 0
    text = capsys.readouterr().out
    assert f"{80 * (8192 * 8 + 4 * 8):,}" in text


def test_size_is_exactly_what_save_pretrained_writes(tmp_path):
    model = tiny_model("llama")
    for options in (dict(num_groups=4, group_dim=16), dict(num_groups=3, group_dim=8, query_projection=True)):
        peft_model = get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(**options))
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        peft_model.save_pretrained(folder)
        size = focus_hf.adapter_size(model.config, **options)
        assert size["file_bytes"] == (folder / "adapter_model.safetensors").stat().st_size
        assert size["parameters"] == sum(p.numel() for n, p in peft_model.named_parameters() if "focus_" in n)
    # A saved model folder (config.json only is read) gives the same answer as the config object.
    model.config.save_pretrained(tmp_path / "base")
    assert adapter_size(tmp_path / "base", num_groups=4) == adapter_size(model.config, num_groups=4)
    assert not any(p.device.type == "meta" for p in model.parameters())


def test_info_still_reads_an_adapter_folder(tmp_path, capsys):
    peft_model = get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=4))
    peft_model.save_pretrained(tmp_path / "adapter")
    assert main(["info", str(tmp_path / "adapter"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["parameters"] == 2 * (48 * 16 + 4 * 16)
