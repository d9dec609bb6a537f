"""How close dense attention runs to this machine's arithmetic ceiling, and what that leaves Focus.

The efficiency targets of the fast path compare Focus with a kernel "as fast per pair as dense SDPA's that computes
only the allowed pairs". How far that is from reach depends on where dense SDPA itself runs: this script measures
the machine's float32 matrix-multiply rate (a large square GEMM, the best case of the BLAS torch links) and, in the
same process, the rate of dense causal SDPA and of the call shapes Focus's prefill is made of (short causal calls of
one group's queries, the local part's blocks of 32 queries over 160 keys under a mask), each as GFLOP/s of useful
work (4 * head_dim flops per visible query-key pair and head: q.k and p.v) and as a fraction of the GEMM rate.

The last rows are torch's own CPU kernel alone (`native.torch_path`, what "auto" runs where the C kernels lose), the
ceiling of the sparse path on torch operations: a causal square beside the unmasked square of the same keys (where
the two cost the same, the kernel computed the hidden half too), and unmasked calls of few and of many query rows
(each kv head's query heads folded into the rows, as `partials.folded_attention` calls it).

    python benchmarks/cpu/arithmetic_ceiling.py --json benchmarks/results/arithmetic_ceiling.json

Rows: call, shape, ms (median of --repeats), useful GFLOP/s, fraction of the GEMM rate, ns per useful pair and head,
processor, threads, load average.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import focus_hf
from focus_hf.attention.backends import cpu_kernel
from focus_hf.attention.cpu.native import torch_path
from focus_hf.attention.cpu.partials import LOCAL_BLOCK
from focus_hf.benchmarking.records import log, machine_fields, script_command, write_json

HEADS, KV_HEADS, DIM = 9, 3, 64  # the attention bench's shape (SmolLM2's)


def median_seconds(function: Callable[[], object], repeats: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def token_major(length: int, heads: int, generator: torch.Generator) -> torch.Tensor:
    """[1, heads, length, DIM] laid out as a model projects it (token-major, transposed)."""
    return torch.randn(1, length, heads, DIM, generator=generator).transpose(1, 2)


def causal_call(length: int, generator: torch.Generator) -> tuple[Callable[[], object], float]:
    """Dense causal SDPA over `length` tokens (GQA; torch's own kernel, as the model's dense layers call it), and its
    visible pairs x heads."""
    query, key, value = (token_major(length, h, generator) for h in (HEADS, KV_HEADS, KV_HEADS))
    return (
        lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True),
        HEADS * length * (length + 1) / 2,
    )


def torch_kernel_call(
    rows: int, keys: int, heads: int, causal: bool, generator: torch.Generator
) -> tuple[Callable[[], object], float]:
    """torch's CPU kernel alone (never the C kernels): `rows` queries of `heads` query heads over `keys` keys of
    KV_HEADS kv heads, causal or unmasked, and its visible pairs x heads."""
    query = token_major(rows, heads, generator)
    key, value = (token_major(keys, KV_HEADS, generator) for _ in range(2))

    def call() -> object:
        with torch_path():
            return cpu_kernel(query, key, value, causal=causal, bias=None, scale=DIM**-0.5)

    return call, heads * (rows * (rows + 1) / 2 if causal else rows * keys)


def local_blocks(
    tokens: int, window: int, block: int, generator: torch.Generator
) -> tuple[Callable[[], object], float]:
    """The local part's call shape: blocks of `block` queries over the `window` keys before them and their own,
    masked to the band (as `partials.local_part` calls the kernel), and its useful pairs x heads."""
    blocks, size = tokens // block, block + window
    query = torch.randn(blocks, block, HEADS, DIM, generator=generator).transpose(1, 2)
    key, value = (torch.randn(blocks, size, KV_HEADS, DIM, generator=generator).transpose(1, 2) for _ in range(2))
    offset = torch.arange(block)[:, None] - torch.arange(size) + window
    band = (offset >= 0) & (offset <= window)
    bias = torch.zeros(1, 1, block, size).masked_fill(~band, torch.finfo(torch.float32).min)
    return (
        lambda: cpu_kernel(query, key, value, causal=False, bias=bias, scale=DIM**-0.5),
        HEADS * blocks * float(band.sum()),
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)

    size = 2048
    left, right = (torch.randn(size, size, generator=generator) for _ in range(2))
    gemm_seconds = median_seconds(lambda: left @ right, args.repeats)
    gemm_rate = 2 * size**3 / gemm_seconds / 1e9
    log(f"float32 GEMM {size}^3: {gemm_rate:.0f} GFLOP/s")
    rows = [
        {
            "call": "float32 GEMM (the ceiling)",
            "shape": f"{size} x {size} @ {size} x {size}",
            "ms": round(gemm_seconds * 1e3, 3),
            "gflops": round(gemm_rate, 1),
            "fraction_of_gemm": 1.0,
            "ns_per_pair_head": None,
        }
    ]
    cases = [
        (f"dense causal SDPA, {n:,} tokens", f"{HEADS}x{DIM} heads / {KV_HEADS} kv", *causal_call(n, generator))
        for n in (256, 512, 1024, 4096, 16384)
    ]
    window = 128  # the attention bench's
    cases.append(
        (
            "local part, 4,096 queries",
            f"blocks of {LOCAL_BLOCK} queries x {LOCAL_BLOCK + window} keys, band mask",
            *local_blocks(4096, window, LOCAL_BLOCK, generator),
        )
    )
    for length in (256, 512, 1024):
        for causal in (True, False):
            cases.append(
                (
                    f"torch kernel, {'causal' if causal else 'unmasked'} square, {length:,} keys",
                    f"{HEADS}x{DIM} heads / {KV_HEADS} kv",
                    *torch_kernel_call(length, length, HEADS, causal, generator),
                )
            )
    for folded_rows in (192, 768):
        cases.append(
            (
                f"torch kernel, unmasked, {folded_rows} folded rows x 1,024 keys",
                f"{KV_HEADS}x{DIM} heads / {KV_HEADS} kv",
                *torch_kernel_call(folded_rows, 1024, KV_HEADS, False, generator),
            )
        )
    for name, shape, call, pair_heads in cases:
        # Calls of a billion pairs and heads or more (16K tokens: ~2 s each) are timed twice.
        seconds = median_seconds(call, args.repeats if pair_heads < 1e9 else 2)
        rate = 4 * DIM * pair_heads / seconds / 1e9
        rows.append(
            {
                "call": name,
                "shape": shape,
                "ms": round(seconds * 1e3, 3),
                "gflops": round(rate, 1),
                "fraction_of_gemm": round(rate / gemm_rate, 3),
                "ns_per_pair_head": round(seconds / pair_heads * 1e9, 3),
            }
        )
        log(
            f"{name}: {rate:.0f} GFLOP/s ({rate / gemm_rate:.0%} of GEMM), {seconds / pair_heads * 1e9:.2f} "
            "ns/pair-head"
        )
    for row in rows:
        row.update(
            machine_fields(torch.device("cpu")),
            command=script_command(__file__, argv),
            focus_hf=focus_hf.__version__,
        )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
