"""Text corpora for training and evaluating adapters: loading, splitting and cutting into token blocks."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["BUILTIN_CORPORA", "TEXT_SUFFIXES", "load_texts", "split_texts", "token_blocks"]

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
"""File suffixes read when `load_texts` is given a folder."""

_EXCLUDED_STDLIB_DIRS = frozenset({"test", "tests", "idlelib", "site-packages"})


def _python_docs() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def _python_source() -> list[str]:
    root = Path(os.__file__).parent
    files = sorted(
        (
            path
            for path in root.rglob("*.py")
            if not _EXCLUDED_STDLIB_DIRS.intersection(path.relative_to(root).parts[:-1])
        ),
        key=lambda path: path.relative_to(root).as_posix(),
    )
    # A few stdlib files (e.g. encoding test data) are not valid utf-8; their stray bytes do not matter here.
    return [path.read_text(encoding="utf-8", errors="ignore") for path in files]


BUILTIN_CORPORA: dict[str, Callable[[], list[str]]] = {
    "python-docs": _python_docs,
    "python-source": _python_source,
}
"""Corpora available without downloads: names accepted by `load_texts`."""


def _read_user_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not valid utf-8: {error}") from error


def _read_jsonl(path: Path) -> list[str]:
    texts = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {number}: invalid JSON ({error.msg})") from error
            if not isinstance(record, dict) or "text" not in record:
                raise ValueError(f"{path}, line {number}: expected an object with a 'text' field")
            if not isinstance(record["text"], str):
                raise ValueError(f"{path}, line {number}: the 'text' field must be a string")
            texts.append(record["text"])
    return texts


def _read_folder(folder: Path) -> list[str]:
    files = sorted(
        (
            path
            for path in folder.rglob("*")
            if path.suffix in TEXT_SUFFIXES
            and path.is_file()
            # Hidden folders (.git, .venv, ...) hold tooling, not corpus text.
            and not any(part.startswith(".") for part in path.relative_to(folder).parts)
        ),
        key=lambda path: path.relative_to(folder).as_posix(),
    )
    if not files:
        raise ValueError(f"{folder} holds no {', '.join(TEXT_SUFFIXES)} files")
    return [_read_user_file(path) for path in files]


def load_texts(spec: str | os.PathLike) -> list[str]:
    """Loads a corpus as a list of documents.

    Args:
        spec (`str` or `os.PathLike`):
            One of:
            - a `.jsonl` file: one JSON object per line, each with a string `text` field;
            - any other file: one document, read as utf-8;
            - a folder: every `*.txt`, `*.md`, `*.py` and `*.rst` file below it (hidden
              folders skipped), one document each, in sorted path order;
            - a built-in corpus name from `BUILTIN_CORPORA`: `python-docs` (the pydoc topics,
              sorted by key) or `python-source` (the standard library's `.py` files,
              without tests, idlelib and site-packages, in sorted path order);
            - a Hub dataset, `hf://datasets/ORG/NAME[@REVISION][/PATH]`: the file or folder PATH of that
              dataset repo, downloaded through the huggingface_hub cache, checked against the Hub's checksums
              and read as above (`focus_hf.hub.datasets`).
            An existing path wins over a built-in name.

    Returns:
        `list[str]`: The documents, in a deterministic order. Empty or whitespace-only
        documents are dropped: they carry no tokens to learn from.

    Raises:
        `ValueError`:
            If `spec` is neither an existing path nor a built-in name, if a `.jsonl` line has
            no `text` field (the message names the line), if a file is not utf-8, or if a
            folder holds no text files.
    """
    if os.fspath(spec).startswith("hf://"):
        from focus_hf.hub.datasets import fetch_hub_corpus, parse_hub_dataset

        dataset = parse_hub_dataset(spec)
        if dataset is None:
            raise ValueError(f"{os.fspath(spec)!r}: only Hub datasets (hf://datasets/ORG/NAME...) are corpora.")
        return load_texts(fetch_hub_corpus(dataset).path)
    path = Path(spec).expanduser()
    if path.is_dir():
        texts = _read_folder(path)
    elif path.is_file():
        texts = _read_jsonl(path) if path.suffix == ".jsonl" else [_read_user_file(path)]
    elif os.fspath(spec) in BUILTIN_CORPORA:
        texts = BUILTIN_CORPORA[os.fspath(spec)]()
    else:
        raise ValueError(
            f"{os.fspath(spec)!r} is neither an existing file or folder nor a built-in corpus; "
            f"built-in corpora: {', '.join(BUILTIN_CORPORA)}"
        )
    return [text for text in texts if text.strip()]


def _unit_hash(text: str, seed: int) -> float:
    digest = hashlib.sha256(f"{seed}\0{text}".encode("utf-8", errors="surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_texts(texts: Sequence[str], heldout_fraction: float = 0.1, seed: int = 0) -> tuple[list[str], list[str]]:
    """Splits documents into a training part and a held-out part, deterministically.

    Each document's fate depends only on its content and `seed`: it is held out when a
    sha256 hash of both, read as a number in [0, 1), falls below `heldout_fraction`. The
    split is therefore the same on every machine, does not depend on the documents' order,
    keeps duplicate documents on the same side, and does not move existing documents when
    others are added. The held-out share is `heldout_fraction` only on average.

    With two or more documents both parts are made non-empty, because callers train on one
    and measure on the other: when the hashes leave a side empty (likely with few
    documents), the document whose hash lies closest to the threshold changes side.
    A single document is cut by characters instead, its last `heldout_fraction` held out.

    Args:
        texts (`Sequence[str]`):
            The documents, e.g. from `load_texts`.
        heldout_fraction (`float`, *optional*, defaults to 0.1):
            Expected share of documents held out, strictly between 0 and 1.
        seed (`int`, *optional*, defaults to 0):
            Changes which documents are held out.

    Returns:
        `tuple[list[str], list[str]]`: The training and held-out documents, each in input order.

    Raises:
        `ValueError`:
            If `heldout_fraction` is not in (0, 1), `texts` is empty, or a single document
            is too short to cut in two.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be strictly between 0 and 1, got {heldout_fraction}")
    if not texts:
        raise ValueError("cannot split an empty list of texts")
    if len(texts) == 1:
        text = texts[0]
        if len(text) < 2:
            raise ValueError("a single text needs at least 2 characters to be split")
        cut = min(max(round(len(text) * (1.0 - heldout_fraction)), 1), len(text) - 1)
        return [text[:cut]], [text[cut:]]

    scores = [_unit_hash(text, seed) for text in texts]
    heldout = [score < heldout_fraction for score in scores]
    if not any(heldout):
        heldout[min(range(len(texts)), key=scores.__getitem__)] = True
    elif all(heldout):
        heldout[max(range(len(texts)), key=scores.__getitem__)] = False
    train = [text for text, held in zip(texts, heldout) if not held]
    test = [text for text, held in zip(texts, heldout) if held]
    return train, test


