"""Multi-process (torchrun or accelerate launch, 2 CPU processes, gloo) training of `focus-hf train` (both
objectives) and examples/train_with_trainer.py: both ranks end with identical routers, equal (within TOLERANCE) to one
process on the same global batch, the adapter is written once, and a resumed 2-process run ends where an
uninterrupted one does.

The LM corpus is cut to 2 blocks, so that every step's global batch holds both whatever the sampler's order: one
process with batch 2, or two processes with batch 1 each (DDP averages their gradients). Distillation shares its
calibration sequences between the processes and sums their gradients (`focus_hf.fitting.parallel`).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "multiprocess_worker.py"
EXAMPLE = ROOT / "examples" / "train_with_trainer.py"
# Two processes sum their gradients in another order than one process does: float32 rounding, which AdamW's
# normalised steps carry into the routers (measured: at most 1.0e-6 after 4 steps of the LM objective, 9e-8 after 6
# distillation steps per layer; router entries are ~0.1).
TOLERANCE = 1e-5
WORDS = [f"w{i}" for i in range(60)]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny llama + word-level tokenizer folder, and a small text file."""
    folder = tmp_path_factory.mktemp("mp-base")
    vocab = {"[UNK]": 0, "<pad>": 1, "<eos>": 2, **{word: i + 3 for i, word in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]", pad_token="<pad>"
    )
    tiny_model("llama").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rng = random.Random(0)
    words, current = [], 0
    for _ in range(2000):
        words.append(WORDS[current])
        current = (current * 7 + rng.choice((1, 2))) % len(WORDS)
    corpus = folder / "corpus.txt"
    corpus.write_text(" ".join(words), encoding="utf-8")
    return folder, corpus


