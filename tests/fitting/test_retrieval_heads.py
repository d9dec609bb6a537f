"""Retrieval audit: distant copy events, the copy mass each kv head pays, and what the adapter's routing drops."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from tiny_models import tiny_model

import focus_hf
from focus_hf.fitting.capture import capture_layers
from focus_hf.fitting.retrieval_heads import audit_retrieval, copy_events, retrieval_dense_heads


def focus_model(**options):
    config = dict(num_groups=4, group_dim=8, window=8, top_k=1, sink_tokens=2, query_projection=True)
    config.update(options)
    torch.manual_seed(0)
    return get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(**config)).eval()


def document(seed=0, length=160):
    """Random tokens with three 6-token spans copied from far back, so there are distant copy events."""
    ids = torch.randint(10, 128, (length,), generator=torch.Generator().manual_seed(seed))
    for source, target in ((5, 100), (30, 130), (50, 150)):
        ids[target : target + 6] = ids[source : source + 6]
    return ids


def test_copy_events_name_the_distant_source_of_each_repeated_token():
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 2, 3, 4, 13])
    queries, sources = copy_events(ids, window=4, sinks=0, context=2)
    # At t=13 ("3", after "2") the next token "4" continues "2 3 4" first seen ending at position 3.
    assert queries.tolist() == [13] and sources.tolist() == [3]
    assert ids[queries + 1].tolist() == ids[sources].tolist()
    # Within the window, or ambiguous (the n-gram seen twice before), or a sink: no event.
    assert copy_events(ids, window=12, sinks=0)[0].numel() == 0
    assert copy_events(ids, window=4, sinks=4)[0].numel() == 0
    twice = torch.tensor([2, 3, 4, 0, 0, 0, 0, 0, 2, 3, 4, 9, 9, 9, 9, 9, 9, 2, 3, 4])
    assert copy_events(twice, window=4, sinks=0)[0].tolist() == [9]


def test_audit_reports_every_head_and_copy_mass_from_the_dense_model():
    model = focus_model(dense_heads=[[1, 0]])
    ids = document()
    audit = audit_retrieval(model, [ids], progress=False)
    queries, sources = copy_events(ids, window=8, sinks=2)
    assert audit.events == len(queries) > 10
    assert {(row.layer, row.kv_head) for row in audit.rows} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for row in audit.rows:
        assert 0.0 <= row.dropped <= row.copy_mass <= 1.0
    dense = next(row for row in audit.rows if row.dense)
    assert (dense.layer, dense.kv_head, dense.dropped) == (1, 0, 0.0)
    # copy_mass: mean over events of the best query head's probability on the source, in the dense pass.
    capture = capture_layers(model, ids)[0]
    best = []
    for t, source in zip(queries.tolist(), sources.tolist()):
        logits = capture.query[:2, t] @ capture.key[0, : t + 1].T * capture.scaling  # kv head 0 serves heads 0, 1
        best.append(torch.softmax(logits, -1)[:, source].max())
    assert audit.rows[0].copy_mass == pytest.approx(float(torch.stack(best).mean()), abs=1e-5)


def test_probing_every_group_drops_nothing():
    model = focus_model()
    audit = audit_retrieval(model, [document(1)], top_k=4, progress=False)
    assert all(row.dropped == 0.0 for row in audit.rows)
    assert any(row.copy_mass > 0 for row in audit.rows)


def test_retrieval_dense_heads_adds_the_heads_dropping_most():
    model = focus_model()
    audit = audit_retrieval(model, [document(2)], progress=False)
    ranked = audit.ranked()
    assert [row.dropped for row in ranked] == sorted((row.dropped for row in ranked), reverse=True)
    top = [ranked[0].layer, ranked[0].kv_head]
    assert retrieval_dense_heads(audit, 1) == [top]
    keep = [[1, 1]] if top != [1, 1] else [[0, 0]]
    chosen = retrieval_dense_heads(audit, 2, keep=keep)
    assert len(chosen) == 3 and keep[0] in chosen and top in chosen
    with pytest.raises(ValueError, match="count"):
        retrieval_dense_heads(audit, -1)
