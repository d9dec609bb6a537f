"""Recall audit, router distillation (layer-local, from the model's own attention) and `train --objective distill`."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel, get_peft_model
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM

import focus_hf
from focus_hf.cli import main
from focus_hf.data import RETRIEVAL_FACTS, retrieval_documents
from focus_hf.fitting.capture import capture_layers, distant_attention, query_positions
from focus_hf.fitting.distill import CHECKPOINT_STATE, DistillSettings, distill_routers
from focus_hf.fitting.recall_audit import audit_recall, calibrate_dense_heads
from focus_hf.tuner.controls import focus_layers

SETTINGS = DistillSettings(steps=25, lr=0.05, top_m=16, queries_per_sequence=96)


def focus_model(seed=0, **options):
    config = dict(num_groups=4, group_dim=8, window=8, top_k=1, sink_tokens=2, query_projection=True)
    config.update(options)
    torch.manual_seed(seed)
    return get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(**config)).eval()


def sequences(count=3, length=192):
    return [torch.randint(3, 128, (length,), generator=torch.Generator().manual_seed(i)) for i in range(count)]


def test_capture_matches_the_base_model_and_leaves_the_adapter_on():
    model = focus_model()
    ids = sequences(1)[0]
    focus_hf.set_routing(model, "hard")
    before = model(input_ids=ids[None]).logits
    captures = capture_layers(model, ids)
    assert sorted(captures) == [0, 1]
    capture = captures[0]
    assert capture.hidden.shape == (192, 48) and capture.query.shape == (4, 192, 12) and capture.key.shape[0] == 2
    # The captured attention is the base model's: its rows sum to one over causal keys.
    attention = distant_attention(capture, torch.arange(10, 192), window=192, sinks=0)
    torch.testing.assert_close(attention.local, torch.ones_like(attention.local))
    torch.testing.assert_close(model(input_ids=ids[None]).logits, before)  # adapter still on, same routing


def test_query_positions_have_a_fixed_count_and_keep_the_end():
    positions = query_positions(1000, 128, 100, torch.Generator().manual_seed(0))
    assert len(positions) == 164 and positions.min() > 128 and positions[-1] == 999
    assert torch.equal(positions[-64:], torch.arange(936, 1000))
    assert len(query_positions(100, 128)) == 0


def test_audit_bounds_and_dense_heads():
    model = focus_model(dense_heads=[[1, 0]])
    audit = audit_recall(model, sequences(2), progress=False)
    assert len(audit.rows) == 4
    for row in audit.rows:
        assert 0 <= row.local <= row.adapter + 1e-6 <= 1 + 1e-6
        if row.dense:
            assert (row.layer, row.kv_head) == (1, 0) and row.adapter == row.oracle == 1.0
    # The oracle picks the best groups for the head average of each layer: no router keeps more there.
    for layer in (0, 1):
        rows = [row for row in audit.rows if row.layer == layer and not row.dense]
        assert sum(r.oracle for r in rows) >= sum(r.adapter for r in rows) - 1e-6
        # The key oracle keeps as many distant keys per query as the adapter, the best ones for the layer.
        assert sum(r.key_oracle for r in rows) >= sum(r.adapter for r in rows) - 1e-6
        assert all(r.local - 1e-6 <= r.key_oracle <= 1 + 1e-6 for r in rows)
    assert all(row.key_oracle == 1.0 for row in audit.rows if row.dense)
    assert calibrate_dense_heads(audit, 1) == [[1, 0]]
    worst = min((row for row in audit.rows if not row.dense), key=lambda row: row.adapter)
    assert [worst.layer, worst.kv_head] in calibrate_dense_heads(audit, 2)


def test_key_oracle_equals_a_brute_force_choice():
    # One layer, a few queries: the best `count` distant keys by head-summed mass, checked by enumeration order.
    from focus_hf.fitting.capture import LayerCapture, distant_attention

    generator = torch.Generator().manual_seed(0)
    capture = LayerCapture(
        torch.zeros(40, 8),
        torch.randn(4, 40, 8, generator=generator),
        torch.randn(2, 40, 8, generator=generator),
        0.35,
        None,
    )
    queries = torch.tensor([20, 31, 39])
    counts = torch.tensor([3, 0, 7])
    attention = distant_attention(capture, queries, window=5, sinks=2, keep_counts=counts)
    keys = capture.key.repeat_interleave(2, dim=0)
    for row, (position, count) in enumerate(zip(queries.tolist(), counts.tolist())):
        logits = torch.einsum("hd,hkd->hk", capture.query[:, position], keys[:, : position + 1]) * 0.35
        probs = torch.softmax(logits, dim=-1)
        distant = probs[:, 2 : position - 5]  # beyond the window, sinks left out
        best = distant.sum(0).argsort(descending=True)[:count] + 2
        expected = probs[:, best].sum(-1)
        torch.testing.assert_close(attention.best_mass[:, row], expected, atol=1e-6, rtol=0)


def test_audit_report_files(tmp_path):
    pytest.importorskip("matplotlib")
    audit = audit_recall(focus_model(), sequences(1), progress=False)
    audit.save_json(tmp_path / "audit.json")
    audit.save_png(tmp_path / "audit.png")
    data = json.loads((tmp_path / "audit.json").read_text())
    assert set(data["mean"]) == {"local", "adapter", "oracle", "key_oracle"} and len(data["rows"]) == 4
    assert (tmp_path / "audit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "oracle" in audit.table() and "key oracle" in audit.table()


# A shared router must file a token and choose its probes with one assignment, so it gains less than a query router.
@pytest.mark.parametrize("query_projection, gain", [(True, 0.02), (False, 0.0)])
def test_distillation_keeps_more_attention_in_hard_mode(query_projection, gain):
    model = focus_model(query_projection=query_projection)
    data = sequences()
    before = audit_recall(model, data, progress=False).mean("adapter")
    results = distill_routers(model, data, SETTINGS, progress=False)
    assert all(result.kept_after > result.kept_before for result in results)
    after = audit_recall(model, data, progress=False).mean("adapter")
    assert after > before + gain
    # Only the routers changed: the frozen model is untouched and every router weight is finite.
    for layer in focus_layers(model):
        assert all(torch.isfinite(p).all() for p in layer.parameters())


def test_distillation_resumes_from_its_checkpoint(tmp_path):
    data = sequences(2)
    full = focus_model(seed=3)
    distill_routers(full, data, SETTINGS, checkpoint_dir=tmp_path / "a", progress=False)
    # A run that stopped after layer 0: keep only that layer in the state, then resume in a fresh model.
    state = json.loads((tmp_path / "a" / CHECKPOINT_STATE).read_text())
    state["layers_done"] = state["layers_done"][:1]
    (tmp_path / "a" / CHECKPOINT_STATE).write_text(json.dumps(state))
    resumed = focus_model(seed=3)
    results = distill_routers(resumed, data, SETTINGS, checkpoint_dir=tmp_path / "a", progress=False)
    assert [r.layer for r in results] == [0, 1]
    for a, b in zip(focus_layers(full), focus_layers(resumed)):
        for name in ("focus_proj", "focus_centroids", "focus_query_proj"):
            torch.testing.assert_close(getattr(a, name)["default"], getattr(b, name)["default"])


def test_distillation_needs_equal_lengths_and_an_active_adapter():
    model = focus_model()
    with pytest.raises(ValueError, match="one length"):
        distill_routers(model, [torch.arange(3, 100), torch.arange(3, 120)], SETTINGS, progress=False)
    with model.disable_adapter(), pytest.raises(ValueError, match="disabled"):
        distill_routers(model, sequences(1), SETTINGS, progress=False)


def test_retrieval_documents(tiny_dir):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    filler = [" ".join(f"w{i % 60}" for i in range(3000))]
    documents = retrieval_documents(tokenizer, filler, 256, 3, seed=1)
    assert len(documents) == 3 and all(d.shape == (256,) for d in documents)
    assert not torch.equal(documents[0], documents[1])
    assert "pass key" not in RETRIEVAL_FACTS  # the benchmark's passkey phrasing is held out


def test_cli_distill_writes_a_loadable_adapter(tiny_dir, text_file, tmp_path, capsys):
    out = tmp_path / "distilled"
    arguments = ["train", "--objective", "distill", "--model", str(tiny_dir), "--data", str(text_file)]
    arguments += ["--out", str(out), "--seq-len", "160", "--steps", "5", "--groups", "4", "--group-dim", "8"]
    arguments += ["--window", "8", "--top-k", "1", "--sequences", "2", "--retrieval-documents", "1"]
    arguments += ["--queries-per-sequence", "16", "--top-m", "8", "--dense-heads", "1", "--no-progress"]
    arguments += ["--retrieval-heads", "1", "--dense-below", "4096"]
    assert main(arguments) == 0
    assert "attention mass kept" in capsys.readouterr().out
    log = json.loads((out / "training_log.json").read_text())
    assert log["objective"] == "distill" and len(log["layers"]) == 2
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["query_projection"] is True and len(config["dense_heads"]) == 2 and config["dense_below"] == 4096
    calibration = log["metadata"]["full_attention_calibration"]
    assert len(calibration["mass_heads"]) == 1 and len(calibration["retrieval_heads"]) == 1
    assert sorted(calibration["dense_heads"]) == sorted(config["dense_heads"])
    assert config["base_model_name_or_path"] == str(tiny_dir)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), out).eval()
    assert loaded(input_ids=torch.arange(3, 80)[None]).logits.isfinite().all()
    # A second run into the same folder needs --resume (the checkpoint of the first is there).
    with pytest.raises(SystemExit, match="--resume"):
        main(arguments)
    assert main([*arguments, "--resume"]) == 0


def test_cli_distill_layerwise_gives_the_same_adapter(tiny_dir, text_file, tmp_path):
    from safetensors.torch import load_file

    outputs = []
    for flags in ([], ["--layerwise"]):
        out = tmp_path / f"distilled{len(flags)}"
        arguments = ["train", "--objective", "distill", "--model", str(tiny_dir), "--data", str(text_file)]
        arguments += ["--out", str(out), "--seq-len", "160", "--steps", "5", "--groups", "4", "--group-dim", "8"]
        arguments += ["--window", "8", "--sequences", "2", "--retrieval-documents", "1", "--queries-per-sequence", "16"]
        assert main([*arguments, "--top-m", "8", "--no-progress", *flags]) == 0
        outputs.append(load_file(out / "adapter_model.safetensors"))
    assert outputs[0].keys() == outputs[1].keys()
    for name in outputs[0]:
        torch.testing.assert_close(outputs[0][name], outputs[1][name], atol=1e-5, rtol=0)


def test_cli_audit(tiny_dir, text_file, tmp_path, capsys):
    adapter = tmp_path / "adapter"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_dir), focus_hf.FocusConfig(num_groups=4, window=8))
    model.save_pretrained(adapter)
    arguments = ["audit", "--adapter", str(adapter), "--model", str(tiny_dir), "--data", str(text_file)]
    arguments += ["--seq-len", "160", "--queries", "32", "--json", str(tmp_path / "a.json"), "--dense-heads", "2"]
    assert main([*arguments, "--retrieval-heads", "2", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "oracle" in printed and "kv heads losing the most mass" in printed
    assert "distant copy events" in printed and "retrieval heads dropping the most copy mass" in printed
    assert json.loads((tmp_path / "a.json").read_text())["seq_len"] == 160
