import os
import sys
from pathlib import Path

# Telemetry would reach the real Hub; the Hub tests point the client at a local server (tests/support/hub_server.py).
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# "auto" would time dense against sparse attention on first use (attention/crossover.py): results must not
# depend on timings, so the suite uses the fixed default crossover; tests/attention/test_crossover.py fakes timers.
os.environ["FOCUS_HF_NO_CALIBRATION"] = "1"

import random

import pytest
import torch

# The tests' helpers (tests/support/) are imported by module name from every test: `from tiny_models import ...`.
sys.path.insert(0, str(Path(__file__).parent / "support"))

from tiny_models import tiny_model  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

import focus_hf  # noqa: E402,F401  registers the adapter type before any test builds a model


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _cards_read_right_once_rendered(monkeypatch):
    """Every model card rendered in a test passes `card_checks.check_rendered_card` (tables, code spans, links,
    metadata), whatever the test itself looks at."""
    from card_checks import check_rendered_card, input_strings

    import focus_hf.card

    render = focus_hf.card.render_model_card

    def render_and_check(adapter_dir, **kwargs):
        card = render(adapter_dir, **kwargs)
        # A value of the folder may itself read like an entity (a token "&amp;"): its code span shows it as it is.
        literal = input_strings(Path(adapter_dir), kwargs.get("interpretability"), kwargs.get("eval_results"))
        check_rendered_card(str(card), folder=Path(adapter_dir), literal_code=literal)
        return card

    monkeypatch.setattr(focus_hf.card, "render_model_card", render_and_check)


WORDS = [f"w{i}" for i in range(60)]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny llama checkpoint + word-level tokenizer in a folder (what --model accepts)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    vocab = {"[UNK]": 0, "<pad>": 1, "<eos>": 2, **{word: i + 3 for i, word in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]", pad_token="<pad>"
    )
    tiny_model("llama").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    # Word bigrams with structure (each word mostly followed by one of two successors) so that there is something
    # to learn; 4,000 words give ~110 training and ~12 held-out blocks of 32 tokens.
    rng = random.Random(0)
    words, current = [], 0
    for _ in range(4000):
        words.append(WORDS[current])
        current = (current * 7 + rng.choice((1, 2))) % len(WORDS)
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(" ".join(words), encoding="utf-8")
    return path


def pytest_collection_modifyitems(config, items):
    """Tests marked `vllm` need the vLLM virtual environment (scripts/setup_vllm_venv.sh): they run only when the
    marker expression names them (`python -m pytest -m vllm` there, as .ci/run does) and are otherwise reported as
    deselected, never as passed or skipped."""
    if "vllm" in (config.option.markexpr or ""):
        return
    kept = [item for item in items if item.get_closest_marker("vllm") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("vllm") is not None])
        items[:] = kept
