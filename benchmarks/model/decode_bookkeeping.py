"""What Focus's bookkeeping costs a decoding step of SmolLM2-135M-Instruct: the time its layers spend outside the
attention modules they wrap, stepped in turn in one process (as `decode_steps.py` steps).

Three variants each read the same prompt into a KV cache of their own, then take decoding steps in turn:
- full attention: the adapter disabled - what peft's wrapper costs by itself;
- Focus hard as saved;
- Focus with every step decided afresh: `DecodingRun.next_state` refused, so that each step runs the whole decision
  of `FocusLayer.forward`, as before runs of steps (b2c6d9b below `dense_below`, then routed steps too).
Each step is timed whole and, in every Focus layer, around `FocusLayer.forward` and around its wrapped module; the
difference of the two sums is the bookkeeping (the timers' own cost is in every variant's).

    python benchmarks/model/decode_bookkeeping.py --prompt-lens 1024 2048 --steps 100 \\
        --json bookkeeping.json
    python benchmarks/machine_results.py benchmarks/results/machines/zen5-epyc.json \\
        decode_bookkeeping_native=bookkeeping.json

Rows: prompt_len, variant, step_ms and bookkeeping_ms (medians), bookkeeping_us_per_layer, layers, steps, processor,
threads, load average.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
from peft import PeftModel

import focus_hf
from focus_hf import load_model_and_tokenizer
from focus_hf.aliases import DEFAULT_MODEL
from focus_hf.benchmarking.model import (
    COMMITTED_ADAPTER,
    VARIANTS,
    attention_variant,
    held_out_sequence,
    prefilled,
    saved_setting,
)
from focus_hf.benchmarking.records import log, machine_fields, repository_of, script_command, write_json
from focus_hf.tuner.layer import DecodingRun, FocusLayer

REPOSITORY = repository_of(__file__)


class LayerClock:
    """Sums the seconds spent in every Focus layer's forward and in the modules they wrap, while installed."""

    def __init__(self, model: PeftModel) -> None:
        self.layers = focus_hf.focus_layers(model)
        self.in_layers = self.in_wrapped = 0.0

    @contextlib.contextmanager
    def installed(self) -> Iterator["LayerClock"]:
        forward = FocusLayer.forward

        def timed_forward(layer: FocusLayer, *args, **kwargs):
            started = time.perf_counter()
            try:
                return forward(layer, *args, **kwargs)
            finally:
                self.in_layers += time.perf_counter() - started

        def timed_wrapped(wrapped_forward):
            def timed(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return wrapped_forward(*args, **kwargs)
                finally:
                    self.in_wrapped += time.perf_counter() - started

            return timed

        FocusLayer.forward = timed_forward
        for layer in self.layers:
            layer.base_layer.forward = timed_wrapped(layer.base_layer.forward)
        try:
            yield self
        finally:
            FocusLayer.forward = forward
            for layer in self.layers:
                del layer.base_layer.forward  # the class's method again

    def restart(self) -> None:
        self.in_layers = self.in_wrapped = 0.0

    @property
    def bookkeeping(self) -> float:
        return self.in_layers - self.in_wrapped


@contextlib.contextmanager
def every_step_decided(decided: bool) -> Iterator[None]:
    """With `decided`, no run of decoding steps continues (`DecodingRun.next_state` refuses): each step decides
    afresh."""
    next_state = DecodingRun.next_state
    if decided:
        DecodingRun.next_state = lambda *args: None
    try:
        yield
    finally:
        DecodingRun.next_state = next_state


# variant -> (`VARIANTS`' variant, every step decided)
KINDS = {"full": ("full", False), "focus": ("focus", False), "focus-decided": ("focus", True)}


@torch.no_grad()
def step_in_turn(model: PeftModel, clock: LayerClock, input_ids: torch.Tensor, steps: int) -> dict[str, dict]:
    """Per variant, each step's seconds whole and in bookkeeping."""
    state = {}
    for kind, (variant, decided) in KINDS.items():
        with every_step_decided(decided):
            state[kind] = prefilled(model, input_ids, variant, "dynamic", steps)
    times = {kind: {"step": [], "bookkeeping": []} for kind in KINDS}
    for _ in range(steps):
        for kind, (variant, decided) in KINDS.items():
            cache, token = state[kind]
            with attention_variant(model, VARIANTS[variant], "auto"), every_step_decided(decided):
                clock.restart()
                started = time.perf_counter()
                logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
                times[kind]["step"].append(time.perf_counter() - started)
                times[kind]["bookkeeping"].append(clock.bookkeeping)
            state[kind] = (cache, logits[:, -1:].argmax(-1))
    return times


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--steps", type=int, default=100, help="decoding steps per variant, taken in turn")
    parser.add_argument("--adapter", type=Path, default=REPOSITORY / COMMITTED_ADAPTER, help="Focus adapter folder")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")

    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODEL)
    model = PeftModel.from_pretrained(model, args.adapter).eval()
    setting = saved_setting(model)
    names = {
        "full": "full attention (adapter disabled)",
        "focus": f"Focus hard as saved ({setting})",
        "focus-decided": f"Focus hard as saved ({setting}), every step decided afresh",
    }
    clock = LayerClock(model)
    rows = []
    with clock.installed():
        for prompt_len in args.prompt_lens:
            log(f"{prompt_len:,}-token prompt: {args.steps} steps of each variant, in turn ...")
            times = step_in_turn(model, clock, held_out_sequence(tokenizer, prompt_len), args.steps)
            for kind, seconds in times.items():
                step, bookkeeping = (statistics.median(seconds[part]) for part in ("step", "bookkeeping"))
                rows.append(
                    {
                        "prompt_len": prompt_len,
                        "variant": names[kind],
                        "step_ms": round(step * 1e3, 2),
                        "bookkeeping_ms": round(bookkeeping * 1e3, 3),
                        "bookkeeping_us_per_layer": round(bookkeeping * 1e6 / len(clock.layers), 1),
                        "layers": len(clock.layers),
                        "steps": args.steps,
                        "adapter": str(args.adapter),
                        **machine_fields(torch.device("cpu")),
                        "command": script_command(__file__, argv),
                        "focus_hf": focus_hf.__version__,
                    }
                )
                row = rows[-1]
                log(f"  {names[kind]}: step {row['step_ms']:.2f} ms, bookkeeping {row['bookkeeping_ms']:.3f} ms")
            write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
