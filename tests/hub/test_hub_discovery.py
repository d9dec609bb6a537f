"""Finding and comparing shared adapters: `focus-hf search BASE` and `focus-hf compare A B`, on adapters pushed to the
loopback Hub in the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hub_server import hub_server  # noqa: F401  (pytest fixture)
from huggingface_hub import HfApi
from peft import get_peft_model
from tiny_models import tiny_model

import focus_hf
from focus_hf.card import write_model_card
from focus_hf.cli import main as cli_main
from focus_hf.hub import push_adapter
from focus_hf.interpret.overlap import adjusted_rand_index, matched_share

BASE = "focus-test/tiny-base"


def shared_adapter(folder: Path, repo_id: str, *, num_groups: int, base: str = BASE, seed: int = 0,
                   results: dict | None = None) -> Path:  # fmt: skip
    """A Focus adapter for tiny llama recording `base`, with a card (and figures, from `results`), pushed."""
    torch.manual_seed(seed)
    model = get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=num_groups, top_k=1, window=8))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "focus_" in name:
                parameter.add_(torch.randn_like(parameter))
    model.save_pretrained(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base}))
    if results is not None:
        (folder / "eval_results.json").write_text(json.dumps(results))
    write_model_card(folder, repo_id=repo_id)
    push_adapter(folder, repo_id)
    return folder


def figures(full: float, hard: float, speedup: float) -> dict:
    return {"full": {"ppl": full, "tokens": 512, "seq_len": 256, "data": "python-docs"},
            "hard": {"ppl": hard, "tokens": 512, "seq_len": 256, "top_k": 1},
            "speed": {"seq_len": 8192, "speedup": speedup}}  # fmt: skip


def test_search_lists_the_focus_adapters_of_a_base_with_their_figures(hub_server, tmp_path, capsys):
    shared_adapter(tmp_path / "k4", "focus-test/k4", num_groups=4, results=figures(10.0, 10.5, 1.3))
    shared_adapter(tmp_path / "k8", "focus-test/k8", num_groups=8, results=figures(10.0, 11.0, 1.8))
    shared_adapter(tmp_path / "other", "focus-test/other-base", num_groups=4, base="focus-test/another-base")
    api = HfApi()  # a LoRA adapter of the same base: tagged with it, but no Focus adapter
    api.create_repo("focus-test/lora")
    card = b"---\nbase_model: focus-test/tiny-base\nbase_model_relation: adapter\nlibrary_name: peft\n---\n"
    api.upload_file(path_or_fileobj=card, path_in_repo="README.md", repo_id="focus-test/lora")

    assert cli_main(["search", BASE, "--json", str(tmp_path / "found.json")]) == 0
    found = {row["repo_id"]: row for row in json.loads((tmp_path / "found.json").read_text())}
    assert set(found) == {"focus-test/k4", "focus-test/k8"}
    assert (found["focus-test/k4"]["num_groups"], found["focus-test/k4"]["perplexity_ratio"]) == (4, 1.05)
    assert (found["focus-test/k8"]["speedup"], found["focus-test/k8"]["context_length"]) == (1.8, 256)
    assert len(hub_server.requests_to("list")) == 1  # one listing request: the Hub's filters did the finding
    table = capsys.readouterr().out
    assert "focus-test/k4" in table and "1.050x" in table and "1.80x" in table and "another-base" not in table

    assert cli_main(["search", "focus-test/nobody"]) == 0
    assert "No Focus adapter on the Hub names focus-test/nobody" in capsys.readouterr().out


def test_compare_sets_two_adapters_side_by_side(hub_server, tmp_path, tiny_dir, text_file, capsys):
    shared_adapter(tmp_path / "a", "focus-test/a", num_groups=4, seed=1, results=figures(10.0, 10.5, 1.3))
    shared_adapter(tmp_path / "b", "focus-test/b", num_groups=8, seed=2)
    common = ["--model", str(tiny_dir), "--data", str(text_file), "--seq-len", "64", "--max-blocks", "2",
              "--no-progress"]  # fmt: skip
    assert cli_main(["compare", "focus-test/a", "focus-test/b", *common, "--json", str(tmp_path / "ab.json")]) == 0
    result = json.loads((tmp_path / "ab.json").read_text())
    assert result["config"]["num_groups"] == [4, 8] and result["config"]["window"] == [8, 8]
    assert result["figures"][0]["perplexity_ratio"] == 1.05 and result["figures"][1] == {}
    assert [row["layer"] for row in result["layers"]] == [0, 1] and result["text"]["blocks"] == 2
    for row in result["layers"]:
        assert -1 <= row["adjusted_rand_index"] < 1 and 0 < row["matched_share"] <= 1
    assert "* num_groups" in capsys.readouterr().out  # the table marks the options that differ

    # An adapter against itself (its own folder): the same grouping in every layer.
    again = ["compare", "focus-test/a", str(tmp_path / "a"), *common, "--json", str(tmp_path / "aa.json")]
    assert cli_main(again) == 0
    same = json.loads((tmp_path / "aa.json").read_text())
    assert all(row["adjusted_rand_index"] == 1 and row["matched_share"] == 1 for row in same["layers"])
    assert "* num_groups" not in capsys.readouterr().out

    shared_adapter(tmp_path / "c", "focus-test/c", num_groups=4, base="focus-test/another-base")
    with pytest.raises(SystemExit, match="compare adapters of one base"):
        cli_main(["compare", "focus-test/a", "focus-test/c", "--data", str(text_file)])


def test_group_overlap_measures_read_groupings_not_group_numbers():
    first = torch.tensor([0, 0, 1, 1, 2, 2])
    assert adjusted_rand_index(first, torch.tensor([5, 5, 3, 3, 0, 0])) == 1.0  # renamed groups: the same grouping
    assert adjusted_rand_index(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1])) == pytest.approx(-0.5)
    assert matched_share(torch.tensor([0, 0, 0, 1]), torch.tensor([2, 2, 1, 1])) == 0.75


def test_a_hub_adapter_is_read_on_the_base_it_records(hub_server, tmp_path, tiny_dir, text_file, capsys):
    """eval / inspect / audit on a Hub id without --model load the base the adapter records, not the default one."""
    shared_adapter(tmp_path / "a", "focus-test/recorded", num_groups=4, base=str(tiny_dir))
    common = ["--data", str(text_file), "--seq-len", "64", "--max-blocks", "1", "--no-progress"]
    assert cli_main(["eval", "focus-test/recorded", *common, "--json", str(tmp_path / "e.json")]) == 0
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["model"] == str(tiny_dir) and result["adapter"] == "focus-test/recorded" and result["ppl"] > 1
    assert cli_main(["audit", "focus-test/recorded", *common, "--queries-per-sequence", "8"]) == 0
    assert cli_main(["inspect", "focus-test/recorded", "--data", str(text_file), "--seq-len", "64",
                     "--max-blocks", "1", "--json", str(tmp_path / "i.json")]) == 0  # fmt: skip
    assert json.loads((tmp_path / "i.json").read_text())["layers"]
    with pytest.raises(SystemExit, match="applies to an adapter on the Hub"):
        cli_main(["eval", str(tmp_path / "a"), "--revision", "main", *common])
