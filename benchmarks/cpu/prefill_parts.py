"""Where a Focus prefill's time goes on the CPU, per visible pair, against dense SDPA's kernel.

One attention layer with `focus-hf bench`'s inputs and routing (9 / 3 heads, head dim 64, K=8, window 128, 4 sinks),
the sparse path (`backend="sdpa"`) on one thread, each C call of the path timed in process CPU time:

- the own-group pass (`native_prefill.prefill_segments`, `set_a` in the rows): the same-group pairs, whose count is
  exact here (per query, the keys of its probed groups up to it);
- the local part (`native_prefill.prefill_attention` from `partials.local_part`): the window's pairs of other groups;
- the sink pairs (`native_prefill.sink_pairs`), and the rest (the group sort, Python, the output's conversion);

against dense causal SDPA on the same inputs, as nanoseconds per visible (query, key) pair and query head; and the
same sparse path on torch operations alone (`native.torch_path`, what "auto" runs where it is the faster), so that
each row shows whether the C kernels beat it. One thread and CPU time, so that the figures are the kernels' own rate
(the threaded runs are `focus-hf bench`'s), and a busy machine moves them less. Up to REPEAT_MAX_LEN tokens each path
is timed --repeats times in turn and every figure is a median: one call of a few milliseconds moved by a tenth and
more between runs. Each row records the kernels' build (`FOCUS_HF_CPU_TARGET`): run it once per target to compare
builds on one machine.

    python benchmarks/cpu/prefill_parts.py --json benchmarks/results/attention_cpu_parts.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional
from unittest import mock

import torch
import torch.nn.functional as F

import focus_hf.attention.cpu.partials as partials
import focus_hf.attention.cpu.segments as segments
from focus_hf.attention.cpu.native import torch_path
from focus_hf.attention.hard import hard_attention
from focus_hf.attention.pattern import FocusPattern
from focus_hf.benchmarking.layer import allowed_pair_count, layer_fields, make_case
from focus_hf.benchmarking.records import log, machine_fields, script_command, write_json

# Above this many tokens one call takes seconds and is timed once; shorter calls (a few milliseconds at 1K) are timed
# --repeats times, alternating, and each figure is the median.
REPEAT_MAX_LEN = 16384
PARTS = ("set_a", "local", "sinks")  # the C calls timed inside the path


def cpu_seconds(function: Callable[[], object]) -> float:
    started = time.process_time()
    function()
    return time.process_time() - started


def rounds_for(seq_len: int, repeats: int) -> int:
    return repeats if seq_len <= REPEAT_MAX_LEN else 1


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument(
        "--repeats", type=int, default=5, help=f"timed calls of each path up to {REPEAT_MAX_LEN:,} tokens (medians)"
    )
    parser.add_argument("--json", type=Path, default=None)
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    args = argparse.Namespace(
        seed=0, heads=9, kv_heads=3, head_dim=64, groups=8, window=128, sinks=4, query_router=False, top_k=[1, 2]
    )
    rows: list[dict] = []
    device = torch.device("cpu")
    with torch.inference_mode():
        for dtype_name in options.dtypes:
            for seq_len in options.seq_lens:
                case = make_case(args, seq_len, device, getattr(torch, dtype_name))
                query, key, value = case.query, case.key, case.value
                first = case.routing[1]
                hard_attention(  # warm-up: the kernels are built and paged in before anything is timed
                    query[:, :, :1024], key[:, :, :1024], value[:, :, :1024],
                    FocusPattern(first.top_groups[:, :1024], first.key_groups[:, :1024], first.sink[:, :1024],
                                 args.groups, args.window, own_group=True),
                    scaling=args.head_dim**-0.5, backend="sdpa",
                )  # fmt: skip
                rounds = rounds_for(seq_len, options.repeats)
                dense_s = statistics.median(
                    cpu_seconds(
                        lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
                    )
                    for _ in range(rounds)
                )
                pair_heads = seq_len * (seq_len + 1) // 2 * args.heads
                for top_k in (1, 2):
                    routing = case.routing[top_k]
                    # keys of each query's probed groups up to it (its own-group pass, the riding sinks aside)
                    per_group = F.one_hot(routing.key_groups[0], args.groups).cumsum(0)
                    set_a_pairs = int(per_group.gather(1, routing.top_groups[0]).sum())
                    allowed = allowed_pair_count(routing, args.window, args.groups)
                    spent: dict[str, float] = {}

                    def timed(name: str, function: Callable) -> Callable:
                        def call(*arguments, **keywords):
                            started = time.process_time()
                            result = function(*arguments, **keywords)
                            spent[name] = spent.get(name, 0.0) + time.process_time() - started
                            return result

                        return call

                    def sparse_path(routing=routing) -> torch.Tensor:
                        pattern = FocusPattern(
                            routing.top_groups,
                            routing.key_groups,
                            routing.sink,
                            args.groups,
                            args.window,
                            own_group=True,
                        )
                        return hard_attention(query, key, value, pattern, scaling=args.head_dim**-0.5, backend="sdpa")

                    set_a_call, local_call = segments.prefill_segments, partials.prefill_attention
                    sinks_call = partials.sink_pairs
                    samples: dict[str, list[float]] = {name: [] for name in ("focus", "torch", *PARTS)}
                    for _ in range(rounds):  # the C kernels' path and the torch path in turn
                        spent.clear()
                        with (
                            mock.patch.object(segments, "prefill_segments", timed("set_a", set_a_call)),
                            mock.patch.object(partials, "prefill_attention", timed("local", local_call)),
                            mock.patch.object(partials, "sink_pairs", timed("sinks", sinks_call)),
                        ):
                            samples["focus"].append(cpu_seconds(sparse_path))
                        for name in PARTS:
                            samples[name].append(spent.get(name, 0.0))
                        with torch_path():  # the same path on torch operations alone, as "auto" may run it
                            samples["torch"].append(cpu_seconds(sparse_path))
                    part_s = {name: statistics.median(samples[name]) for name in PARTS}
                    focus_s, torch_s = statistics.median(samples["focus"]), statistics.median(samples["torch"])
                    other_pairs = max(allowed - set_a_pairs, 1)  # the window's pairs of other groups, distant sinks
                    row = {
                        "seq_len": seq_len,
                        "top_k": top_k,
                        "dtype": dtype_name,
                        "dense_cpu_s": dense_s,
                        "focus_cpu_s": focus_s,
                        "speedup": dense_s / focus_s,
                        "torch_path_cpu_s": torch_s,
                        "torch_path_speedup": dense_s / torch_s,
                        "kernels_over_torch_path": torch_s / focus_s,
                        "ideal_speedup": seq_len * (seq_len + 1) / 2 / allowed,
                        "dense_ns_per_pair_head": dense_s / pair_heads * 1e9,
                        "set_a_cpu_s": part_s.get("set_a", 0.0),
                        "set_a_pairs_share": set_a_pairs / allowed,
                        "set_a_ns_per_pair_head": part_s.get("set_a", 0.0) / (set_a_pairs * args.heads) * 1e9,
                        "local_cpu_s": part_s.get("local", 0.0),
                        "local_ns_per_pair_head": part_s.get("local", 0.0) / (other_pairs * args.heads) * 1e9,
                        "sinks_cpu_s": part_s.get("sinks", 0.0),
                        "rest_cpu_s": focus_s - sum(part_s.values()),
                        "repeats": rounds,
                        **layer_fields(args),
                        **machine_fields(device),
                        "command": script_command(__file__, argv),
                    }
                    rows.append(row)
                    write_json(options.json, rows)
                    log(
                        f"{dtype_name} {seq_len} top-{top_k}: ns per pair and head - dense "
                        f"{row['dense_ns_per_pair_head']:.2f}, own-group pass {row['set_a_ns_per_pair_head']:.2f}, "
                        f"local "
                        f"{row['local_ns_per_pair_head']:.2f}; speedup {row['speedup']:.2f} (torch path "
                        f"{row['torch_path_speedup']:.2f}), ideal {row['ideal_speedup']:.2f}"
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
