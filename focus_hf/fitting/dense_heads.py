"""Which kv heads keep full attention: picked from the recall audit and the retrieval audit, on training text.

Two kinds of heads lose what routing cannot give back. Heads that spread their attention far and wide lose the most
attention mass on ordinary text (`focus_hf.fitting.recall_audit`); in a small model they sit in the early layers and
shape every later representation. Retrieval heads pay little mass on average but carry the answer to "what was X?"
when a query copies a token from far back (`focus_hf.fitting.retrieval_heads`). `calibrate_full_attention` takes the
first kind from one block of training text and the second from synthetic retrieval documents it generates (a seed of
their own, so not the documents the routers were fitted on), and sets `dense_heads` on the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from focus_hf.data import retrieval_documents, token_blocks
from focus_hf.fitting.recall_audit import audit_recall, calibrate_dense_heads
from focus_hf.fitting.retrieval_heads import audit_retrieval, retrieval_dense_heads
from focus_hf.tuner.controls import configure_adapter


@dataclass
class FullAttentionCalibration:
    """What `calibrate_full_attention` chose and why (JSON-ready)."""

    dense_heads: list[list[int]]
    mass_heads: list[dict] = field(default_factory=list)  # per chosen head: layer, kv_head, kept mass
    retrieval_heads: list[dict] = field(default_factory=list)  # per chosen head: layer, kv_head, copy / dropped

    def to_dict(self) -> dict:
        return {"dense_heads": self.dense_heads, "mass_heads": self.mass_heads, "retrieval_heads": self.retrieval_heads}


def calibrate_full_attention(
    model: nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    seq_len: int,
    *,
    mass_heads: int = 0,
    retrieval_heads: int = 0,
    retrieval_document_count: int = 2,
    seed: int = 1,
    progress: bool = True,
) -> FullAttentionCalibration:
    """Choose the kv heads that keep full attention and set them as the active adapter's `dense_heads`.

    Args:
        model: a model with an active (trained) Focus adapter.
        tokenizer: its tokenizer.
        texts: training text: one block of it feeds the recall audit, windows of it fill the retrieval documents.
        seq_len: tokens per calibration sequence (the length the adapter is meant for).
        mass_heads: kv heads losing the most attention mass (recall audit) to keep dense.
        retrieval_heads: further kv heads dropping the most attention on distant copied tokens to keep dense.
        retrieval_document_count: synthetic retrieval documents for the retrieval audit.
        seed: seed of those documents (use one the routers were not fitted with).
        progress: show progress bars.

    Returns:
        A `FullAttentionCalibration`; the adapter's `dense_heads` are set to its `dense_heads` (None when empty).
    """
    pairs: list[list[int]] = []
    calibration = FullAttentionCalibration(dense_heads=pairs)
    if mass_heads:
        audit = audit_recall(model, token_blocks(tokenizer, texts, seq_len, max_blocks=1), progress=progress)
        pairs = calibrate_dense_heads(audit, mass_heads)
        by_head = {(row.layer, row.kv_head): row for row in audit.rows}
        calibration.mass_heads = [
            {"layer": layer, "kv_head": head, "kept": by_head[(layer, head)].adapter} for layer, head in pairs
        ]
    if retrieval_heads:
        documents = retrieval_documents(tokenizer, texts, seq_len, retrieval_document_count, seed=seed)
        retrieval = audit_retrieval(model, documents, progress=progress)
        chosen = retrieval_dense_heads(retrieval, retrieval_heads, keep=pairs)
        by_head = {(row.layer, row.kv_head): row for row in retrieval.rows}
        calibration.retrieval_heads = [
            {
                "layer": layer,
                "kv_head": head,
                "copy_mass": by_head[(layer, head)].copy_mass,
                "dropped": by_head[(layer, head)].dropped,
            }
            for layer, head in chosen
            if [layer, head] not in pairs
        ]
        pairs = chosen
    calibration.dense_heads = pairs
    configure_adapter(model, dense_heads=pairs or None)
    return calibration
