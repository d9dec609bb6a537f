"""Check that `focus-hf train` (router distillation) runs on a device: a short run on a tiny random Llama.

A machine without Hub access cannot download a model, so this builds one: a 2-layer random-weight Llama with a
word-level tokenizer, saved to a temporary folder with a small word corpus; then it runs, as a user would,

    focus-hf train --objective distill --model TINY --data CORPUS --out ADAPTER --device DEVICE --dtype DTYPE ...

(bf16 capture on CUDA, a few steps per layer; through the command's entry point, in this process) and writes a
JSON with the command, its exit code and wall time, what the training log recorded (device, base dtype, the attention
mass kept before and after) and the dtype of every saved router tensor (F32, i.e. float32, expected). This shows that
the command runs there; it measures no quality.

    python benchmarks/gpu/train_check.py --device cuda --out train.json
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

WORDS = [f"w{i}" for i in range(60)]


def build_tiny_model(folder: Path) -> tuple[Path, Path]:
    """A tiny random Llama with a word-level tokenizer in `folder`/model and a word corpus in `folder`/corpus.txt,
    whose word bigrams have some structure (each word is mostly followed by one of two successors)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<pad>": 1, "<eos>": 2, **{word: i + 3 for i, word in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]", pad_token="<pad>"
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=1,
        eos_token_id=2,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model_dir = folder / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rng = random.Random(0)
    words, current = [], 0
    for _ in range(20000):
        words.append(WORDS[current])
        current = (current * 7 + rng.choice((1, 2))) % len(WORDS)
    corpus = folder / "corpus.txt"
    corpus.write_text(" ".join(words), encoding="utf-8")
    return model_dir, corpus


def router_dtypes(adapter: Path) -> dict[str, str]:
    """Saved tensor name -> dtype of the adapter's weights file."""
    from safetensors import safe_open

    with safe_open(adapter / "adapter_model.safetensors", framework="pt") as handle:
        return {name: str(handle.get_slice(name).get_dtype()) for name in handle.keys()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default: bf16 on CUDA, else fp32")
    parser.add_argument("--steps", type=int, default=5, help="distillation steps per layer")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()

    import torch

    from focus_hf.benchmarking.records import provenance
    from focus_hf.cli import main as cli_main

    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu/train_check.py --device cuda needs a CUDA GPU; none is available here.")
        return 2
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="focus-train-check-") as temporary:
        folder = Path(temporary)
        model_dir, corpus = build_tiny_model(folder)
        adapter = folder / "adapter"
        argv = [
            "train",
            "--objective",
            "distill",
            "--model",
            str(model_dir),
            "--data",
            str(corpus),
            "--out",
            str(adapter),
            "--device",
            args.device,
            "--dtype",
            dtype,
            "--steps",
            str(args.steps),
            "--seq-len",
            "256",
            "--window",
            "32",
            "--groups",
            "4",
            "--sequences",
            "2",
            "--retrieval-documents",
            "0",
            "--queries-per-sequence",
            "64",
            "--top-m",
            "16",
            "--no-progress",
        ]
        start = time.perf_counter()
        error = None
        try:  # the command's own entry point, in this process (one Python start less than a subprocess)
            returncode = cli_main(argv)
        except SystemExit as exit:
            returncode = exit.code if isinstance(exit.code, int) else 1
            error = None if isinstance(exit.code, int) else str(exit.code)
        except Exception as failure:  # noqa: BLE001 - the JSON says what failed
            returncode, error = 1, f"{type(failure).__name__}: {failure}"
            traceback.print_exc()
        wall = time.perf_counter() - start
        result = {
            **provenance(torch.device(args.device), shlex.join(sys.orig_argv)),
            "check": "focus-hf train --objective distill runs on this device (tiny random Llama; no quality measured)",
            "train_command": shlex.join(["focus-hf", *argv]),
            "returncode": returncode,
            "error": error,
            "wall_s": wall,
        }
        log_path = adapter / "training_log.json"
        if returncode == 0 and log_path.is_file():
            log = json.loads(log_path.read_text())
            metadata = log.get("metadata", {})
            dtypes = router_dtypes(adapter)
            result.update(
                trained_on=metadata.get("device"),
                base_dtype=metadata.get("base_dtype"),
                steps_per_layer=log["settings"]["steps"],
                layers=len(log["layers"]),
                kept_before=log["kept_before"],
                kept_after=log["kept_after"],
                largest_group_max=log["largest_group_max"],
                router_dtypes=sorted(set(dtypes.values())),
                router_tensors=len(dtypes),
            )
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    ok = returncode == 0 and result.get("router_dtypes") == ["F32"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
