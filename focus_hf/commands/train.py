"""`focus-hf train`: train the routers of a Focus adapter on a corpus and save the adapter folder."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from focus_hf.commands.common import (
    FOCUS_CONFIG_FIELDS,
    add_data_options,
    add_focus_options,
    add_model_option,
    focus_config_from_args,
    load_base,
    split_corpus,
    split_metadata,
)
from focus_hf.commands.options import add_option

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from focus_hf.tuner.config import FocusConfig


def resume_config(out: Path, config: FocusConfig) -> FocusConfig:
    """The config of the checkpoint a resumed run continues from (the command-line one when there is none)."""
    from transformers.trainer_utils import get_last_checkpoint

    from focus_hf.files import CHECKPOINTS_DIR
    from focus_hf.tuner.config import FocusConfig

    folder = out / CHECKPOINTS_DIR
    last = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    if last is None:
        return config
    saved = FocusConfig.from_pretrained(last)
    changed = [
        f"{name}={getattr(config, name)} (checkpoint: {getattr(saved, name)})"
        for name in FOCUS_CONFIG_FIELDS
        if getattr(config, name) != getattr(saved, name)
    ]
    if changed:
        logger.warning("Resuming from %s with its adapter config; ignoring the options %s.", last, ", ".join(changed))
    saved.inference_mode = False
    return saved


OBJECTIVE_DEFAULTS = {
    "distill": {"steps": 100, "seq_len": 4096, "lr": 0.01, "sequences": 4, "query_projection": True},
    "lm": {"steps": 200, "seq_len": 512, "lr": 5e-3, "sequences": None, "query_projection": False},
}


def train(args: argparse.Namespace) -> dict:
    """Run the training the parsed `args` describe; returns the training log."""
    objective = getattr(args, "objective", "lm")
    for name, value in OBJECTIVE_DEFAULTS[objective].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if objective == "distill":
        return distill(args)
    if getattr(args, "device", None) or getattr(args, "dtype", None):
        raise SystemExit(
            "--device and --dtype apply to --objective distill; the lm objective runs where transformers' Trainer "
            "places the model (the GPU when there is one)."
        )
    import dataclasses

    import torch
    from peft import get_peft_model

    from focus_hf.data import token_blocks
    from focus_hf.fitting.trainer import remove_checkpoints, train_adapter

    out = Path(args.out)
    torch.manual_seed(args.seed)
    model, tokenizer = load_base(args.model)
    config = dataclasses.replace(focus_config_from_args(args), query_projection=args.query_projection)
    if args.resume:
        config = resume_config(out, config)
    model = get_peft_model(model, config)
    train_texts, heldout_texts = split_corpus(args)
    blocks = token_blocks(tokenizer, train_texts, args.seq_len, max_blocks=args.sequences)
    balance = token_blocks(tokenizer, heldout_texts, args.seq_len, max_blocks=1) if args.balance_check else None
    log = train_adapter(
        model,
        blocks,
        out,
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
        save_steps=args.save_steps,
        logging_steps=args.logging_steps,
        resume=args.resume,
        dominance_threshold=args.dominance_threshold,
        balance_blocks=balance,
        base_model_name_or_path=args.model,
        progress_bar=not args.no_progress,
        extra_metadata={
            **split_metadata(args.data, args.heldout_fraction, args.split_seed),
            "train_documents": len(train_texts),
            "heldout_documents": len(heldout_texts),
            "command": "focus-hf train",
        },
    )
    if args.clean_checkpoints and log:  # an empty log: not the main process
        remove_checkpoints(out)
    return log


def distill(args: argparse.Namespace) -> dict:
    """`--objective distill`: fit every router to the base model's own attention, layer by layer."""
    import dataclasses

    import torch
    from peft import get_peft_model

    from focus_hf.data import retrieval_documents, token_blocks
    from focus_hf.fitting.dense_heads import calibrate_full_attention
    from focus_hf.fitting.distill import DistillSettings, distill_routers, save_distilled_adapter
    from focus_hf.fitting.layerwise import distill_routers_layerwise
    from focus_hf.fitting.parallel import is_main_process, start_process_group
    from focus_hf.tuner.controls import configure_adapter

    start_process_group()  # under torchrun / accelerate launch each process distils on its share of the sequences
    out = Path(args.out)
    torch.manual_seed(args.seed)
    model, tokenizer = load_base(args.model)
    device, dtype = getattr(args, "device", None), getattr(args, "dtype", None)
    if device or dtype:  # before the adapter: the routers are created where the base runs, in float32
        model.to(**({"device": device} if device else {}), **({"dtype": getattr(torch, dtype)} if dtype else {}))
    config = dataclasses.replace(focus_config_from_args(args), query_projection=args.query_projection)
    model = get_peft_model(model, config)
    model.eval()
    train_texts, heldout_texts = split_corpus(args)
    sequences = list(token_blocks(tokenizer, train_texts, args.seq_len, max_blocks=args.sequences))
    sequences += retrieval_documents(tokenizer, train_texts, args.seq_len, args.retrieval_documents, seed=args.seed)
    settings = DistillSettings(
        steps=args.steps,
        lr=args.lr,
        top_m=args.top_m,
        queries_per_sequence=args.queries_per_sequence,
        balance_weight=args.balance_weight,
        seed=args.seed,
    )
    checkpoints = out / "checkpoints"
    if checkpoints.exists() and not args.resume:
        raise SystemExit(f"{checkpoints} holds an earlier run: pass --resume to continue it, or remove it.")
    fit = distill_routers_layerwise if args.layerwise else distill_routers
    results = fit(model, sequences, settings, checkpoint_dir=checkpoints, progress=not args.no_progress)
    calibration = calibrate_full_attention(
        model,
        tokenizer,
        train_texts,
        args.seq_len,
        mass_heads=args.dense_heads,
        retrieval_heads=args.retrieval_heads,
        seed=args.seed + 1,  # not the seed of the training documents
        progress=not args.no_progress and is_main_process(),
    )
    configure_adapter(model, dense_below=args.dense_below)
    if not is_main_process():
        return {}  # every process holds the same adapter; the main one saves and reports
    log = save_distilled_adapter(
        model,
        out,
        results,
        settings,
        base_model_name_or_path=args.model,
        metadata={
            **split_metadata(args.data, args.heldout_fraction, args.split_seed),
            "seq_len": args.seq_len,
            "sequences": args.sequences,
            "retrieval_documents": args.retrieval_documents,
            "full_attention_calibration": calibration.to_dict(),
            "device": str(next(model.parameters()).device),
            "base_dtype": str(model.get_base_model().dtype).removeprefix("torch."),
            "command": "focus-hf train --objective distill",
        },
    )
    if args.clean_checkpoints:
        import shutil

        shutil.rmtree(checkpoints, ignore_errors=True)
    return log


