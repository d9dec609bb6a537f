"""Threads that call one model at once: each gets the tokens it gets alone (a web server's thread pool does this).

Everything that belongs to one call - the routing handed to the attention function, routing states, runs of decoding
steps, group-sorted key copies - lives in that call's arguments or on its cache; what a layer keeps (router weights
worked out once) is read by every thread."""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Optional

import pytest
import torch
from peft import get_peft_model
from tiny_models import COMMON, VOCAB
from transformers import AutoModelForCausalLM, LlamaConfig

import focus_hf
from focus_hf.attention.cpu import native

# The shape of the report this test keeps: prompts of mixed lengths, one thread each, several rounds.
PROMPT_LENGTHS = (300, 517, 800, 1200)


@pytest.fixture(autouse=True)
def _one_torch_thread_per_caller():
    """One torch thread per calling thread, as a server with a thread pool would set: several threads each running
    torch's intra-op pool over the same cores only wait for one another."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def llama(**focus: object) -> torch.nn.Module:
    """A random 2-layer Llama, hidden 64, with a Focus adapter (K 4, window 16; `focus` overrides), hard routing on
    the sparse path whatever the length ("sdpa": the C kernels on the CPU, or torch operations in `torch_path`)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        **{**COMMON, "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 2048},
        num_key_value_heads=2,
    )
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    options = dict(num_groups=4, window=16, dense_below=32, sink_tokens=2)
    options.update(focus)
    model = get_peft_model(base, focus_hf.FocusConfig(**options)).eval()
    focus_hf.set_routing(model, "hard", backend="sdpa")
    return model


def prompts(lengths: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (1, length), generator=generator) for length in lengths]


def generated(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, **options: object) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **options
        )
    return output[0, prompt.shape[1] :].tolist()


def in_threads(calls: list[Callable[[], object]], wrap: Callable[[], contextlib.AbstractContextManager]) -> list:
    """Run each call in a thread of its own, started together (a barrier); the results, or the exceptions raised."""
    results: list = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def work(index: int) -> None:
        barrier.wait()
        try:
            with wrap():
                results[index] = calls[index]()
        except Exception as error:  # reported as a result: the test compares it with the tokens wanted
            results[index] = error

    threads = [threading.Thread(target=work, args=(index,)) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def assert_threads_get_their_own(
    model: torch.nn.Module,
    lengths: tuple[int, ...],
    new_tokens: int,
    rounds: int,
    wrap: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    **options: object,
) -> None:
    samples = prompts(lengths)
    with wrap():
        alone = [generated(model, prompt, new_tokens, **options) for prompt in samples]
    for round_number in range(rounds):
        together = in_threads([lambda p=p: generated(model, p, new_tokens, **options) for p in samples], wrap)
        for length, want, got in zip(lengths, alone, together):
            assert got == want, f"round {round_number}, prompt of {length} tokens: {got!r} alone {want!r}"


def test_threads_on_one_model_get_their_own_tokens():
    """Prompts of 300 / 517 / 800 / 1,200 tokens, 24 greedy tokens, three rounds - routed decoding beyond
    dense_below=32, in the C kernels."""
    if native.native_kernels() is None:
        pytest.fail("the C kernels must build on this machine (cc on the PATH)")
    assert_threads_get_their_own(llama(), PROMPT_LENGTHS, new_tokens=24, rounds=3)


def test_threads_on_the_torch_path_get_their_own_tokens():
    assert_threads_get_their_own(llama(), (300, 517, 800), new_tokens=12, rounds=2, wrap=native.torch_path)


@pytest.mark.parametrize(
    "focus",
    [
        pytest.param(dict(dense_below=4096), id="dense"),  # every step the base model's (runs of dense steps)
        pytest.param(dict(dense_below=300), id="mixed"),  # two prompts decode dense, two routed
        pytest.param(dict(query_projection=True), id="query-router"),  # routed runs: steps whose key side waits
        pytest.param(dict(top_k=2, dense_heads=[[1, 0]]), id="top2-dense-head"),
    ],
)
def test_threads_get_their_own_tokens_dense_routed_and_mixed(focus):
    assert_threads_get_their_own(llama(**focus), (100, 250, 400, 550), new_tokens=12, rounds=2)


def test_threads_get_their_own_beams():
    assert_threads_get_their_own(llama(query_projection=True), (150, 300, 420), new_tokens=8, rounds=2, num_beams=2)


def test_threads_with_padded_batches_get_their_own_tokens():
    """Batches with left padding in every thread: the padding of one never reaches another's routing."""
    model = llama()
    generator = torch.Generator().manual_seed(5)
    batches = []
    for length in (200, 330, 470):
        ids = torch.randint(3, VOCAB, (2, length), generator=generator)
        mask = torch.ones_like(ids)
        mask[0, : length // 3] = 0
        batches.append((ids, mask))

    def run(batch: tuple[torch.Tensor, torch.Tensor]) -> list:
        with torch.no_grad():
            ids, mask = batch
            return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0).tolist()

    alone = [run(batch) for batch in batches]
    for _ in range(2):
        assert in_threads([lambda b=b: run(b) for b in batches], contextlib.nullcontext) == alone


def test_threads_under_inference_mode_share_the_kept_router_weights():
    """Routers loaded and run under torch.inference_mode (no version counters) from several threads at once."""
    model: Optional[torch.nn.Module] = None
    with torch.inference_mode():
        model = llama(query_projection=True)
    assert_threads_get_their_own(model, (150, 300, 517), new_tokens=10, rounds=2, wrap=torch.inference_mode)
