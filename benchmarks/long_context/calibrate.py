"""Choose the committed adapter's full-attention heads and dense_below, and record them in its adapter_config.json.

    python benchmarks/long_context/calibrate.py --mass-heads 9 --retrieval-heads 6
    python benchmarks/long_context/calibrate.py --keep-heads --dense-below 2048   # after the speed stage

Runs `focus_hf.fitting.dense_heads.calibrate_full_attention` on the python-docs *training* split (one 8,192-token
block for the recall audit, two fresh synthetic retrieval documents for the retrieval audit; nothing from the
held-out text the benchmark scores), at the adapter's own window and top-k, then saves the adapter in place (the
router weights are unchanged) and writes what was chosen to `calibration.json`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from run import ADAPTER, command_line, load_focus, machine  # this script's folder

import focus_hf
from focus_hf.data import load_texts, split_texts
from focus_hf.fitting.dense_heads import calibrate_full_attention

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", type=Path, default=ADAPTER)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--mass-heads", type=int, default=9)
    parser.add_argument("--retrieval-heads", type=int, default=6)
    parser.add_argument("--dense-below", type=int, default=0, help="from the speed stage: where Focus stops paying")
    parser.add_argument("--keep-heads", action="store_true", help="only set --dense-below; keep the dense heads")
    args = parser.parse_args()
    model, tokenizer = load_focus(args.adapter)
    record_path = HERE / "calibration.json"
    if args.keep_heads:
        record = json.loads(record_path.read_text())
    else:
        focus_hf.configure_adapter(model, dense_heads=None)
        train, _ = split_texts(load_texts("python-docs"), heldout_fraction=0.1, seed=0)
        calibration = calibrate_full_attention(
            model, tokenizer, train, args.seq_len, mass_heads=args.mass_heads, retrieval_heads=args.retrieval_heads
        )
        record = {**calibration.to_dict(), "command": command_line(), **machine()}
    focus_hf.configure_adapter(model, dense_below=args.dense_below)
    model.save_pretrained(args.adapter)
    (args.adapter / "README.md").unlink(missing_ok=True)  # PEFT's empty card stub; the benchmark's report says it all
    record.update(dense_below=args.dense_below, dense_below_command=command_line() if args.keep_heads else None)
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(model.peft_config["default"].dense_heads), model.peft_config["default"].dense_below)


if __name__ == "__main__":
    main()
