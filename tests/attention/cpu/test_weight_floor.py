"""The prefill kernel's softmax weights have a floor: a key whose weight is below 2^-125 of its row's largest weighs 0.

The kernel's power of two (`fexp2` in prefill.c) never makes a subnormal float: it clamps its argument at -125 and
zeroes the lanes below. A subnormal result costs a microcode assist of a hundred cycles and more on Intel processors
whose thread does not flush them to zero (a caller's thread need not), and hidden pairs (score -FLT_MAX) are a large
share of a local call's: their weights, underflowing, made those pairs four times dearer than the own-group pass's on a
Xeon. So the kernel drops weights below the floor, as a thread that flushes subnormals would, and the result is the same
whatever the calling thread's flush mode. The floor is far below what a float32 sum can tell from 0, except against a
value near float32's largest, which this test uses to see it.
"""

from __future__ import annotations

import math

import pytest
import torch

from focus_hf.attention.cpu import native, native_prefill

needs_kernel = pytest.mark.skipif(native.native_kernels() is None, reason="no C compiler to build the kernel with")
HUGE = 1e38  # the far key's value: a weight of 2^-130 times it is 0.07, well above float32's resolution of 1


def _two_keys(log2_weight: float, dim: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One query over two keys: key 0 scores 0 (value 1 in dim 0), key 1 scores so that its weight is
    2^log2_weight of key 0's (value HUGE in dim 0)."""
    query = torch.zeros(1, 1, 1, dim)
    query[..., 0] = 1.0
    key = torch.zeros(1, 1, 2, dim)
    key[0, 0, 1, 0] = log2_weight / math.log2(math.e)
    value = torch.zeros(1, 1, 2, dim)
    value[0, 0, 0, 0], value[0, 0, 1, 0] = 1.0, HUGE
    return query, key, value


@needs_kernel
@pytest.mark.parametrize("flush", [False, True])
@pytest.mark.parametrize("log2_weight", [-130.0, -200.0, -100.0, -60.0])
def test_weights_below_the_floor_are_zero_and_above_it_count(log2_weight, flush):
    query, key, value = _two_keys(log2_weight)
    torch.set_flush_denormal(flush)  # the calling thread's mode (torch's default is not to flush)
    try:
        result = native_prefill.prefill_attention(query, key, value, causal=False, scale=1.0)
    finally:
        torch.set_flush_denormal(False)
    assert result is not None
    output = float(result[0][0, 0, 0, 0])
    weight = 2.0**log2_weight
    if log2_weight < -125:
        assert output == 1.0, f"a weight of 2^{log2_weight:g} counted: {output}"
    else:  # the float64 answer, to the kernel's few-ulp power of two
        expected = (1.0 + weight * HUGE) / (1.0 + weight)
        assert output == pytest.approx(expected, rel=1e-5)
