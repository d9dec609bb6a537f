"""Corpora in Hub dataset repos (hf://datasets/ORG/NAME[@REVISION][/PATH]) against the loopback Hub: read through the
cache and checked; an evaluation on one links it from the card, and on a Hub benchmark is pushed as `.eval_results/`."""

from __future__ import annotations

import json
import random

import pytest
import yaml
from conftest import WORDS
from hub_server import hub_server  # noqa: F401  (pytest fixture)
from huggingface_hub import HfApi, ModelCard, constants, parse_eval_result_entries
from tiny_models import make_adapter

from focus_hf.cli import main as cli_main
from focus_hf.data import load_texts
from focus_hf.hub import push_adapter
from focus_hf.hub.datasets import fetch_hub_corpus, parse_hub_dataset

DATASET = "focus-test/word-code"


def documents(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(count)]


def push_dataset(*, benchmark: bool) -> str:
    """A dataset repo with a test split (test.jsonl), a dataset card and, for a benchmark, an eval.yaml."""
    api = HfApi()
    api.create_repo(DATASET, repo_type="dataset")
    lines = "\n".join(json.dumps({"text": text}) for text in documents(40, seed=1))
    api.upload_file(path_or_fileobj=lines.encode(), path_in_repo="test.jsonl", repo_id=DATASET, repo_type="dataset")
    api.upload_file(path_or_fileobj=b"---\nlicense: mit\n---\n# Words\n", path_in_repo="README.md", repo_id=DATASET,
                    repo_type="dataset")  # fmt: skip
    if benchmark:
        spec = yaml.safe_dump({"name": "Word code", "tasks": [{"id": "perplexity", "split": "test"}]})
        api.upload_file(path_or_fileobj=spec.encode(), path_in_repo="eval.yaml", repo_id=DATASET, repo_type="dataset")
    return api.dataset_info(DATASET).sha


def test_a_hub_dataset_is_read_pinned_and_checked(hub_server, tmp_path, monkeypatch):
    commit = push_dataset(benchmark=True)
    spec = f"hf://datasets/{DATASET}/test.jsonl"
    corpus = fetch_hub_corpus(parse_hub_dataset(spec))
    assert corpus.dataset.spec == f"hf://datasets/{DATASET}@{commit}/test.jsonl" and corpus.benchmark_tasks == [
        "perplexity"
    ]
    assert load_texts(spec) == documents(40, seed=1) == load_texts(corpus.dataset.spec)
    with pytest.raises(ValueError, match="holds no .txt"):  # the whole repo is read as a folder (its card left out)
        load_texts(f"hf://datasets/{DATASET}")
    hub_server.corrupt_file(f"datasets/{DATASET}", "test.jsonl", "tamper")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "fresh-cache"))  # downloaded again, tampered
    with pytest.raises(ValueError, match="does not match the Hub's checksums"):
        load_texts(spec)
    with pytest.raises(ValueError, match="not a Hub dataset corpus"):
        parse_hub_dataset("hf://datasets/only-a-name")


def test_evaluation_on_a_hub_benchmark_links_it_and_is_pushed_as_eval_results(hub_server, tmp_path, tiny_dir):
    commit = push_dataset(benchmark=True)
    folder = tmp_path / "adapter"
    make_adapter(folder)
    args = ["card", str(folder), "--repo-id", "focus-test/measured", "--data", f"hf://datasets/{DATASET}/test.jsonl",
            "--model", str(tiny_dir), "--seq-len", "64", "--max-blocks", "2", "--heldout-fraction", "0.3",
            "--no-progress"]  # fmt: skip
    assert cli_main(args) == 0
    results = json.loads((folder / "eval_results.json").read_text())
    assert results["hard"]["data"] == f"hf://datasets/{DATASET}@{commit}/test.jsonl"
    card = ModelCard.load(folder / "README.md")
    assert card.data.datasets == [DATASET]
    assert {(r.dataset_type, r.dataset_revision) for r in card.data.eval_results} == {(DATASET, commit)}
    assert [r.metric_name.split(",")[1].strip() for r in card.data.eval_results] == [
        "Focus soft routing", "Focus hard routing"
    ]  # fmt: skip
    assert f"](https://huggingface.co/datasets/{DATASET})" in card.text

    push_adapter(folder, "focus-test/measured")
    pushed = yaml.safe_load(hub_server.get_file("focus-test/measured", ".eval_results/focus-hf-perplexity.yaml"))
    [entry] = parse_eval_result_entries(pushed)
    assert (entry.dataset_id, entry.task_id, entry.dataset_revision) == (DATASET, "perplexity", commit)
    assert entry.value == round(results["hard"]["ppl"], 4)
