"""Peak memory of router distillation, whole model (`distill_routers`) against layer by layer
(`distill_routers_layerwise`), on a random-weight Llama dispatched by accelerate with its weights on disk.

python examples/distill_layerwise_memory.py                 # 8 layers, 8 sequences x 1,024 tokens (~1 min, 1 core)
python examples/distill_layerwise_memory.py --layers 16

Each method runs in a process of its own; the figure is the rise of the peak resident set size (Linux VmHWM, reset
before the call) over the resident size before it. Both methods must end with the same routers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} not in /proc/self/status (Linux only)")


def measure(args: argparse.Namespace) -> dict:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    import focus_hf
    from focus_hf.fitting.distill import DistillSettings, distill_routers
    from focus_hf.fitting.layerwise import distill_routers_layerwise

    base = AutoModelForCausalLM.from_pretrained(
        args.folder / "base", device_map="auto", max_memory={"cpu": 100_000}, offload_folder=str(args.folder / "off")
    ).eval()
    torch.manual_seed(0)
    config = focus_hf.FocusConfig(num_groups=8, group_dim=16, window=64, top_k=1, query_projection=True)
    model = get_peft_model(base, config).eval()
    data = [torch.randint(3, 1024, (args.seq_len,), generator=torch.Generator().manual_seed(i)) for i in range(8)]
    settings = DistillSettings(steps=3, top_m=64, queries_per_sequence=256)
    distill = distill_routers if args.method == "whole" else distill_routers_layerwise
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    before, start = _status_mb("VmRSS:"), time.time()
    distill(model, data, settings, progress=False)
    seconds, peak = time.time() - start, _status_mb("VmHWM:")
    routers = torch.cat([p.detach().flatten() for name, p in model.named_parameters() if "focus_" in name])
    torch.save(routers, args.folder / f"routers_{args.method}.pt")
    return {"method": args.method, "peak_rise_mb": round(peak - before, 1), "seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--method", choices=("whole", "layerwise"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.method:
        print(json.dumps(measure(args)))
        return
    from transformers import AutoModelForCausalLM, LlamaConfig

    with tempfile.TemporaryDirectory() as folder:
        config = LlamaConfig(
            vocab_size=1024,
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=max(4096, args.seq_len),
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(Path(folder) / "base")
        rows = []
        for method in ("whole", "layerwise"):
            command = [sys.executable, __file__, "--method", method, "--folder", folder]
            command += ["--layers", str(args.layers), "--seq-len", str(args.seq_len)]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(output.strip().splitlines()[-1]))
        same = torch.equal(*(torch.load(Path(folder) / f"routers_{m}.pt") for m in ("whole", "layerwise")))
    print(f"{args.layers} layers, 8 sequences x {args.seq_len} tokens, weights on disk; same routers: {same}")
    for row in rows:
        print(f"  {row['method']:>9}: peak RSS rise {row['peak_rise_mb']:8.1f} MB, {row['seconds']:5.1f} s")


if __name__ == "__main__":
    main()
