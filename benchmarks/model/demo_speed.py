"""`focus-hf demo`'s speed line again, on the adapter a demo run wrote, with this process's build of the C kernels.

`focus-hf demo` distils an adapter, evaluates it and ends with one timed prefill of its sequence length (8,192
tokens by default), full attention against Focus hard routing (`commands.demo.measure_speed`). This script repeats
that last step alone - same text, same function, same printed line - for the build that `FOCUS_HF_CPU_TARGET` names,
without distilling again:

    focus-hf demo --out focus-demo
    FOCUS_HF_CPU_TARGET=x86-64-v3 python benchmarks/model/demo_speed.py focus-demo \\
        --json demo_speed.json
    python benchmarks/machine_results.py benchmarks/results/machines/<machine>.json demo_speed_x86-64-v3=demo_speed.json

Before the timed prefills, one untimed Focus prefill of the same length lets "auto" measure its crossover, as the
demo's perplexity evaluation does before its speed step: a one-time measurement is not what the line reports.
The row records the processor, the kernels' build and the commit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch
from peft import PeftModel

from focus_hf import load_model_and_tokenizer
from focus_hf.aliases import DEFAULT_MODEL
from focus_hf.benchmarking.records import machine_fields, script_command
from focus_hf.commands.common import DEFAULT_DATA, split_documents
from focus_hf.commands.demo import DEMO_SEQ_LEN, measure_speed, speed_line
from focus_hf.data import token_blocks
from focus_hf.evaluation import routing_mode


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter", type=Path, help="the folder `focus-hf demo --out` wrote")
    parser.add_argument("--seq-len", type=int, default=DEMO_SEQ_LEN, help="tokens of the timed prefill")
    parser.add_argument("--top-k", type=int, default=None, help="hard-mode top_k (default: the adapter's)")
    parser.add_argument("--repeats", type=int, default=1, help="timed prefills per variant, best kept")
    parser.add_argument("--json", type=Path, help="write the row here")
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODEL)
    model = PeftModel.from_pretrained(model, args.adapter).eval()
    top_k = args.top_k or model.peft_config["default"].top_k
    train_texts, heldout_texts = split_documents(DEFAULT_DATA)
    texts = heldout_texts + train_texts  # what the demo times
    input_ids = token_blocks(tokenizer, texts, args.seq_len, max_blocks=1)
    with torch.no_grad(), routing_mode(model, "hard", top_k):
        model(input_ids=input_ids, use_cache=True)
    speed = measure_speed(model, tokenizer, texts, args.seq_len, args.repeats, top_k)
    print(speed_line(speed))
    if args.json:
        command = script_command(__file__, argv)
        row = {**speed, "adapter": str(args.adapter), **machine_fields(torch.device("cpu")), "command": command}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([row], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