def _encode(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    # verbose=False: long documents are expected here, and cut into blocks afterwards.
    return list(tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"])


def token_blocks(
    tokenizer: Any,
    texts: Sequence[str],
    seq_len: int,
    *,
    max_blocks: int | None = None,
    stride: int | None = None,
) -> torch.LongTensor:
    """Tokenizes documents into fixed-length blocks for language modelling.

    The documents are tokenized without special tokens and concatenated with the
    tokenizer's eos token between them, then windows of `seq_len` tokens are taken every
    `stride` tokens. Tokens after the last full window are dropped.

    Args:
        tokenizer (`PreTrainedTokenizerBase`):
            A Hugging Face tokenizer with an `eos_token_id`.
        texts (`Sequence[str]`):
            The documents.
        seq_len (`int`):
            Tokens per block.
        max_blocks (`int`, *optional*):
            Return at most this many blocks (the first ones); only as many documents are
            tokenized as these need.
        stride (`int`, *optional*):
            Distance between the starts of consecutive blocks, from 1 to `seq_len`; defaults
            to `seq_len` (no overlap). A smaller stride gives overlapping windows, as used
            for strided perplexity evaluation.

    Returns:
        `torch.LongTensor`: The blocks, of shape `[n_blocks, seq_len]`.

    Raises:
        `ValueError`:
            If the arguments are out of range, the tokenizer has no eos token, or the texts
            give fewer than `seq_len` tokens.
    """
    stride = seq_len if stride is None else stride
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be between 1 and seq_len={seq_len}, got {stride}")
    if max_blocks is not None and max_blocks < 1:
        raise ValueError(f"max_blocks must be positive, got {max_blocks}")
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("the tokenizer has no eos token to separate documents with")

    needed = None if max_blocks is None else (max_blocks - 1) * stride + seq_len
    pieces: list[torch.Tensor] = []
    n_tokens = 0
    # Tokenize in batches (fast tokenizers parallelize a batch) and stop once max_blocks is covered,
    # so asking a few blocks of a large corpus stays cheap.
    batch = 64
    for start in range(0, len(texts), batch):
        for ids in _encode(tokenizer, texts[start : start + batch]):
            if pieces:
                pieces.append(torch.tensor([eos], dtype=torch.long))
                n_tokens += 1
            pieces.append(torch.tensor(ids, dtype=torch.long))
            n_tokens += len(ids)
        if needed is not None and n_tokens >= needed:
            break

    if n_tokens < seq_len:
        raise ValueError(f"the texts give {n_tokens} tokens, fewer than seq_len={seq_len} needed for a single block")
    tokens = torch.cat(pieces)
    if needed is not None:
        tokens = tokens[:needed]
    return tokens.unfold(0, seq_len, stride).contiguous()


# Kinds of facts the retrieval documents hide. The benchmark's passkey prompts ("the pass key is ...") are
# deliberately not among them: a router must learn retrieval in general, not one phrasing.
RETRIEVAL_FACTS = (
    "access code",
    "secret number",
    "room number",
    "order number",
    "ticket number",
    "account pin",
    "vault combination",
    "magic number",
    "locker number",
    "reference code",
)


def retrieval_documents(
    tokenizer: Any,
    filler_texts: Sequence[str],
    seq_len: int,
    count: int,
    *,
    facts_per_document: int = 4,
    seed: int = 0,
) -> list[torch.LongTensor]:
    """Synthetic long-range retrieval texts of exactly `seq_len` tokens, for router distillation.

    Each document is real filler text (windows of `filler_texts`) with `facts_per_document` facts ("The access
    code is 48213. ...") inserted at random depths, and ends by asking for every fact and answering it, so the
    model's attention at the end reaches back to the facts.

    Args:
        tokenizer: a Hugging Face tokenizer.
        filler_texts: documents to take the filler from (e.g. the training split of the corpus).
        seq_len: tokens per document.
        count: number of documents.
        facts_per_document: facts hidden in each document.
        seed: makes the documents reproducible.

    Returns:
        `count` LongTensors of shape [seq_len].
    """
    import random

    rng = random.Random(seed)
    filler = torch.cat([torch.tensor(ids, dtype=torch.long) for ids in _encode(tokenizer, filler_texts) if ids])
    if len(filler) < seq_len:
        raise ValueError(f"the filler texts give {len(filler)} tokens, fewer than seq_len={seq_len}")
    documents = []
    for _ in range(count):
        names = rng.sample(RETRIEVAL_FACTS, k=min(facts_per_document, len(RETRIEVAL_FACTS)))
        facts = [(name, str(rng.randrange(10000, 99999))) for name in names]
        needles = [_encode(tokenizer, [f" The {n} is {v}. Remember it. {v} is the {n}. "])[0] for n, v in facts]
        questions = _encode(tokenizer, ["".join(f" What is the {n}? The {n} is {v}." for n, v in facts)])[0]
        budget = seq_len - len(questions) - sum(len(n) for n in needles)
        if budget < len(needles):
            raise ValueError(f"seq_len={seq_len} is too short for {len(needles)} facts and their questions")
        start = rng.randrange(0, len(filler) - budget + 1)
        text = filler[start : start + budget].tolist()
        cuts = sorted(rng.randrange(0, budget) for _ in needles)
        pieces, previous = [], 0
        for cut, needle in zip(cuts, needles):
            pieces += text[previous:cut] + needle
            previous = cut
        pieces += text[previous:] + questions
        documents.append(torch.tensor(pieces[:seq_len], dtype=torch.long))
    return documents


PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_prompt(tokenizer: Any, length: int, depth: float, key: str) -> torch.LongTensor:
    """The classic passkey-retrieval prompt: about `length` tokens of repetitive filler with "The pass key is KEY"
    hidden at `depth` (0 = start, 1 = end), ending with "What is the pass key? The pass key is".

    Returns:
        `torch.LongTensor` [n] of token ids (n close to `length`).
    """
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = " What is the pass key? The pass key is"
    budget = length - len(tokenizer(needle + question)["input_ids"]) - 2
    # verbose=False: the filler is longer than the prompt on purpose (it is cut to the budget), and the prompt is as
    # long as the caller asked; the tokenizer would warn whenever either passes the model's maximum length.
    filler = tokenizer(PASSKEY_FILLER * (budget // 10 + 10), verbose=False)["input_ids"][:budget]
    cut = int(len(filler) * depth)
    text = tokenizer.decode(filler[:cut]) + needle + tokenizer.decode(filler[cut:]) + question
    return torch.tensor(tokenizer(text, verbose=False)["input_ids"])