def run(args: argparse.Namespace) -> int:
    """`focus-hf train`: train, then print where the adapter went and how the run ended."""
    from focus_hf.files import CHECKPOINTS_DIR
    from focus_hf.fitting.parallel import end_process_group

    log = train(args)
    # Not on an error: a barrier there would wait for processes still inside a collective; the launcher stops them.
    end_process_group()
    if not log:
        # A process other than the main one of a multi-process launch (torchrun): the main one saved and reports.
        return 0
    out = Path(args.out)
    if getattr(args, "objective", "lm") == "distill":
        print(f"\nFocus adapter saved to {out}/ (adapter_config.json, adapter_model.safetensors, training_log.json)")
        print(
            f"  attention mass kept by the soft routing (calibration queries beyond the window): "
            f"{log['kept_before']:.3f} -> {log['kept_after']:.3f}; largest group share {log['largest_group_max']:.2f}"
        )
        dense = log["config"].get("dense_heads")
        if dense:
            print(f"  dense kv heads: {dense}")
        return 0
    dominance = log["dominance"][-1]["max"] if log.get("dominance") else float("nan")
    print(f"\nFocus adapter saved to {out}/ (adapter_config.json, adapter_model.safetensors, training_log.json)")
    print(
        f"  steps {log['steps']}, tokens {log['tokens_seen']:,}, wall time {log['wall_time_s']:.0f} s, "
        f"final loss {log['final_loss']:.4f}, max group dominance {dominance:.2f}"
    )
    if (out / CHECKPOINTS_DIR).is_dir():
        print(f"  checkpoints (for --resume) in {out}/{CHECKPOINTS_DIR}; remove them before sharing the folder")
    return 0


