"""How many attention sinks should hard-mode Focus keep by default? Measured on the real model.

Random (untrained) routers, K=8, w=128, hard mode, on held-out Python reference text: perplexity of full
attention vs Focus top-1 / top-2 with 0, 1, 4 and 8 sink tokens, all in one run on the same token blocks.

    python benchmarks/quality/sink_default.py --seq-len 2048 --blocks 2 --json benchmarks/results/sink_default.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from peft import get_peft_model

import focus_hf
from focus_hf import load_model_and_tokenizer
from focus_hf.data import load_texts, split_texts, token_blocks


@torch.no_grad()
def block_nll(model, blocks: torch.Tensor) -> float:
    total = 0.0
    for block in blocks:
        total += model(input_ids=block[None], labels=block[None]).loss.item() * (block.numel() - 1)
    return total / (blocks.shape[0] * (blocks.shape[1] - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--sinks", type=int, nargs="+", default=[0, 1, 4, 8])
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()

    model, tokenizer = load_model_and_tokenizer()
    _, heldout = split_texts(load_texts("python-docs"))
    blocks = token_blocks(tokenizer, heldout, args.seq_len, max_blocks=args.blocks)
    start = time.perf_counter()
    rows = [{"setting": "full attention", "ppl": math.exp(block_nll(model, blocks))}]
    for sinks in args.sinks:
        torch.manual_seed(args.seed)
        config = focus_hf.FocusConfig(num_groups=args.groups, window=args.window, sink_tokens=sinks)
        focus_model = get_peft_model(model, config).eval()
        for top_k in args.top_k:
            focus_hf.set_routing(focus_model, "hard", top_k=top_k)
            rows.append(
                {
                    "setting": f"hard top-{top_k}, {sinks} sinks",
                    "sinks": sinks,
                    "top_k": top_k,
                    "ppl": math.exp(block_nll(focus_model, blocks)),
                }
            )
            print(rows[-1], flush=True)
        model = focus_model.unload()
    result = {
        "model": "smollm2-135m-instruct",
        "data": "python-docs held-out",
        "seq_len": args.seq_len,
        "blocks": args.blocks,
        "groups": args.groups,
        "window": args.window,
        "routers": f"random init, seed {args.seed}",
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
