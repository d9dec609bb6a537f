"""Unit tests for focus_hf.data (no model downloads: a word-level tokenizer is built here)."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from focus_hf.data import BUILTIN_CORPORA, load_texts, split_texts, token_blocks

WORDS = "zero one two three four five six seven eight nine".split()


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {"[UNK]": 0, "<eos>": 1, **{word: i + 2 for i, word in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]")


# --- load_texts ---------------------------------------------------------------------------------


def test_text_file_is_one_document(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello\nworld\n", encoding="utf-8")
    assert load_texts(str(path)) == ["hello\nworld\n"]


def test_folder_recursive_sorted_and_filtered(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b.md").write_text("B", encoding="utf-8")
    (tmp_path / "a.txt").write_text("A", encoding="utf-8")
    (tmp_path / "sub" / "c.py").write_text("C", encoding="utf-8")
    (tmp_path / "sub" / "d.rst").write_text("D", encoding="utf-8")
    (tmp_path / "sub" / "empty.txt").write_text("  \n", encoding="utf-8")
    (tmp_path / "skip.json").write_text("nope", encoding="utf-8")
    (tmp_path / ".git" / "x.txt").write_text("hidden", encoding="utf-8")
    assert load_texts(tmp_path) == ["A", "B", "C", "D"]


def test_folder_without_text_files(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="holds no"):
        load_texts(str(tmp_path))


def test_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "first"}\n\n{"text": "second", "id": 2}\n', encoding="utf-8")
    assert load_texts(str(path)) == ["first", "second"]


@pytest.mark.parametrize("bad_line", ['{"content": "x"}', '["text"]', "{not json", '{"text": 3}'])
def test_jsonl_error_names_line(tmp_path, bad_line):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + bad_line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2\b"):
        load_texts(str(path))


def test_python_docs():
    from pydoc_data.topics import topics

    texts = load_texts("python-docs")
    assert texts == [topics[key] for key in sorted(topics) if topics[key].strip()]
    assert len(texts) > 10


def test_python_source():
    texts = load_texts("python-source")
    assert len(texts) > 100
    assert any("def makedirs(" in text for text in texts)  # os.py
    assert any("class OrderedDict" in text for text in texts)  # collections/__init__.py
    assert texts == load_texts("python-source")


def test_python_source_excludes_tests():
    import os
    from pathlib import Path

    root = Path(os.__file__).parent
    test_file = next((root / "test").glob("test_*.py"), None) if (root / "test").is_dir() else None
    if test_file is None:
        pytest.skip("this Python has no test package")
    content = test_file.read_text(encoding="utf-8", errors="ignore")
    assert content not in load_texts("python-source")


def test_unknown_spec_lists_builtins():
    with pytest.raises(ValueError) as info:
        load_texts("no-such-corpus-or-file")
    for name in BUILTIN_CORPORA:
        assert name in str(info.value)


# --- split_texts --------------------------------------------------------------------------------


def test_split_is_deterministic_and_order_independent():
    texts = [f"document number {i}" for i in range(200)]
    train, heldout = split_texts(texts, 0.2, seed=3)
    assert (train, heldout) == split_texts(list(texts), 0.2, seed=3)
    r_train, r_heldout = split_texts(texts[::-1], 0.2, seed=3)
    assert set(r_heldout) == set(heldout) and set(r_train) == set(train)
    assert sorted(train + heldout) == sorted(texts)
    assert 0.1 < len(heldout) / len(texts) < 0.3
    assert train == [t for t in texts if t in set(train)]  # input order kept
    assert split_texts(texts, 0.2, seed=4)[1] != heldout


def test_split_two_documents_both_sides_nonempty():
    for fraction in (0.01, 0.5, 0.99):
        train, heldout = split_texts(["alpha", "beta"], fraction)
        assert len(train) == 1 and len(heldout) == 1


def test_split_single_document_by_characters():
    text = "x" * 90 + "y" * 10
    assert split_texts([text], 0.1) == (["x" * 90], ["y" * 10])
    train, heldout = split_texts(["ab"], 0.001)
    assert train == ["a"] and heldout == ["b"]


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5])
def test_split_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError):
        split_texts(["a", "b"], fraction)


# --- token_blocks -------------------------------------------------------------------------------


def test_blocks_concatenate_with_eos(tokenizer):
    blocks = token_blocks(tokenizer, ["zero one two", "three four"], seq_len=3)
    # ids: zero=2 ... ; stream 2 3 4 <eos>=1 5 6 -> two blocks of 3
    assert blocks.dtype == torch.long
    assert blocks.tolist() == [[2, 3, 4], [1, 5, 6]]


def test_blocks_shape_stride_and_max_blocks(tokenizer):
    text = " ".join(WORDS)  # 10 tokens, ids 2..11
    blocks = token_blocks(tokenizer, [text], seq_len=4)
    assert blocks.shape == (2, 4)  # last 2 tokens dropped
    strided = token_blocks(tokenizer, [text], seq_len=4, stride=2)
    assert strided.shape == (4, 4)
    assert strided[:, 0].tolist() == [2, 4, 6, 8]
    assert torch.equal(strided[1, :2], strided[0, 2:])
    assert token_blocks(tokenizer, [text], seq_len=4, stride=2, max_blocks=3).shape == (3, 4)
    assert token_blocks(tokenizer, [text], seq_len=4, max_blocks=100).shape == (2, 4)


def test_max_blocks_tokenizes_lazily(tokenizer):
    texts = ["zero one"] * 1000
    blocks = token_blocks(tokenizer, texts, seq_len=3, max_blocks=2)
    assert blocks.shape == (2, 3)
    assert torch.equal(blocks, token_blocks(tokenizer, texts, seq_len=3)[:2])


def test_too_short(tokenizer):
    with pytest.raises(ValueError, match="fewer than seq_len"):
        token_blocks(tokenizer, ["zero one", "two"], seq_len=5)  # 4 tokens with the separator


@pytest.mark.parametrize(
    "kwargs", [dict(seq_len=0), dict(seq_len=4, stride=0), dict(seq_len=4, stride=5), dict(seq_len=4, max_blocks=0)]
)
def test_blocks_bad_arguments(tokenizer, kwargs):
    with pytest.raises(ValueError):
        token_blocks(tokenizer, [" ".join(WORDS)], **kwargs)