def add_training_options(parser: argparse.ArgumentParser, *, steps: int, seq_len: int, lr: float) -> None:
    """Add the "adapter" (every `FocusConfig` option) and "training" option groups with these defaults."""
    add_focus_options(parser.add_argument_group("adapter"))
    group = parser.add_argument_group("training")
    add_option(group, "--seq-len", type=int, default=seq_len, help=f"tokens per training block (default: {seq_len})")
    add_option(group, "--steps", type=int, default=steps, help=f"optimizer steps (default: {steps})")
    add_option(group, "--lr", type=float, default=lr, help=f"peak learning rate (default: {lr})")
    add_option(group, "--batch-size", type=int, default=1, help="blocks per step (default: 1)")
    add_option(group, "--seed", type=int, default=0, help="random seed (default: 0)")
    add_option(group, "--logging-steps", type=int, default=1, help="loss logging interval (default: 1)")
    add_option(
        group,
        "--dominance-threshold",
        type=float,
        default=0.5,
        help="warn when a layer's largest group holds more than this share of tokens (default: 0.5)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `train` sub-command."""
    parser = subparsers.add_parser(
        "train",
        help="train a Focus adapter's routers on a corpus",
        description="Train the routers of a Focus adapter (all model weights frozen) with transformers' Trainer "
        "and save a ready-to-load adapter folder plus training_log.json.",
    )
    add_model_option(parser)
    add_data_options(parser)
    add_option(parser, "--out", required=True, help="adapter folder to write (checkpoints go to OUT/checkpoints)")
    add_training_options(parser, steps=200, seq_len=512, lr=5e-3)
    # The two objectives want different scales; None means "the chosen objective's default" (OBJECTIVE_DEFAULTS).
    parser.set_defaults(steps=None, seq_len=None, lr=None, sequences=None, query_projection=None)
    distillation = parser.add_argument_group("objective")
    add_option(
        distillation,
        "--objective",
        choices=("distill", "lm"),
        default="distill",
        help="distill: fit each router to the base model's own attention, layer by layer, keeping the attention "
        "mass the model uses (default; --steps counts steps per layer); lm: the language-model loss through the "
        "whole model with transformers' Trainer. Defaults: "
        + "; ".join(f"{name}: {values}" for name, values in OBJECTIVE_DEFAULTS.items()),
    )
    add_option(
        distillation,
        "--query-projection",
        action=argparse.BooleanOptionalAction,
        old=("--no-query-router=--no-query-projection",),
        help="give queries a router of their own (FocusConfig.query_projection; default: on for distill, off for lm)",
    )
    add_option(
        distillation,
        "--sequences",
        type=int,
        old=("--max-train-blocks",),
        help="corpus blocks to train or calibrate on (default: 4 for distill, all for lm)",
    )
    add_option(
        distillation,
        "--retrieval-documents",
        type=int,
        default=2,
        help="distill: synthetic long-range retrieval documents mixed in (default: 2)",
    )
    add_option(
        distillation,
        "--dense-heads",
        type=int,
        default=0,
        help="distill: after fitting, keep full attention in this many kv heads, those losing the most mass on a "
        "training block (default: 0)",
    )
    add_option(
        distillation,
        "--retrieval-heads",
        type=int,
        default=0,
        help="distill: keep full attention in this many more kv heads, those dropping the most attention on "
        "distant copied tokens in synthetic retrieval text (the heads that answer 'what was X?'; default: 0)",
    )
    add_option(
        distillation,
        "--dense-below",
        type=int,
        default=0,
        help="record FocusConfig.dense_below: the first tokens of a text, up to this many, attend densely, exactly as "
        "the base model (set it to the length below which Focus is not faster; default: 0, always route)",
    )
    add_option(
        distillation,
        "--device",
        default=None,
        help="distill: torch device the base model runs on, e.g. cuda (default: where it loads, the CPU)",
    )
    add_option(
        distillation,
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="distill: dtype of the base model's weights, e.g. bfloat16 on a GPU, so that the attention captured "
        "comes from the model as it is served (default: float32); the routers are trained in float32 either way",
    )
    add_option(
        distillation,
        "--layerwise",
        action="store_true",
        help="distill: walk the decoder one layer at a time (one layer's calibration data in memory; for bases "
        "dispatched with offload); same routers as the default whole-model pass",
    )
    add_option(distillation, "--top-m", type=int, default=64, help="distill: distant keys per query kept as target")
    add_option(
        distillation,
        "--queries-per-sequence",
        type=int,
        default=1024,
        help="distill: sampled queries per sequence (default: 1024)",
    )
    add_option(
        distillation,
        "--balance-weight",
        type=float,
        default=0.5,
        help="distill: weight of the group-balance penalty (default: 0.5)",
    )
    add_option(parser, "--save-steps", type=int, default=None, help="checkpoint interval (default: steps / 4)")
    add_option(parser, "--resume", action="store_true", help="continue from the last checkpoint in OUT/checkpoints")
    add_option(parser, "--clean-checkpoints", action="store_true", help="delete OUT/checkpoints after training")
    add_option(
        parser,
        "--no-balance-check",
        dest="balance_check",
        action="store_false",
        help="skip the final group-dominance check on one held-out block",
    )
    add_option(parser, "--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)
