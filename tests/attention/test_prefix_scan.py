"""The chunked prefix scans routing runs off the CPU: equal to torch's own scans, values and gradients, at every
length around the chunk boundaries, and the routing they feed unchanged."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from focus_hf.attention import prefix_scan, routing
from focus_hf.attention.prefix_scan import CHUNK, sequence_cumsum, sequence_logcumsumexp

# One chunk, one past it, a ragged last chunk, and two levels of chunk totals.
LENGTHS = [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, CHUNK * CHUNK + 7]


@pytest.mark.parametrize("seq", LENGTHS)
def test_chunked_cumsum_equals_torch_cumsum(seq):
    generator = torch.Generator().manual_seed(seq)
    # Spread over many orders of magnitude, as exp(scores) is: a subtraction anywhere would show.
    values = torch.exp(torch.randn(2, seq, 8, generator=generator, dtype=torch.float64) * 20)
    expected = torch.cumsum(values, dim=1)
    actual = sequence_cumsum(values, chunked=True)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-13, atol=0)


@pytest.mark.parametrize("seq", LENGTHS)
def test_chunked_logcumsumexp_equals_torch_values_and_gradients(seq):
    generator = torch.Generator().manual_seed(seq)
    scores = (torch.randn(1, seq, 4, generator=generator, dtype=torch.float64) * 30).requires_grad_()
    weights = torch.rand(1, seq, 4, generator=generator, dtype=torch.float64)
    expected = torch.logcumsumexp(scores, dim=1)
    actual = sequence_logcumsumexp(scores, chunked=True)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), scores)
    (actual_grad,) = torch.autograd.grad((actual * weights).sum(), scores)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-10, atol=1e-12)


def test_the_cpu_runs_torch_own_scan_bit_for_bit():
    values = torch.rand(1, 3 * CHUNK + 1, 8, dtype=torch.float64)
    assert torch.equal(sequence_cumsum(values), torch.cumsum(values, dim=1))


def test_off_the_cpu_the_scan_goes_by_chunks(monkeypatch):
    """The device rule, read without a GPU: a tensor whose device is not the CPU takes the chunked scan."""
    calls = []
    real_scan = prefix_scan._scan

    def recording_scan(values, scan, combine, chunked):
        calls.append(chunked)
        return real_scan(values, scan, combine, chunked)

    monkeypatch.setattr(prefix_scan, "_scan", recording_scan)
    sequence_cumsum(torch.rand(1, 4, 2, device="meta"))
    sequence_cumsum(torch.rand(1, 4, 2))
    assert calls == [None, None]
    assert prefix_scan._chunked_by_default(torch.empty(0, device="meta"))
    assert not prefix_scan._chunked_by_default(torch.empty(0))


@settings(max_examples=15, deadline=None)
@given(seq=st.integers(CHUNK - 2, 3 * CHUNK), iterations=st.integers(1, 6), spread=st.sampled_from([1.0, 20.0, 700.0]))
@example(seq=277, iterations=5, spread=700.0)  # the largest difference over every seq of this range (CHUNK 128)
def test_sinkhorn_is_the_same_with_chunked_scans(monkeypatch_module, seq, iterations, spread):
    """Both of routing's iterations (probability space, and log space past its score limit) give the CPU's answer
    when their prefix scans go by chunks, as they do on a GPU."""
    generator = torch.Generator().manual_seed(seq * 31 + iterations)
    scores = torch.randn(2, seq, 8, generator=generator) * spread
    valid = torch.rand(2, seq, generator=generator) > 0.1
    expected = routing.causal_sinkhorn(scores, valid, iterations, token_columns=True)
    with monkeypatch_module.context() as patch:
        patch.setattr(routing, "sequence_cumsum", lambda values: sequence_cumsum(values, chunked=True))
        patch.setattr(routing, "sequence_logcumsumexp", lambda values: sequence_logcumsumexp(values, chunked=True))
        actual = routing.causal_sinkhorn(scores, valid, iterations, token_columns=True)
    for got, want in zip(actual, expected):
        # In log space (spread 700) the column sums reach thousands, where a float32 ulp is about 5e-4, and a small
        # value is a difference of two such: the scans' other order moves it by the operands' rounding (seq 277, five
        # iterations: 2.4e-4 on a value of 12.5, half an ulp of the largest).
        atol = max(1e-4, 2 * torch.finfo(want.dtype).eps * want.abs().max().item())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seq", [CHUNK + 1, 65536 + 3])
def test_on_cuda_the_chunked_scans_equal_the_cpu_scans(seq):
    """On the GPU, where the chunked scans run by default: the CPU's torch scans' answers, and routing's too."""
    generator = torch.Generator().manual_seed(seq)
    values = torch.exp(torch.randn(1, seq, 8, generator=generator, dtype=torch.float64) * 20)
    torch.testing.assert_close(sequence_cumsum(values.cuda()).cpu(), torch.cumsum(values, dim=1), rtol=1e-13, atol=0)
    scores = torch.randn(1, seq, 8, generator=generator) * 30
    torch.testing.assert_close(
        sequence_logcumsumexp(scores.cuda()).cpu(), torch.logcumsumexp(scores, dim=1), rtol=1e-5, atol=1e-4
    )
    valid = torch.ones(1, seq, dtype=torch.bool)
    expected = routing.causal_sinkhorn(scores / 5, valid, 5)
    actual = routing.causal_sinkhorn((scores / 5).cuda(), valid.cuda(), 5)
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
