"""`DecodingRun`: a run of decoding steps taking one branch of `FocusLayer.forward` (dense below `dense_below`, or
routed with the query router's probes) decided once, then checked in a few comparisons per step. It must decode and
route exactly as deciding every step would, end wherever anything it assumed changes, and hold no cache."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from peft import get_peft_model
from tiny_models import VOCAB, tiny_model
from transformers import DynamicCache

import focus_hf
from focus_hf.errors import FocusRuntimeError
from focus_hf.tuner.layer import DecodingRun, FocusLayer


def focus_model(**options):
    config = dict(num_groups=4, group_dim=8, window=16, top_k=1, sink_tokens=2, dense_below=40)
    config.update(options)
    model = get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(**config)).eval()
    focus_hf.set_routing(model, "hard", backend="sdpa")
    return model


def tokens(batch=1, seq=30, seed=1):
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def counted_runs(monkeypatch):
    """How many steps each kind took: "run" (a run's later step; "routed" of them those of routed runs) and
    "decided" (the full decision ran)."""
    counts = {"run": 0, "routed": 0, "decided": 0}
    next_state, decide = DecodingRun.next_state, FocusLayer._dense_decoding_until

    def counting_next_state(self, *args):
        state = next_state(self, *args)
        counts["run"] += state is not None
        counts["routed"] += state is not None and self.top_k is not None
        return state

    def counting_decide(self, *args):
        counts["decided"] += 1
        return decide(self, *args)

    monkeypatch.setattr(DecodingRun, "next_state", counting_next_state)
    monkeypatch.setattr(FocusLayer, "_dense_decoding_until", counting_decide)
    return counts


def decode(model, prompt, steps, cache=None):
    """Greedy steps after `prompt` on `cache` (a new DynamicCache by default): the tokens and the cache."""
    cache = DynamicCache() if cache is None else cache
    with torch.no_grad():
        token = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        generated = [token]
        for _ in range(steps - 1):
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            generated.append(token)
    return torch.cat(generated, 1), cache


def routing_states(cache):
    return {key: state for key, state in cache._focus_routing_states.items()}


def grouped_fill(cache):
    """How many positions each group-sorted copy on `cache` has taken in, by layer and run of kv heads."""
    stores = getattr(cache, "_focus_grouped_keys", {})
    return {
        (key, heads): [copy.filled for copy in copies]
        for key, store in stores.items()
        for heads, copies in store.items()
    }


def assert_same_states(first, second):
    assert first.keys() == second.keys()
    for key in first:
        a, b = first[key], second[key]
        assert a.seen == b.seen and a.pending == b.pending and len(a.noted_steps or ()) == len(b.noted_steps or ())
        for name in ("valid_count", "column_lse", "key_probs", "key_groups", "key_sink"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (key, name)
        if a.noted_steps is not None:
            for x, y in zip(a.noted_steps.inputs(), b.noted_steps.inputs()):
                assert torch.equal(x, y), key


@pytest.mark.parametrize("query_projection", [False, True])
@pytest.mark.parametrize("pending_limit", [4, 64])
@pytest.mark.parametrize("dense_below", [40, 0])
def test_a_run_decodes_and_routes_as_deciding_every_step(
    monkeypatch, counted_runs, query_projection, pending_limit, dense_below
):
    # From a 30-token prompt past dense_below (40 keys; 0: routed from the first step) and, with a limit of 4,
    # through full blocks settled on the way: the tokens and every layer's routing state equal those of steps that
    # each make the whole decision. Routed steps run as runs with a query router only (without one, each settles).
    import focus_hf.tuner.cache_state as cache_state

    monkeypatch.setattr(cache_state, "PENDING_LIMIT", pending_limit)
    model = focus_model(query_projection=query_projection, dense_below=dense_below)
    with_runs, cache = decode(model, tokens(), 20)
    assert (counted_runs["run"] > 0) == (dense_below > 0 or query_projection)
    assert (counted_runs["routed"] > 0) == query_projection
    monkeypatch.setattr(DecodingRun, "next_state", lambda *args: None)
    deciding, deciding_cache = decode(model, tokens(), 20)
    assert torch.equal(with_runs, deciding)
    assert_same_states(routing_states(cache), routing_states(deciding_cache))
    # A routed run's steps read the group-sorted copies as a decided step would, keeping them as far along.
    assert grouped_fill(cache) == grouped_fill(deciding_cache) and (grouped_fill(cache) or not query_projection)


@pytest.mark.parametrize("beams", [1, 3])
def test_generate_with_runs_equals_generate_deciding_every_step(monkeypatch, counted_runs, beams):
    # Beam search reorders the cache, and the routing states on it, at every step: a run reads the state afresh.
    model = focus_model(top_k=2, query_projection=True)
    options = dict(max_new_tokens=20, num_beams=beams, do_sample=False, pad_token_id=0, eos_token_id=None)
    with_runs = model.generate(input_ids=tokens(batch=2), **options)
    assert counted_runs["run"] > 0
    monkeypatch.setattr(DecodingRun, "next_state", lambda *args: None)
    assert torch.equal(with_runs, model.generate(input_ids=tokens(batch=2), **options))


def test_two_caches_decoded_in_turn_each_keep_their_run_and_decode_as_alone(counted_runs):
    model = focus_model()
    alone = [decode(model, tokens(seed=seed), 8)[0] for seed in (1, 2)]
    caches = [DynamicCache(), DynamicCache()]
    with torch.no_grad():
        last = [
            model(input_ids=tokens(seed=seed), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for seed, cache in zip((1, 2), caches)
        ]
        generated = [[token] for token in last]
        taken = counted_runs["run"]
        for _ in range(7):
            for which, cache in enumerate(caches):
                logits = model(input_ids=generated[which][-1], past_key_values=cache, use_cache=True).logits
                generated[which].append(logits[:, -1:].argmax(-1))
    # The runs ride on the caches: after each cache's first step (decided), every later step of each continues its
    # run in every layer, although the other cache's steps come between.
    layers = len(focus_hf.focus_layers(model))
    assert counted_runs["run"] - taken == 2 * 6 * layers
    for which in (0, 1):
        assert torch.equal(torch.cat(generated[which], 1), alone[which])


@pytest.mark.parametrize("dense_below", [40, 0])
def test_a_change_of_options_or_mode_ends_the_run(counted_runs, dense_below):
    model = focus_model(num_groups=4, top_k=1, query_projection=True, dense_below=dense_below)
    _, cache = decode(model, tokens(), 4)
    # One option at a time (set_routing resets the top-k and backend it is not given).
    for change in (
        lambda: focus_hf.set_routing(model, "hard", backend="auto"),
        lambda: focus_hf.set_routing(model, "hard", top_k=2),
        lambda: focus_hf.set_routing(model, "hard", top_k=2, decode_copy=False),
        lambda: model.train(),
        lambda: focus_hf.configure_adapter(model, dense_below=64),
    ):
        change()
        decided = counted_runs["decided"]
        with torch.no_grad():
            model(input_ids=tokens(seq=1, seed=9), past_key_values=cache, use_cache=True)
        layers = len(focus_hf.focus_layers(model))
        assert counted_runs["decided"] == decided + layers, "a changed option must be decided afresh"


def test_a_cropped_or_bypassed_cache_is_still_refused(counted_runs):
    model = focus_model()
    _, cache = decode(model, tokens(), 4)
    cache.crop(-2)
    with pytest.raises(FocusRuntimeError, match="cropped"), torch.no_grad():
        model(input_ids=tokens(seq=1), past_key_values=cache, use_cache=True)

    _, cache = decode(model, tokens(), 4)
    with model.disable_adapter(), torch.no_grad():  # a step the routers never see
        model(input_ids=tokens(seq=1), past_key_values=cache, use_cache=True)
    with pytest.raises(FocusRuntimeError, match="filled without this adapter"), torch.no_grad():
        model(input_ids=tokens(seq=1), past_key_values=cache, use_cache=True)


def test_a_finished_generations_cache_is_freed(counted_runs):
    model = focus_model()
    _, cache = decode(model, tokens(), 6)
    assert counted_runs["run"] > 0
    finished = weakref.ref(cache)
    del cache
    gc.collect()
    assert finished() is None
