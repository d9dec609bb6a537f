"""Training (Trainer-based, routers only), perplexity evaluation and the train / eval commands.

Fast tests use a 2-layer random llama saved to a temporary folder with a word-level tokenizer, and a small text
file. `focus-hf demo` runs end to end on the real default model in tests/commands/test_cli_output.py.
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback

import focus_hf
from focus_hf.cli import main
from focus_hf.evaluation import perplexity
from focus_hf.fitting.trainer import GroupBalanceCallback, dominance, train_adapter
from focus_hf.tuner.controls import focus_layers

SEQ_LEN = 32


def make_config(**overrides) -> focus_hf.FocusConfig:
    options = dict(num_groups=4, group_dim=8, window=8, top_k=2, sink_tokens=2)
    options.update(overrides)
    return focus_hf.FocusConfig(**options)


def load_tiny(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


def train_blocks(tiny_dir, text_file, n=40):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    ids = tokenizer(text_file.read_text())["input_ids"]
    return torch.tensor(ids[: n * SEQ_LEN]).view(n, SEQ_LEN)


def train_tiny(tiny_dir, text_file, out, steps=4, **kwargs):
    torch.manual_seed(0)
    model = get_peft_model(load_tiny(tiny_dir), kwargs.pop("config", None) or make_config())
    options = dict(steps=steps, lr=1e-2, save_steps=2, progress_bar=False)
    options.update(kwargs)
    log = train_adapter(model, train_blocks(tiny_dir, text_file), out, **options)
    return model, log


def logits(model, ids, mode):
    focus_hf.set_routing(model, mode)
    with torch.no_grad():
        return model(input_ids=ids).logits


# --- train_adapter ---------------------------------------------------------------------------------------------


def test_trained_adapter_folder_reloads_with_same_logits(tiny_dir, text_file, tmp_path):
    model, _ = train_tiny(tiny_dir, text_file, tmp_path / "adapter")
    folder = tmp_path / "adapter"
    assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
    assert not (folder / "README.md").exists(), "PEFT's generic card must not be left behind"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "FOCUS"
    assert config["base_model_name_or_path"] == str(tiny_dir)

    loaded = PeftModel.from_pretrained(load_tiny(tiny_dir), folder)
    ids = train_blocks(tiny_dir, text_file, n=2)
    for mode in ("hard", "soft"):
        torch.testing.assert_close(logits(loaded, ids, mode), logits(model, ids, mode), rtol=0, atol=0)
    # Only the routers were trained: with the adapter disabled both are the untouched base model.
    with model.disable_adapter(), torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, load_tiny(tiny_dir)(input_ids=ids).logits)
    # And training did move the routers away from their initialisation.
    fresh = get_peft_model(load_tiny(tiny_dir), make_config())
    trained_state = {k: v for k, v in model.state_dict().items() if "focus_" in k}
    fresh_state = {k: v for k, v in fresh.state_dict().items() if "focus_" in k}
    assert trained_state.keys() == fresh_state.keys() and trained_state
    assert any(not torch.equal(trained_state[k], fresh_state[k]) for k in trained_state)


def test_existing_card_is_kept_and_no_pickles_are_written(tiny_dir, text_file, tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "README.md").write_text("my card")
    train_tiny(tiny_dir, text_file, folder, steps=2, save_steps=5)
    assert (folder / "README.md").read_text() == "my card"
    assert sorted(path.name for path in folder.iterdir() if path.is_file()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
        "training_log.json",
    ]


def test_training_log_contents(tiny_dir, text_file, tmp_path):
    _, log = train_tiny(
        tiny_dir, text_file, tmp_path / "adapter", steps=4, balance_blocks=train_blocks(tiny_dir, text_file, 2)
    )
    saved = json.loads((tmp_path / "adapter" / "training_log.json").read_text())
    assert saved == json.loads(json.dumps(log))
    assert saved["steps"] == 4 and saved["max_steps"] == 4
    assert saved["seq_len"] == SEQ_LEN and saved["batch_size"] == 1
    assert saved["tokens_seen"] == 4 * SEQ_LEN
    assert saved["trainable_parameters"] == 2 * (48 * 8 + 4 * 8)
    assert [entry["step"] for entry in saved["loss"]] == [1, 2, 3, 4]
    assert all(math.isfinite(entry["loss"]) and "learning_rate" in entry for entry in saved["loss"])
    assert saved["wall_time_s"] > 0
    assert saved["config"]["num_groups"] == 4 and saved["config"]["peft_type"] == "FOCUS"
    assert [record["step"] for record in saved["dominance"]] == [1, 2, 3, 4]
    for record in saved["dominance"]:
        assert record["layers"] == [0, 1]
        assert all(0.25 <= value <= 1.0 for value in record["dominance"])  # at least 1/K by definition
        assert record["max"] == max(record["dominance"])
    assert saved["heldout_dominance"]["layers"] == [0, 1]
    assert saved["versions"]["transformers"]


class StopAt(TrainerCallback):
    """Interrupts training after `step` (as a crash or a killed job would, but cleanly)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def test_resume_continues_from_checkpoint(tiny_dir, text_file, tmp_path):
    straight, _ = train_tiny(tiny_dir, text_file, tmp_path / "straight", steps=4)

    out = tmp_path / "resumed"
    _, first = train_tiny(tiny_dir, text_file, out, steps=4, save_steps=2, callbacks=[StopAt(2)])
    assert first["steps"] == 2
    assert (out / "checkpoints" / "checkpoint-2").is_dir()
    # A new process would rebuild the model from scratch: a freshly initialised adapter, then resume.
    model, log = train_tiny(tiny_dir, text_file, out, steps=4, save_steps=2, resume=True, config=make_config())
    assert log["steps"] == 4
    assert log["resumed_from"] == "checkpoints/checkpoint-2"
    assert [entry["step"] for entry in log["loss"]] == [1, 2, 3, 4]
    assert [record["step"] for record in log["dominance"]] == [1, 2, 3, 4]
    assert log["tokens_seen"] == 4 * SEQ_LEN
    # Optimizer, scheduler, data order and RNG come back with the checkpoint: 2 + 2 steps == 4 steps.
    ids = train_blocks(tiny_dir, text_file, n=2)
    torch.testing.assert_close(logits(model, ids, "soft"), logits(straight, ids, "soft"))


