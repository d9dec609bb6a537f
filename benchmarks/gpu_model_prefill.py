"""GPU benchmark (issue 15, part 6): model-level prefill of SmolLM2-135M-Instruct up to 128K tokens, dense against
the committed long-context Focus adapter (benchmarks/long_context/adapter/, as saved: its top-k, window, dense
heads and dense_below).

Dense is the base model without the adapter (transformers' SDPA, or flash_attention_2 when flash-attn is
installed); Focus is the same base with the adapter in hard mode on the `flash` backend (`sdpa` without
flash-attn). Both run the decoder alone (no language-model head: its logits at 128K would dwarf the attention),
in bf16, timed alternately after a warm-up, best of --repeats; peak GPU memory is recorded per call.

    python benchmarks/gpu_model_prefill.py --lengths 8192 32768 131072 --out benchmarks/results/model_prefill_gpu.json

Needs CUDA (`--device cpu` runs the same code on the CPU in float32, to check the script on short lengths); the
tokens are held-out Python standard-library source, repeated to length when the split is shorter.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ADAPTER = Path(__file__).resolve().parent / "long_context" / "adapter"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--adapter", default=str(ADAPTER))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default="benchmarks/results/model_prefill_gpu.json")
    args = parser.parse_args()

    import importlib.util

    import torch
    from gpu_attention import timing_row  # this script's folder is on the path when it runs
    from peft import PeftModel

    import focus_hf
    from focus_hf import load_model_and_tokenizer
    from focus_hf.data import load_texts, split_texts

    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu_model_prefill.py needs a CUDA GPU; none is available here, nothing was measured.")
        return 2
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    flash = cuda and importlib.util.find_spec("flash_attn") is not None
    base, tokenizer = load_model_and_tokenizer(dtype=dtype)
    if flash:
        base.set_attn_implementation("flash_attention_2")
    model = PeftModel.from_pretrained(base.to(args.device), args.adapter).eval()
    backend = "flash" if flash else "sdpa"
    focus_hf.set_routing(model, "hard", backend=backend)
    decoder = model.get_base_model().model

    _, heldout = split_texts(load_texts("python-source"))
    text_ids = tokenizer("\n".join(heldout), return_tensors="pt").input_ids[0]

    def tokens(n: int) -> torch.Tensor:
        repeats = -(-n // len(text_ids))
        return text_ids.repeat(repeats)[:n].view(1, n).to(args.device)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    def prefill(ids: torch.Tensor, focus: bool) -> tuple[float, int]:
        synchronize()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            start = time.perf_counter()
            if focus:
                decoder(input_ids=ids, use_cache=False)
            else:
                with model.disable_adapter():
                    decoder(input_ids=ids, use_cache=False)
            synchronize()
        return time.perf_counter() - start, torch.cuda.max_memory_allocated() if cuda else 0

    rows = []
    for n in args.lengths:
        ids = tokens(n)
        try:
            warm = ids[:, : min(n, 4096)]
            prefill(warm, True), prefill(warm, False)
            dense, focus = [], []
            for _ in range(args.repeats):
                dense.append(prefill(ids, False))
                focus.append(prefill(ids, True))
        except torch.cuda.OutOfMemoryError as error:
            rows.append({"tokens": n, "error": f"out of memory: {error}"[:200]})
            torch.cuda.empty_cache()
            continue
        rows.append(timing_row(n, dense, focus))
        print(json.dumps(rows[-1]), flush=True)
    config = model.peft_config["default"]
    result = {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()})",
        "dense_attention": "flash_attention_2" if flash else "sdpa",
        "focus_backend": backend,
        "dtype": str(dtype).removeprefix("torch."),
        "adapter": args.adapter,
        "focus": {
            "num_groups": config.num_groups,
            "top_k": config.top_k,
            "window": config.window,
            "dense_heads": len(config.dense_heads or []),
            "dense_below": config.dense_below,
        },
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "command": "python benchmarks/gpu_model_prefill.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
