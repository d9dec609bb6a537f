"""`query_projection` (a separate query-side router), `dense_heads` (kv heads that keep full attention),
`dense_below` (short calls attend densely) and `configure_adapter` (changing them after training)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model
from tiny_models import VOCAB, tiny_model
from transformers import AttentionInterface, DynamicCache

import focus_hf
from focus_hf.files import adapter_summary
from focus_hf.interpret.groups import record_routing
from focus_hf.tuner.layer import FocusLayer

ATOL = 1e-5
WINDOW, SINKS = 6, 2


def focus_model(architecture="llama", **options):
    config = dict(num_groups=4, group_dim=8, window=WINDOW, top_k=1, sink_tokens=SINKS)
    config.update(options)
    model = get_peft_model(tiny_model(architecture), focus_hf.FocusConfig(**config)).eval()
    # A query router unlike the key router, so that probes and own groups really disagree.
    generator = torch.Generator().manual_seed(5)
    for layer in focus_hf.focus_layers(model):
        for weight in layer.focus_query_proj.values():
            weight.data = torch.randn(weight.shape, generator=generator)
    return model


def tokens(batch=1, seq=40, seed=1):
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def looped_reference(query, key, value, probes, own, dense_kv=()):
    """Attention one (query, head) at a time from the rule: j's own group among i's probes, local, sink or dense."""
    batch, heads, seq, dim = query.shape
    repeats = heads // key.shape[1]
    output = torch.empty(batch, seq, heads, dim)
    for b in range(batch):
        for i in range(seq):
            for h in range(heads):
                allowed = torch.zeros(seq, dtype=torch.bool)
                for j in range(i + 1):
                    allowed[j] = (
                        h // repeats in dense_kv
                        or i - j <= WINDOW
                        or j < SINKS
                        or bool((probes[b, i] == own[b, j]).any())
                    )
                logits = (key[b, h // repeats] @ query[b, h, i]) * dim**-0.5
                weights = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=0)
                output[b, i, h] = weights @ value[b, h // repeats]
    return output


def run_capturing(model, ids):
    """One forward; per layer the attention's (query, key, value, output) and the recorded routing."""
    captured = {}
    original = AttentionInterface._global_mapping["focus"]

    def spy(module, query, key, value, attention_mask, **kwargs):
        output, weights = original(module, query, key, value, attention_mask, **kwargs)
        captured[module.layer_idx] = (query, key, value, output)
        return output, weights

    AttentionInterface._global_mapping["focus"] = spy
    try:
        with torch.no_grad(), record_routing(model) as recorder:
            logits = model(input_ids=ids).logits
    finally:
        AttentionInterface._global_mapping["focus"] = original
    return logits, captured, recorder.groups(), recorder.key_groups()


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dense_heads", [None, [[0, 1]], [[0, 0], [1, 1]]])
def test_query_router_and_dense_heads_equal_looped_reference(backend, top_k, dense_heads):
    model = focus_model(top_k=top_k, query_projection=True, dense_heads=dense_heads)
    focus_hf.set_routing(model, "hard", backend=backend)
    _, captured, probes, own = run_capturing(model, tokens())
    assert any(bool((probes[layer][..., 0] != own[layer]).any()) for layer in own), "query router never differs"
    for layer, (query, key, value, output) in captured.items():
        dense_kv = tuple(head for index, head in (dense_heads or []) if index == layer)
        expected = looped_reference(query, key, value, probes[layer], own[layer], dense_kv)
        torch.testing.assert_close(output, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_adaptive_probing_equals_looped_reference(backend):
    # probe_mass=0.6 with at most 3 probes: confident queries probe one group, others two or three.
    # A high temperature flattens the routing probabilities, so that many queries need more than one probe.
    options = dict(num_groups=6, top_k=3, probe_mass=0.6, temperature=0.3, query_projection=True)
    model = focus_model(**options, dense_heads=[[1, 0]])
    focus_hf.set_routing(model, "hard", backend=backend)
    _, captured, probes, own = run_capturing(model, tokens(batch=2, seq=48))
    counts = torch.cat([(probes[layer] != probes[layer][..., :1]).sum(-1).flatten() + 1 for layer in probes])
    assert set(counts.tolist()) == {1, 2, 3}, "every number of probes up to top_k should occur"
    for layer, (query, key, value, output) in captured.items():
        dense_kv = tuple(head for index, head in [[1, 0]] if index == layer)
        expected = looped_reference(query, key, value, probes[layer], own[layer], dense_kv)
        torch.testing.assert_close(output, expected, atol=ATOL, rtol=0)


def test_adaptive_probing_generate_with_cache_equals_recomputation():
    model = focus_model(num_groups=6, top_k=3, probe_mass=0.6, temperature=0.3, query_projection=True)
    focus_hf.set_routing(model, "hard")
    assert_generation_equals_recomputation(model, tokens(seq=30), 12)


@pytest.mark.parametrize("top_k", [1, 2])
def test_dense_heads_apart_from_each_other_equal_looped_reference(top_k):
    # 4 kv heads with dense heads that are not neighbours: the heads run in several runs of one kind each.
    dense_heads = [[0, 0], [0, 2], [1, 1], [1, 2]]
    model = focus_model("olmo2", top_k=top_k, query_projection=True, dense_heads=dense_heads)
    focus_hf.set_routing(model, "hard", backend="sdpa")
    _, captured, probes, own = run_capturing(model, tokens())
    for layer, (query, key, value, output) in captured.items():
        dense_kv = tuple(head for index, head in dense_heads if index == layer)
        expected = looped_reference(query, key, value, probes[layer], own[layer], dense_kv)
        torch.testing.assert_close(output, expected, atol=ATOL, rtol=0)


def test_output_attentions_with_dense_heads_keeps_head_order():
    model = focus_model("olmo2", dense_heads=[[0, 0], [0, 2]])
    focus_hf.set_routing(model, "hard")
    with torch.no_grad():
        weights = model(input_ids=tokens(), output_attentions=True).attentions[0]
    assert weights.shape == (1, 4, 40, 40)
    distant = weights[0, :, WINDOW + 1 :, SINKS:].tril(-WINDOW - 1)  # pairs beyond the window, sinks left out
    hidden = (distant == 0) & torch.ones_like(distant, dtype=torch.bool).tril(-WINDOW - 1)
    assert not hidden[0].any() and not hidden[2].any()  # dense heads see every causal pair
    assert hidden[1].any() and hidden[3].any()  # routed heads do not


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_all_heads_dense_equals_base(mode):
    ids = tokens(batch=2, seq=48)
    model = focus_model(dense_heads=[[layer, head] for layer in range(2) for head in range(2)])
    focus_hf.set_routing(model, mode)
    torch.testing.assert_close(model(input_ids=ids).logits, tiny_model("llama")(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("side", ["left", "right"])
def test_query_router_padded_batch_equals_samples_alone(side, top_k):
    model = focus_model(top_k=top_k, query_projection=True, dense_heads=[[1, 0]])
    focus_hf.set_routing(model, "hard", backend="sdpa")
    samples = [tokens(seq=48, seed=3)[0], tokens(seq=31, seed=4)[0]]
    ids = torch.zeros(2, 48, dtype=torch.long)
    mask = torch.zeros(2, 48, dtype=torch.long)
    for row, sample in enumerate(samples):
        span = slice(48 - len(sample), 48) if side == "left" else slice(0, len(sample))
        ids[row, span], mask[row, span] = sample, 1
    batched = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    for row, sample in enumerate(samples):
        torch.testing.assert_close(
            batched[row, mask[row].bool()], model(input_ids=sample[None]).logits[0], atol=ATOL, rtol=0
        )


def assert_generation_equals_recomputation(model, prompt, new_tokens):
    """Greedy generate() with the KV cache picks the tokens that recomputing the whole text each step picks."""
    options = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    generated = model.generate(input_ids=prompt, **options)
    sequence = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            next_token = model(input_ids=sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_token], dim=1)
    assert torch.equal(generated, sequence)


def test_query_router_generate_with_cache_equals_recomputation():
    model = focus_model(top_k=2, query_projection=True, dense_heads=[[0, 1]])
    focus_hf.set_routing(model, "hard")
    assert_generation_equals_recomputation(model, tokens(seq=30), 12)


@pytest.mark.parametrize("limit", [1, 3, 64])
def test_deferred_key_routing_while_decoding_equals_recomputation(monkeypatch, limit):
    # Decoding with a query router defers the new tokens' key-side Sinkhorn in blocks (PENDING_LIMIT tokens, capped
    # by the window: `cache_state.block_until`): greedy tokens must equal recomputing the whole sequence, across
    # several blocks. Past the sinks a step's token waits in the state's list (`note_step`), its attention reading
    # the settled groups.
    import focus_hf.tuner.cache_state as cache_state
    import focus_hf.tuner.layer as layer_module

    monkeypatch.setattr(cache_state, "PENDING_LIMIT", limit)
    model = focus_model(top_k=1, query_projection=True)
    focus_hf.set_routing(model, "hard", backend="sdpa")
    waiting, noted = [], []
    original_defer, original_note = layer_module.defer_tokens, layer_module.note_step

    def watching_defer(*args, **kwargs):
        result = original_defer(*args, **kwargs)
        waiting.append(result[1].pending)
        return result

    def watching_note(state, *args):
        original_note(state, *args)
        noted.append(True)
        waiting.append(state.pending + len(state.noted_steps))

    monkeypatch.setattr(layer_module, "defer_tokens", watching_defer)
    monkeypatch.setattr(layer_module, "note_step", watching_note)
    assert_generation_equals_recomputation(model, tokens(seq=30), 20)
    assert noted and waiting and max(waiting) == min(limit, WINDOW)


@pytest.mark.parametrize("backend, decode_copy", [("auto", True), ("sdpa", False), ("reference", True)])
def test_noted_routed_steps_equal_recomputation(monkeypatch, backend, decode_copy):
    # Past the sinks a routed step's token waits in the state's list (`routing.note_step`), so the keys' groups end
    # before it: every path of the attention reads them with the waiting keys in no group and not sinks
    # (`routing.waiting_keys`) - the group-sorted copies (settled groups only), gathering, and the reference path.
    import focus_hf.tuner.layer as layer_module

    model = focus_model(top_k=1, query_projection=True, dense_heads=[[1, 0]])
    focus_hf.set_routing(model, "hard", backend=backend, decode_copy=decode_copy)
    noted = []
    original = layer_module.note_step
    monkeypatch.setattr(layer_module, "note_step", lambda state, *a: noted.append(state.seen) or original(state, *a))
    assert_generation_equals_recomputation(model, tokens(seq=30), 20)
    assert noted


@pytest.mark.parametrize("query_projection, dense_heads", [(False, None), (True, None), (True, [[0, 1], [1, 0]])])
def test_decoding_across_dense_below_equals_recomputation(query_projection, dense_heads):
    # Below dense_below a decoding step attends densely and routes nothing now (its key side waits, for shared
    # routers too); once the cache reaches dense_below the waiting tokens are routed and decoding is sparse.
    model = focus_model(top_k=1, query_projection=query_projection, dense_below=38, dense_heads=dense_heads)
    focus_hf.set_routing(model, "hard", backend="sdpa")
    assert_generation_equals_recomputation(model, tokens(seq=30), 20)


@pytest.mark.parametrize("query_projection", [False, True])
def test_decoding_steps_below_dense_below_route_nothing(monkeypatch, query_projection):
    # A decoding step that attends densely is the base model's step (`FocusLayer._dense_decoding_until`): no router runs
    # until a step needs the waiting tokens, which are then routed as one block; the tokens generated still equal
    # recomputing the whole text.
    model = focus_model(top_k=1, query_projection=query_projection, window=16, dense_below=45)
    focus_hf.set_routing(model, "hard", backend="sdpa")
    import focus_hf.tuner.layer as layer_module

    calls = []
    original = FocusLayer.router_scores
    monkeypatch.setattr(FocusLayer, "router_scores", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    deferring = layer_module.defer_tokens  # what a step that waits for its routing paid before
    monkeypatch.setattr(layer_module, "defer_tokens", lambda *a, **k: calls.append(2) or deferring(*a, **k))
    probing = FocusLayer.query_probes  # a routed step's probes (its token then waits in the state's list)
    monkeypatch.setattr(FocusLayer, "query_probes", lambda self, *a, **k: calls.append(3) or probing(self, *a, **k))
    cache = DynamicCache()
    with torch.no_grad():
        token = model(input_ids=tokens(seq=30), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        after_prompt = len(calls)
        for _ in range(14):  # caches of 30 .. 43 tokens: each step's 31 .. 44 keys are below dense_below
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        assert len(calls) == after_prompt
        model(input_ids=token, past_key_values=cache, use_cache=True)  # 45 keys: routed
        assert len(calls) > after_prompt
    assert_generation_equals_recomputation(model, tokens(seq=30), 30)


def test_layer_with_every_head_dense_decodes_as_the_base_model(monkeypatch):
    # Layer 0 keeps both of its kv heads dense, so its attention never reads the routing: its decoding steps are the
    # base model's (`FocusLayer._every_head_dense`) - no router runs there but to settle a full block - while layer 1
    # routes every step; the tokens generated equal recomputing the whole text.
    model = focus_model(top_k=1, query_projection=True, dense_heads=[[0, 0], [0, 1]])
    focus_hf.set_routing(model, "hard", backend="sdpa")
    routed = []
    original = FocusLayer.query_probes
    monkeypatch.setattr(
        FocusLayer, "query_probes", lambda self, *a, **k: routed.append(self.layer_index) or original(self, *a, **k)
    )
    assert_generation_equals_recomputation(model, tokens(seq=30), 12)
    assert routed and set(routed) == {1}


def test_query_probes_are_the_routers_top_groups():
    # In inference the probes come from one product hidden @ (W_q D) (`FocusLayer.query_probes`); they must be the
    # top-k groups of the query router's log-probabilities, best first, as routing a prompt computes them.
    model = focus_model(num_groups=8, query_projection=True)
    layer = focus_hf.focus_layers(model)[0]
    hidden = torch.randn(3, 50, layer.focus_proj["default"].shape[0], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        log_probs = torch.log_softmax(layer.router_scores("default", hidden, query_side=True), dim=-1)
        for top_k in (1, 3):
            assert torch.equal(layer.query_probes("default", hidden, top_k), log_probs.topk(top_k, dim=-1).indices)
        layer.focus_centroids["default"].mul_(-1)  # in place: the kept product must follow
        log_probs = torch.log_softmax(layer.router_scores("default", hidden, query_side=True), dim=-1)
        assert torch.equal(layer.query_probes("default", hidden, 1), log_probs.argmax(-1, keepdim=True))


@pytest.mark.parametrize("beams", [1, 3])
def test_dense_decoding_steps_generate_as_routed_ones(monkeypatch, beams):
    # The base model's step below dense_below (waiting tokens kept as a list, reordered by beam search with the cache)
    # gives the tokens that deferring each step's routing gives, for a left-padded batch.
    model = focus_model(top_k=2, query_projection=True, window=16, dense_below=40)
    focus_hf.set_routing(model, "hard", backend="sdpa")
    ids = torch.cat([torch.cat([torch.zeros(1, 7, dtype=torch.long), tokens(seq=23, seed=3)], 1), tokens(seq=30)])
    mask = torch.cat([torch.cat([torch.zeros(1, 7), torch.ones(1, 23)], 1), torch.ones(1, 30)]).long()
    options = dict(max_new_tokens=26, num_beams=beams, do_sample=False, pad_token_id=0, eos_token_id=None)
    dense_steps = []
    original = FocusLayer._dense_decoding_until

    def noting_until(self, adapter_name, mode, state, top_k):
        until = original(self, adapter_name, mode, state, top_k)
        dense_steps.append(state.seen < until)
        return until

    monkeypatch.setattr(FocusLayer, "_dense_decoding_until", noting_until)
    fast = model.generate(input_ids=ids, attention_mask=mask, **options)
    assert any(dense_steps) and not all(dense_steps)
    monkeypatch.setattr(FocusLayer, "_dense_decoding_until", lambda *a: 0)
    assert torch.equal(fast, model.generate(input_ids=ids, attention_mask=mask, **options))


def test_beam_search_with_deferred_key_routing_equals_without(monkeypatch):
    import focus_hf.tuner.cache_state as cache_state

    model = focus_model(top_k=2, query_projection=True)
    focus_hf.set_routing(model, "hard", backend="sdpa")
    options = dict(max_new_tokens=14, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    deferred = model.generate(input_ids=tokens(batch=2, seq=30), **options)
    monkeypatch.setattr(cache_state, "PENDING_LIMIT", 0)  # route every token at once
    assert torch.equal(deferred, model.generate(input_ids=tokens(batch=2, seq=30), **options))


def test_causal_with_query_router():
    model = focus_model(top_k=2, query_projection=True)
    for mode in ("hard", "soft"):
        focus_hf.set_routing(model, mode)
        ids = tokens(seq=48)
        changed = ids.clone()
        changed[:, 31:] = (changed[:, 31:] + 1) % VOCAB
        first, second = model(input_ids=ids).logits, model(input_ids=changed).logits
        torch.testing.assert_close(first[:, :31], second[:, :31], atol=ATOL, rtol=0)


def test_save_and_load_round_trip(tmp_path):
    model = focus_model(top_k=2, query_projection=True, dense_heads=[[1, 1]])
    focus_hf.set_routing(model, "hard")
    ids = tokens(seq=48)
    expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path).eval()
    assert loaded.peft_config["default"].query_projection is True
    assert loaded.peft_config["default"].dense_heads == [[1, 1]]
    focus_hf.set_routing(loaded, "hard")
    torch.testing.assert_close(loaded(input_ids=ids).logits, expected, atol=0, rtol=0)


def test_weights_with_a_query_router_need_the_option(tmp_path):
    model = focus_model(query_projection=True)
    model.save_pretrained(tmp_path)
    config = tmp_path / "adapter_config.json"
    config.write_text(config.read_text().replace('"query_projection": true', '"query_projection": false'))
    with pytest.raises(focus_hf.AdapterFileError, match="query_projection"):
        PeftModel.from_pretrained(tiny_model("llama"), tmp_path)


@pytest.mark.parametrize(
    "options, field",
    [
        (dict(dense_heads=[[0]]), "dense_heads"),
        (dict(dense_heads=[[0, -1]]), "dense_heads"),
        (dict(dense_heads="0,1"), "dense_heads"),
        (dict(query_projection="yes"), "query_projection"),
        (dict(dense_below=-1), "dense_below"),
        (dict(dense_below=2.5), "dense_below"),
        (dict(probe_mass=0.0), "probe_mass"),
        (dict(probe_mass=1.5), "probe_mass"),
        (dict(probe_mass=True), "probe_mass"),
        (dict(probe_mass="0.9"), "probe_mass"),
    ],
)
def test_bad_options_are_refused(options, field):
    with pytest.raises(focus_hf.FocusConfigError, match=field):
        focus_hf.FocusConfig(**options)


def test_dense_below_runs_short_queries_as_the_base_model():
    ids = tokens(batch=2, seq=40)
    base = tiny_model("llama")(ids).logits
    routed = focus_model(query_projection=True)
    focus_hf.set_routing(routed, "hard")
    sparse = routed(input_ids=ids).logits
    assert not torch.allclose(sparse, base, atol=1e-3)  # the pattern does remove pairs at this length
    for threshold in (41, 40, 25, 0):
        model = focus_model(query_projection=True, dense_below=threshold)
        focus_hf.set_routing(model, "hard")
        logits = model(input_ids=ids).logits
        # A query with fewer than `threshold` keys (itself included) is the base model's, whatever follows it.
        dense_rows = max(threshold - 1, 0)
        torch.testing.assert_close(logits[:, :dense_rows], base[:, :dense_rows], atol=ATOL, rtol=0)
        if threshold == 0:
            torch.testing.assert_close(logits, sparse, atol=ATOL, rtol=0)
        elif dense_rows < 40:
            assert not torch.allclose(logits[:, dense_rows:], base[:, dense_rows:], atol=1e-3)


@pytest.mark.parametrize("dense_heads", [None, [[0, 1]]])
def test_dense_below_chunked_prefill_of_a_padded_batch_equals_one_call(dense_heads):
    from transformers import DynamicCache

    model = focus_model(query_projection=True, dense_below=30, dense_heads=dense_heads)
    focus_hf.set_routing(model, "hard", backend="sdpa")
    ids = tokens(batch=2, seq=44, seed=9)
    mask = torch.ones(2, 44, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        cache = DynamicCache()
        parts = []
        for span in (slice(0, 25), slice(25, 44)):
            out = model(
                input_ids=ids[:, span],
                attention_mask=mask[:, : span.stop],
                position_ids=positions[:, span],
                past_key_values=cache,
                use_cache=True,
            )
            parts.append(out.logits)
    chunked = torch.cat(parts, dim=1)
    torch.testing.assert_close(chunked[mask.bool()], whole[mask.bool()], atol=ATOL, rtol=0)


def test_dense_below_without_a_cache_skips_routing(monkeypatch):
    ids = tokens(seq=40)
    model = focus_model(query_projection=True, dense_below=41)
    focus_hf.set_routing(model, "hard")
    calls = []
    original = FocusLayer.route_tokens
    monkeypatch.setattr(FocusLayer, "route_tokens", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    expected = tiny_model("llama")(ids).logits
    torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, expected, atol=ATOL, rtol=0)
    assert calls == []  # dense, nothing continues from it, nobody watches: not routed
    model(input_ids=ids, use_cache=True)
    assert len(calls) == 2  # a cache may grow past dense_below: both layers route
    with record_routing(model) as recorder:  # record_routing / focus-hf inspect still see the groups
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, expected, atol=ATOL, rtol=0)
    assert all(len(observed) == 1 for observed in recorder.routings().values())


def test_dense_below_is_per_query_during_generation():
    """A prompt below the threshold is encoded densely; decoding steps whose cache reaches it route."""
    prompt = tokens(seq=30)
    model = focus_model(top_k=1, query_projection=True, dense_below=36)
    focus_hf.set_routing(model, "hard")
    generated = model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    with model.disable_adapter():
        dense = model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    # The first five new tokens see fewer than 36 keys: exactly the base model's.
    assert torch.equal(generated[:, : 30 + 6], dense[:, : 30 + 6])


def test_configure_adapter_changes_run_time_options_and_saves_them(tmp_path):
    model = focus_model(query_projection=True)
    focus_hf.set_routing(model, "hard")
    ids = tokens(seq=48)
    config = focus_hf.configure_adapter(model, dense_heads=[[0, 0], [0, 1], [1, 0], [1, 1]], window=8)
    assert config.window == 8 and model.peft_config["default"] is config
    torch.testing.assert_close(model(input_ids=ids).logits, tiny_model("llama")(ids).logits, atol=ATOL, rtol=0)
    focus_hf.configure_adapter(model, dense_heads=None, dense_below=100, probe_mass=0.8)
    expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path).eval()
    assert loaded.peft_config["default"].dense_below == 100
    assert loaded.peft_config["default"].probe_mass == 0.8
    assert adapter_summary(tmp_path)["config"]["probe_mass"] == 0.8  # what `focus-hf info` and the model card show
    assert loaded.peft_config["default"].window == 8
    torch.testing.assert_close(loaded(input_ids=ids).logits, expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    "options, message",
    [(dict(num_groups=8), "num_groups"), (dict(window=-1), "window"), (dict(top_k=9), "top_k")],
)
def test_configure_adapter_refuses_and_changes_nothing(options, message):
    model = focus_model(query_projection=True)
    before = dict(vars(model.peft_config["default"]))
    settings = [dict(vars(layer.focus_settings["default"])) for layer in focus_hf.focus_layers(model)]
    with pytest.raises(focus_hf.FocusConfigError, match=message):
        focus_hf.configure_adapter(model, **options)
    assert dict(vars(model.peft_config["default"])) == before
    assert [dict(vars(layer.focus_settings["default"])) for layer in focus_hf.focus_layers(model)] == settings