def launch(dump: Path, processes: int, *args: str, launcher_name: str = "torchrun") -> str:
    """Run the worker on `processes` processes (1: plainly) with `torchrun` or `accelerate launch`; return the
    combined output."""
    dump.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FOCUS_TEST_DUMP": str(dump), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    launcher = [sys.executable]
    if processes > 1 and launcher_name == "torchrun":
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    elif processes > 1:
        # `--cpu` would make accelerate run a single process (its simple launcher); `--multi_gpu` is its
        # torch.distributed launcher, which trains on the CPU with gloo where there is no GPU.
        launcher += ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes)]
        launcher += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    # The timeout only guards against a hung rendezvous: a run takes ~40 s alone, but one took over 240 s inside
    # the full suite on this 2-core VM (two training processes beside pytest).
    result = subprocess.run(
        [*launcher, str(WORKER), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


def routers(dump: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    return load_file(dump / f"rank{rank}.safetensors")


def assert_ranks_agree(dump: Path) -> dict[str, torch.Tensor]:
    first, second = routers(dump, 0), routers(dump, 1)
    assert first.keys() == second.keys() and first
    assert all(torch.equal(first[name], second[name]) for name in first)
    return first


def assert_close(found, expected, tolerance=TOLERANCE):
    assert found.keys() == expected.keys()
    for name in found:
        torch.testing.assert_close(found[name], expected[name], rtol=0, atol=tolerance)


def assert_saved(folder: Path, expected: dict[str, torch.Tensor]) -> None:
    saved = load_file(folder / "adapter_model.safetensors")
    assert {name.replace(".default", "") for name in expected} == set(saved)
    for name, value in expected.items():
        assert torch.equal(saved[name.replace(".default", "")], value)


def test_focus_hf_train_on_two_processes(base, tmp_path):
    model, corpus = base
    common = ["cli", "train", "--objective", "lm", "--model", str(model), "--data", str(corpus), "--seq-len", "32"]
    common += ["--max-train-blocks", "2", "--groups", "4", "--group-dim", "8", "--window", "8", "--no-progress"]
    common += ["--lr", "0.02", "--no-balance-check"]

    launch(tmp_path / "one", 1, *common, "--out", str(tmp_path / "out-one"), "--steps", "4", "--batch-size", "2")
    output = launch(
        tmp_path / "two", 2, *common, "--out", str(tmp_path / "out-two"), "--steps", "4", "--batch-size", "1"
    )
    two = assert_ranks_agree(tmp_path / "two")
    one = routers(tmp_path / "one")
    assert_close(two, one)
    # Written once, by rank 0, with what the ranks hold; the log records both processes.
    assert output.count("Focus adapter saved") == 1
    assert_saved(tmp_path / "out-two", two)
    log = json.loads((tmp_path / "out-two" / "training_log.json").read_text())
    assert log["world_size"] == 2 and log["steps"] == 4 and log["batch_size"] == 1

    # Stop after 2 steps (checkpoint), resume to 4 on two processes: the same routers as the uninterrupted run.
    out = str(tmp_path / "out-resumed")
    launch(tmp_path / "half", 2, *common, "--out", out, "--steps", "2", "--save-steps", "2", "--batch-size", "1")
    launch(tmp_path / "resumed", 2, *common, "--out", out, "--steps", "4", "--resume", "--batch-size", "1")
    resumed = assert_ranks_agree(tmp_path / "resumed")
    assert_close(resumed, two)
    assert json.loads((tmp_path / "out-resumed" / "training_log.json").read_text())["resumed_from"] == (
        "checkpoints/checkpoint-2"
    )


@pytest.mark.parametrize("launcher_name", ["torchrun", "accelerate"])
def test_trainer_example_on_two_processes(base, tmp_path, launcher_name):
    model, corpus = base
    common = ["script", str(EXAMPLE), "--model", str(model), "--data", str(corpus), "--seq-len", "32"]
    common += ["--max-train-blocks", "2", "--window", "8", "--steps", "3", "--lr", "0.02"]
    launch(tmp_path / "one", 1, *common, "--out", str(tmp_path / "out-one"), "--batch-size", "2")
    two_args = [*common, "--out", str(tmp_path / "out-two"), "--batch-size", "1"]
    output = launch(tmp_path / "two", 2, *two_args, launcher_name=launcher_name)
    two = assert_ranks_agree(tmp_path / "two")
    assert_close(two, routers(tmp_path / "one"))
    assert output.count("adapter saved to") == 1
    assert_saved(tmp_path / "out-two", two)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-model", "layerwise"])
def test_focus_hf_distill_on_two_processes(base, tmp_path, layerwise):
    """`--objective distill`: each process captures and fits on half of the 4 calibration sequences and the
    gradients are summed, so both ranks end with the routers of one process on all 4."""
    model, corpus = base
    common = ["cli", "train", "--objective", "distill", "--model", str(model), "--data", str(corpus)]
    common += ["--seq-len", "160", "--steps", "6", "--groups", "4", "--group-dim", "8", "--window", "8"]
    common += ["--sequences", "3", "--retrieval-documents", "1", "--queries-per-sequence", "16", "--top-m", "8"]
    common += ["--dense-heads", "1", "--no-progress", *(["--layerwise"] if layerwise else [])]

    launch(tmp_path / "one", 1, *common, "--out", str(tmp_path / "out-one"))
    output = launch(tmp_path / "two", 2, *common, "--out", str(tmp_path / "out-two"))
    two = assert_ranks_agree(tmp_path / "two")
    assert_close(two, routers(tmp_path / "one"))
    assert output.count("Focus adapter saved") == 1
    assert_saved(tmp_path / "out-two", two)
    logs = [json.loads((tmp_path / out / "training_log.json").read_text()) for out in ("out-one", "out-two")]
    # The log's figures are taken over both processes' sequences: those of one process on all of them.
    for one_layer, two_layer in zip(logs[0]["layers"], logs[1]["layers"]):
        assert two_layer["kept_before"] == pytest.approx(one_layer["kept_before"], abs=1e-6)
        assert two_layer["kept_after"] == pytest.approx(one_layer["kept_after"], abs=1e-4)
    assert logs[0]["config"]["dense_heads"] == logs[1]["config"]["dense_heads"]

    # Resume on two processes from the checkpoint rank 0 wrote, as if the run had stopped after layer 0.
    state = tmp_path / "out-two" / "checkpoints" / "distill_state.json"
    saved_state = json.loads(state.read_text())
    state.write_text(json.dumps({"layers_done": saved_state["layers_done"][:1]}))
    launch(tmp_path / "resumed", 2, *common, "--out", str(tmp_path / "out-two"), "--resume")
    assert_close(assert_ranks_agree(tmp_path / "resumed"), two)