def test_resume_without_checkpoint_starts_fresh(tiny_dir, text_file, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="focus_hf.fitting.trainer"):
        _, log = train_tiny(tiny_dir, text_file, tmp_path / "adapter", steps=2, resume=True)
    assert log["steps"] == 2 and log["resumed_from"] is None
    assert "no checkpoint" in caplog.text


def test_dominance_warning_on_collapse(tiny_dir, text_file, tmp_path, caplog):
    torch.manual_seed(0)
    model = get_peft_model(load_tiny(tiny_dir), make_config())
    with torch.no_grad():
        for layer in focus_layers(model):
            # Identical centroids: every token scores every group the same, so all tokens land in group 0.
            layer.focus_centroids["default"].copy_(torch.ones_like(layer.focus_centroids["default"]))
    with caplog.at_level(logging.WARNING, logger="focus_hf.fitting.trainer"):
        log = train_adapter(
            model, train_blocks(tiny_dir, text_file), tmp_path / "adapter", steps=1, lr=1e-6, progress_bar=False
        )
    assert log["dominance"][0]["dominance"] == [1.0, 1.0]
    assert log["dominance_warnings"] == 1
    assert "collapsing" in caplog.text and "layer 0: 1.00" in caplog.text


def test_blocks_inside_the_window_are_refused(tiny_dir, text_file, tmp_path):
    model = get_peft_model(load_tiny(tiny_dir), make_config(window=SEQ_LEN))
    with pytest.raises(ValueError, match="window"):
        train_adapter(model, train_blocks(tiny_dir, text_file), tmp_path / "adapter", steps=1, progress_bar=False)


def test_balanced_routing_does_not_warn(caplog):
    callback = GroupBalanceCallback(every=1, threshold=0.5)
    callback._counts = {0: torch.tensor([4, 4, 4, 4]), 1: torch.tensor([7, 1, 0, 0])}
    with caplog.at_level(logging.WARNING, logger="focus_hf.fitting.trainer"):
        record = callback.check(step=3)
    assert record["dominance"] == [0.25, 0.875] and record["max_layer"] == 1
    assert "layer 1: 0.88" in caplog.text and "layer 0" not in caplog.text
    assert dominance(torch.tensor([[[0, 1], [0, 2], [1, 0], [3, 1]]]), 4) == 0.5


# --- perplexity -------------------------------------------------------------------------------------------------


def reference_perplexity(model, blocks, stride):
    """The loop of the Hugging Face perplexity guide over one token stream cut into strided windows."""
    seq_len = blocks.shape[1]
    stream = torch.cat([blocks[0], *[row[seq_len - stride :] for row in blocks[1:]]])
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, stream.numel() - seq_len + 1, stride):
        end = begin + seq_len
        target_len = end - prev_end
        ids = stream[begin:end][None]
        labels = ids.clone()
        labels[:, :-target_len] = -100
        with torch.no_grad():
            loss = model(input_ids=ids, labels=labels).loss
        scored = (labels[:, 1:] != -100).sum().item()
        nll_sum += loss.item() * scored
        n_tokens += scored
        prev_end = end
    return math.exp(nll_sum / n_tokens), n_tokens


