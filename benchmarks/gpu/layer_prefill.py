"""GPU benchmark: one attention layer's prefill, dense SDPA against Focus hard mode, up to 1M tokens.

A one-layer Llama-shaped model (hidden 2048, 32 query / 8 kv heads by default, head dim 64, a tiny MLP and
vocabulary so that attention dominates) in bf16 runs a prefill of N tokens: dense with `attn_implementation`
flash_attention_2 (when flash-attn is installed) or sdpa (on CUDA inside torch's flash kernel when it takes the
inputs; the JSON says which kernel ran), and with a Focus adapter in hard mode (K groups, window, each --top-k) on
--backend (default `flash` with flash-attn, else `sdpa`). Per length, dense and every top-k are timed alternately
after a warm-up (Focus at the full length, so that kernels compiled per shape are compiled before timing; dense up to
64K tokens), each call between CUDA synchronisations; the best of the repeats is kept (2 repeats from 128K tokens
on). The peak GPU memory torch allocates during each call is recorded (torch.cuda.max_memory_allocated after a
reset).

`--one-piece-rows default 1048576` times every top-k once per setting of FOCUS_HF_GPU_ONE_PIECE_ROWS, set for each
Focus call in turn in this one process (the GPU path reads it per call, `focus_hf.attention.gpu.budget`): "default"
leaves it unset (pieces past 32768 query rows), a number of rows sets it (at least the length: one piece). Every row
says its setting (`one_piece_rows`) and whether its call ran in pieces (`in_pieces`), against the same dense calls.

    python benchmarks/gpu/layer_prefill.py --lengths 4096 16384 65536 262144 1048576 \\
        --out benchmarks/results/attention_gpu.json

The JSON (rewritten after every row, so that a run stopped part-way keeps its rows) records the device, package
versions, git commit, command and date. Needs CUDA; `--device cpu` runs the same code in float32 at short lengths
(to check the script; no peak memory there). Without CUDA and without `--device cpu` it exits with a message and
writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import sys
import time
from pathlib import Path

from focus_hf.attention.gpu import budget
from focus_hf.benchmarking.records import error_text, write_json

# Lengths from which the repeats drop to 2 (dense at 1M tokens takes ~11 s a call on an H100).
LONG = 131072
DEFAULT_SETTING = "default"  # --one-piece-rows: FOCUS_HF_GPU_ONE_PIECE_ROWS unset


def piece_setting(value: str) -> str:
    """A --one-piece-rows value: "default", or a whole number of query rows >= 0."""
    if value != DEFAULT_SETTING and not value.isdigit():
        raise argparse.ArgumentTypeError(f"takes {DEFAULT_SETTING!r} or a whole number of query rows, not {value!r}")
    return value


def in_pieces(tokens: int, setting: str) -> bool:
    """Whether the GPU path runs a prefill of `tokens` tokens (batch 1) in pieces under `setting`."""
    with one_piece_rows(setting):
        return tokens > budget.one_piece_rows()


@contextlib.contextmanager
def one_piece_rows(setting: str):
    """FOCUS_HF_GPU_ONE_PIECE_ROWS as `setting` says inside the block (unset for "default"), as it was after it."""
    before = os.environ.pop(budget.ONE_PIECE_ROWS_ENV, None)
    if setting != DEFAULT_SETTING:
        os.environ[budget.ONE_PIECE_ROWS_ENV] = setting
    try:
        yield
    finally:
        os.environ.pop(budget.ONE_PIECE_ROWS_ENV, None)
        if before is not None:
            os.environ[budget.ONE_PIECE_ROWS_ENV] = before


def timing_row(tokens: int, dense: list[tuple[float, int]], focus: list[tuple[float, int]]) -> dict:
    """One result row from repeated (seconds, peak bytes) measurements: best times, their ratio, peak memory (bytes;
    None where not measured) and its ratio."""
    dense_s, focus_s = min(t for t, _ in dense), min(t for t, _ in focus)
    dense_peak = max((m for _, m in dense if m is not None), default=None)
    focus_peak = max((m for _, m in focus if m is not None), default=None)
    return {
        "tokens": tokens,
        "dense_s": dense_s,
        "focus_s": focus_s,
        "speedup": dense_s / focus_s,
        "dense_peak_bytes": dense_peak,
        "focus_peak_bytes": focus_peak,
        "peak_ratio": focus_peak / dense_peak if dense_peak and focus_peak else None,
        "repeats": len(focus),
    }


def flash_context(device, probe):
    """(context for the dense calls, kernel name): on CUDA torch's flash SDPA kernel when `probe()` (a short dense
    call) runs inside it, else torch's own choice, named with the reason; on the CPU torch's choice."""
    if device.type != "cuda":
        return contextlib.nullcontext, "sdpa (torch's choice)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            probe()
    except RuntimeError as error:
        return contextlib.nullcontext, f"sdpa (torch's choice; the flash kernel refused: {error_text(error)})"
    return (lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)), "flash (torch SDPA)"


def layer_model(heads: int, kv_heads: int, groups: int, window: int, max_tokens: int, device, dtype, dense_impl: str):
    """The benchmark's one-layer Llama-shaped model (random weights, seed 0) with a Focus adapter (random routers):
    (peft model in eval mode, its LlamaConfig, its FocusConfig)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    import focus_hf

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=heads * 64,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=max_tokens + 1,
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation=dense_impl, dtype=dtype)
    focus_config = focus_hf.FocusConfig(num_groups=groups, window=window)
    model = get_peft_model(base.to(device).eval(), focus_config)
    return model.eval(), config, focus_config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536, 262144, 1048576])
    parser.add_argument("--heads", type=int, default=32, help="query heads (head dim 64, hidden heads x 64)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per length (2 from 128K tokens on)")
    parser.add_argument(
        "--backend",
        choices=("auto", "sdpa", "flash", "gpu-path", "reference"),
        help="Focus backend (default: flash or sdpa)",
    )
    parser.add_argument(
        "--one-piece-rows",
        type=piece_setting,
        nargs="+",
        default=[DEFAULT_SETTING],
        help="settings of FOCUS_HF_GPU_ONE_PIECE_ROWS to time every top-k with, in turn: 'default' (unset) or query "
        "rows",
    )
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default: bf16 on CUDA, else fp32")
    parser.add_argument("--out", default="benchmarks/results/attention_gpu.json")
    args = parser.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu/layer_prefill.py needs a CUDA GPU; none is available here, nothing was measured.")
        return 2
    import focus_hf
    from focus_hf.benchmarking.records import provenance

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    flash = cuda and importlib.util.find_spec("flash_attn") is not None
    dense_impl = "flash_attention_2" if flash else "sdpa"
    backend = args.backend or ("flash" if flash else "sdpa")
    hidden = args.heads * 64
    model, config, focus_config = layer_model(
        args.heads, args.kv_heads, args.groups, args.window, max(args.lengths), device, dtype, dense_impl
    )

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    def dense_forward(ids: torch.Tensor) -> None:
        with model.disable_adapter():
            model(input_ids=ids, use_cache=False)

    with torch.no_grad():
        dense_context, dense_kernel = flash_context(
            device, lambda: dense_forward(torch.zeros(1, 256, dtype=torch.long, device=device))
        )

    def run(n: int, top_k: int | None, setting: str = DEFAULT_SETTING) -> tuple[float, int | None]:
        """One prefill of n random tokens, dense (top_k None) or Focus under FOCUS_HF_GPU_ONE_PIECE_ROWS `setting`:
        (seconds, peak allocated bytes)."""
        ids = torch.randint(0, config.vocab_size, (1, n), device=device)
        if top_k is not None:
            focus_hf.set_routing(model, "hard", top_k=top_k, backend=backend)
        synchronize()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad(), dense_context() if top_k is None else one_piece_rows(setting):
            start = time.perf_counter()
            if top_k is None:
                dense_forward(ids)
            else:
                model(input_ids=ids, use_cache=False)
            synchronize()
            seconds = time.perf_counter() - start
        return seconds, torch.cuda.max_memory_allocated() if cuda else None

    out = Path(args.out)
    result = {
        **provenance(device, shlex.join(sys.orig_argv)),
        "benchmark": "one Llama-shaped attention layer, prefill: dense SDPA against Focus hard mode",
        "dense_attention": dense_impl,
        "dense_kernel": dense_kernel,
        "focus_backend": backend,
        "dtype": str(dtype).removeprefix("torch."),
        "layer": {
            "hidden": hidden,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": 64,
            "intermediate": 256,
            "vocab": 256,
        },
        "focus": {
            "num_groups": args.groups,
            "window": args.window,
            "sink_tokens": focus_config.sink_tokens,
            "routers": "random init (causal Sinkhorn balances the groups)",
        },
        "timing": "best of the repeats; dense and every top-k (and setting of FOCUS_HF_GPU_ONE_PIECE_ROWS) alternate "
        "within each repeat; CUDA synchronised before and after every call",
        "one_piece_rows_settings": args.one_piece_rows,
        "rows": [],
    }
    print(f"{result['device']}: dense {dense_impl} ({dense_kernel}), Focus backend {backend}", flush=True)
    from focus_hf.attention.hard import forget_fallbacks, path_record

    for n in args.lengths:
        forget_fallbacks()  # each row counts its own length's fallbacks: a row with any is not a Focus figure
        repeats = 2 if n >= LONG else args.repeats
        focus_calls = [(top_k, setting) for top_k in args.top_k for setting in args.one_piece_rows]
        times: dict[tuple | None, list[tuple[float, int | None]]] = {None: [], **{call: [] for call in focus_calls}}
        try:
            for call in focus_calls:  # warm-up at the full length: what is compiled per shape is compiled here
                run(n, *call)
            run(min(n, 65536), None)
            for _ in range(repeats):
                for call in times:
                    times[call].append(run(n, None) if call is None else run(n, *call))
        except Exception as error:  # noqa: BLE001 - one length failing must not lose the others
            for top_k, setting in focus_calls:
                row = {"tokens": n, "top_k": top_k, "one_piece_rows": setting, "in_pieces": in_pieces(n, setting)}
                row["error"] = error_text(error)
                result["rows"].append(row)
            print(json.dumps(result["rows"][-1]), flush=True)
            write_json(out, result)
            if cuda:
                torch.cuda.empty_cache()
            continue
        for top_k, setting in focus_calls:
            row = {**timing_row(n, times[None], times[top_k, setting]), "top_k": top_k}
            row.update(one_piece_rows=setting, in_pieces=in_pieces(n, setting), gpu_path=path_record())
            result["rows"].append(row)
            print(json.dumps(result["rows"][-1]), flush=True)
        write_json(out, result)
    write_json(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
