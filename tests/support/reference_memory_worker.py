"""Forwards of a 1-layer, 4-head tiny llama (`tiny_models`) through `backend="reference"`, one per MODE:LENGTH[:whole]
argument, each printed as a JSON line with the peak resident memory it added (Linux: the peak is reset before each
forward). `whole` runs the call in one chunk, as the reference path did before it was chunked.

    OMP_NUM_THREADS=1 python tests/support/reference_memory_worker.py hard:8192 hard:32768 soft:32768 hard:8192:whole
"""

from __future__ import annotations

import ctypes
import gc
import json
import resource
import sys
import time
from pathlib import Path
from unittest import mock

import psutil
import torch
from peft import get_peft_model
from tiny_models import COMMON, VOCAB  # beside this file, on sys.path when it runs as a script
from transformers import AutoModelForCausalLM, LlamaConfig

import focus_hf
import focus_hf.attention.reference as reference


def reset_peak() -> int:
    """Start a fresh peak measurement: give freed heap memory back to the system (else a forward could reuse memory
    an earlier one left resident, unseen), reset the kernel's peak to the current size, and return that size."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return psutil.Process().memory_info().rss


def peak() -> int:
    """The peak resident memory since `reset_peak`, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(specs: list[str]) -> None:
    torch.manual_seed(0)
    runs = [(spec.split(":")[0], int(spec.split(":")[1]), spec.endswith(":whole")) for spec in specs]
    longest = max(length for _, length, _ in runs)
    config = LlamaConfig(
        **{**COMMON, "num_hidden_layers": 1, "num_key_value_heads": 2, "max_position_embeddings": longest}
    )
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = get_peft_model(base, focus_hf.FocusConfig(num_groups=8, group_dim=8, window=128, sink_tokens=4)).eval()
    ids = torch.randint(3, VOCAB, (1, longest), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for mode in sorted({mode for mode, _, _ in runs}):  # first-call set-up outside the measurements
            focus_hf.set_routing(model, mode, backend="reference")
            model(input_ids=ids[:, :512])
        for mode, length, whole in runs:
            focus_hf.set_routing(model, mode, backend="reference")
            before = reset_peak()
            started = time.perf_counter()
            with mock.patch.object(reference, "CPU_CHUNK_BYTES", 1 << 50 if whole else reference.CPU_CHUNK_BYTES):
                logits = model(input_ids=ids[:, :length]).logits
            seconds = time.perf_counter() - started
            added = peak() - before
            assert torch.isfinite(logits).all()
            del logits
            print(json.dumps(dict(mode=mode, length=length, whole=whole, added=added, seconds=round(seconds, 1))))


if __name__ == "__main__":
    main(sys.argv[1:])