@pytest.mark.parametrize("stride", [SEQ_LEN, 12])
def test_full_perplexity_is_the_base_models(tiny_dir, text_file, stride):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    text = text_file.read_text()
    model = get_peft_model(load_tiny(tiny_dir), make_config())
    result = perplexity(model, tokenizer, [text], seq_len=SEQ_LEN, stride=stride, mode="full", max_blocks=6)
    assert set(result) >= {"ppl", "tokens", "mode", "top_k", "seq_len", "stride", "seconds"}
    assert result["mode"] == "full" and result["top_k"] is None
    assert result["seq_len"] == SEQ_LEN and result["stride"] == stride

    from focus_hf.data import token_blocks

    windows = token_blocks(tokenizer, [text], SEQ_LEN, stride=stride, max_blocks=6)
    expected, tokens = reference_perplexity(load_tiny(tiny_dir), windows, stride)
    assert result["tokens"] == tokens == (SEQ_LEN - 1) + 5 * min(stride, SEQ_LEN - 1)
    assert result["ppl"] == pytest.approx(expected, rel=1e-5)
    # Same windows given as a tensor, and as a 1-D stream.
    assert perplexity(model, windows, seq_len=SEQ_LEN, stride=stride, mode="full")["ppl"] == pytest.approx(
        result["ppl"], rel=1e-6
    )


def test_soft_and_hard_perplexity_restore_routing(tiny_dir, text_file):
    model = get_peft_model(load_tiny(tiny_dir), make_config(window=4, top_k=1))
    blocks = train_blocks(tiny_dir, text_file, n=3)
    focus_hf.set_routing(model, "soft", top_k=3)
    full = perplexity(model, blocks, seq_len=SEQ_LEN, mode="full")
    soft = perplexity(model, blocks, seq_len=SEQ_LEN, mode="soft")
    hard = perplexity(model, blocks, seq_len=SEQ_LEN, mode="hard", top_k=1)
    assert hard["top_k"] == 1 and soft["top_k"] == 3
    assert len({full["ppl"], soft["ppl"], hard["ppl"]}) == 3
    layer = focus_layers(model)[0]
    assert (layer.mode_override, layer.top_k_override) == ("soft", 3)
    with pytest.raises(ValueError, match="mode"):
        perplexity(model, blocks, seq_len=SEQ_LEN, mode="sparse")


# --- command line -----------------------------------------------------------------------------------------------


def cli_train(tiny_dir, text_file, out, *extra):
    return main(
        [
            "train",
            "--model",
            str(tiny_dir),
            "--data",
            str(text_file),
            "--out",
            str(out),
            "--seq-len",
            str(SEQ_LEN),
            "--groups",
            "4",
            "--group-dim",
            "8",
            "--window",
            "8",
            "--sink-tokens",
            "2",
            "--lr",
            "0.01",
            "--heldout-fraction",
            "0.2",
            "--no-progress",
            *(extra if "--objective" in extra else ("--objective", "lm", *extra)),
        ]
    )


def test_cli_train_then_eval(tiny_dir, text_file, tmp_path, capsys):
    out = tmp_path / "adapter"
    assert cli_train(tiny_dir, text_file, out, "--steps", "3", "--save-steps", "3") == 0
    assert "Focus adapter saved" in capsys.readouterr().out
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps"] == 3 and log["metadata"]["data"] == str(text_file)
    assert log["config"]["num_groups"] == 4 and log["base_model"] == str(tiny_dir)
    assert log["base_weights"] is None  # an ordinary checkpoint, not a converted GGUF
    loaded = PeftModel.from_pretrained(load_tiny(tiny_dir), out)
    assert focus_layers(loaded)[0].focus_centroids["default"].shape == (4, 8)

    # Resume: the step count goes on from the checkpoint.
    assert cli_train(tiny_dir, text_file, out, "--steps", "5", "--resume") == 0
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps"] == 5 and log["resumed_from"] == "checkpoints/checkpoint-3"

    common = [
        "eval",
        "--adapter",
        str(out),
        "--data",
        str(text_file),
        "--seq-len",
        str(SEQ_LEN),
        "--heldout-fraction",
        "0.2",
        "--no-progress",
    ]
    capsys.readouterr()
    assert main([*common, "--mode", "hard", "--top-k", "1", "--json"]) == 0
    hard = json.loads(capsys.readouterr().out)
    assert {"ppl", "tokens", "mode", "top_k", "seq_len", "stride", "seconds"} <= set(hard)
    assert hard["mode"] == "hard" and hard["top_k"] == 1 and hard["model"] == str(tiny_dir)
    path = tmp_path / "full.json"
    assert main([*common, "--mode", "full", "--max-blocks", "2", "--json", str(path)]) == 0
    full = json.loads(path.read_text())
    assert full["mode"] == "full" and full["top_k"] is None and full["tokens"] == 2 * (SEQ_LEN - 1)


def test_cli_eval_needs_adapter_for_routed_modes(tiny_dir, text_file):
    with pytest.raises(SystemExit, match="--adapter"):
        main(["eval", "--model", str(tiny_dir), "--data", str(text_file), "--mode", "hard", "--seq-len", str(SEQ_LEN)])
