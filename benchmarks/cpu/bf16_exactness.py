"""How exact Focus is in bfloat16 on the CPU: its output against a float64 reference of the same pattern on the same
bfloat16 inputs, beside what bfloat16 itself costs.

The inputs and routing are `focus-hf bench`'s (one attention layer, 9 / 3 heads, head dim 64, K=8, window 128, 4
sinks). For each length and top-k, rows give the largest and the root-mean-square error against the float64
reference (`hard.reference_hard_attention` on the inputs widened to float64) of

- Focus's sparse path and its dense masked call (`auto` below the crossover) in bfloat16 (the C kernels' bfloat16
  products where the processor has them, float32 sums), and the sparse path in float32 on the same values;
- the reference itself rounded to bfloat16: the error every bfloat16 output carries at least;
- torch's dense causal SDPA in bfloat16 against its own float64 reference (plain causal attention, same inputs),
  and that reference rounded to bfloat16: what a bfloat16 model's attention carries today, and its floor.

    python benchmarks/cpu/bf16_exactness.py --json benchmarks/results/attention_cpu_bf16_exactness.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from focus_hf.attention.hard import hard_attention
from focus_hf.attention.pattern import FocusPattern
from focus_hf.attention.reference import reference_hard_attention
from focus_hf.benchmarking.layer import Case, layer_fields, make_case
from focus_hf.benchmarking.records import log, machine_fields, script_command, write_json


def errors(output: torch.Tensor, reference: torch.Tensor) -> dict:
    """Largest and root-mean-square absolute error, and the reference's root-mean-square (their scale)."""
    difference = output.double() - reference
    return {
        "max_abs": float(difference.abs().max()),
        "rms": float(difference.square().mean().sqrt()),
        "reference_rms": float(reference.square().mean().sqrt()),
    }


def focus(case: Case, args: argparse.Namespace, top_k: int, backend: str, path: Optional[str]) -> torch.Tensor:
    routing = case.routing[top_k]
    groups = (routing.top_groups, routing.key_groups, routing.sink)
    pattern = FocusPattern(*groups, args.groups, args.window, own_group=True)
    return hard_attention(
        case.query,
        case.key,
        case.value,
        pattern,
        scaling=args.head_dim**-0.5,
        backend=backend,
        path=path,
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", type=Path, default=None)
    options = parser.parse_args(argv)
    # `focus-hf bench`'s shape and routing (make_case reads these)
    args = argparse.Namespace(
        seed=0, heads=9, kv_heads=3, head_dim=64, groups=8, window=128, sinks=4, query_router=False, top_k=options.top_k
    )
    rows: list[dict] = []
    device = torch.device("cpu")
    with torch.inference_mode():
        for seq_len in options.seq_lens:
            case = make_case(args, seq_len, device, torch.bfloat16)
            wide = Case(case.query.double(), case.key.double(), case.value.double(), case.routing)
            widened = Case(case.query.float(), case.key.float(), case.value.float(), case.routing)
            dense = F.scaled_dot_product_attention(case.query, case.key, case.value, is_causal=True, enable_gqa=True)
            dense_reference = F.scaled_dot_product_attention(
                wide.query, wide.key, wide.value, is_causal=True, enable_gqa=True
            )
            dense_errors = errors(dense, dense_reference)
            dense_rounding = errors(dense_reference.bfloat16(), dense_reference)
            del dense, dense_reference
            for top_k in options.top_k:
                routing = case.routing[top_k]
                reference = reference_hard_attention(
                    wide.query, wide.key, wide.value, None, routing.top_groups, routing.key_groups, routing.sink,
                    args.window, args.head_dim**-0.5,
                )  # fmt: skip
                row = {
                    "seq_len": seq_len,
                    "top_k": top_k,
                    "focus_sparse_bf16": errors(focus(case, args, top_k, "sdpa", None), reference),
                    "focus_dense_masked_bf16": errors(focus(case, args, top_k, "auto", "cpu-masked"), reference),
                    "focus_sparse_float32": errors(focus(widened, args, top_k, "sdpa", None), reference),
                    "reference_rounded_to_bf16": errors(reference.bfloat16(), reference),
                    "dense_sdpa_bf16_causal": dense_errors,
                    "dense_reference_rounded_to_bf16": dense_rounding,
                    **layer_fields(args),
                    **machine_fields(device),
                    "command": script_command(__file__, argv),
                }
                rows.append(row)
                write_json(options.json, rows)
                shown = ("focus_sparse_bf16", "focus_dense_masked_bf16", "reference_rounded_to_bf16")
                figures = ", ".join(f"{name} {row[name]['max_abs']:.2e} / {row[name]['rms']:.2e}" for name in shown)
                log(
                    f"{seq_len} top-{top_k}, max / rms error: {figures}; dense bf16 SDPA {dense_errors['max_abs']:.2e}"
                    f" / {dense_errors['rms']:.2e}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
