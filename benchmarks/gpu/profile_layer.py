"""Where a Focus prefill's time goes: torch's profiler over `gpu_attention.py`'s layer, summarised by focus_hf line.

One prefill per (length, top-k) of the one-layer Llama-shaped model of `benchmarks/gpu_attention.py` (random weights
and routers) with Focus hard mode, after a warm-up call of the same length (so that compilation is not profiled), is
timed bare, then recorded by `torch.profiler` with Python stacks. The JSON keeps, per call:

- `wall_s` (the bare call) and `profiled_wall_s`;
- `by_focus_line`: device and CPU time grouped by the innermost focus_hf frame that issued each operator (file, line,
  function): which step of the path the time belongs to;
- `top_device_ops` / `top_cpu_ops`: torch's own table rows (operator, calls, self time), most expensive first;
- `syncs`: the calls that wait for the device (`aten::item`, `aten::_local_scalar_dense`, `cudaStreamSynchronize`,
  `cudaDeviceSynchronize`) and how many times each ran.

    python benchmarks/gpu/profile_layer.py --device cuda --lengths 65536 262144 --top-k 1 2 --out profile.json

`--device cpu` runs it in float32 at small sizes (a check of the script; CPU times only).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: gpu_attention's layer

SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def device_time(event) -> float:
    """An event's self time on the device in microseconds (torch >= 2.4 names it device_time, earlier cuda_time)."""
    if hasattr(event, "self_device_time_total"):
        return float(event.self_device_time_total)
    return float(getattr(event, "self_cuda_time_total", 0.0))


def focus_frame(event) -> str:
    """The innermost focus_hf Python frame an event ran in ("focus_hf/path.py(line): function"), or "(outside
    focus_hf)": from the event's recorded stack where torch fills it, else by walking its parents, which with
    `with_stack` include the Python functions' own events."""
    frames = list(getattr(event, "stack", None) or [])
    if not frames:
        parent = event
        while parent is not None:
            frames.append(parent.name)
            parent = parent.cpu_parent
    for frame in frames:
        if "focus_hf/" in frame:
            return frame[frame.index("focus_hf/") :]
    return "(outside focus_hf)"


def summarise(profiler, rows: int) -> dict:
    """The profile's totals by focus_hf line, its most expensive operators and its synchronisations."""
    by_line: dict[str, dict[str, float]] = defaultdict(lambda: {"device_ms": 0.0, "cpu_ms": 0.0, "calls": 0})
    for event in profiler.events():
        if getattr(event, "device_type", None) is not None and "CPU" not in str(event.device_type):
            continue  # a kernel's time is its launching operator's self device time
        line = by_line[focus_frame(event)]
        line["device_ms"] += device_time(event) / 1e3
        line["cpu_ms"] += event.self_cpu_time_total / 1e3
        line["calls"] += 1
    ordered = sorted(by_line.items(), key=lambda item: -(item[1]["device_ms"] + item[1]["cpu_ms"] / 100))
    averages = profiler.key_averages()

    def top(key) -> list[dict]:
        chosen = sorted(averages, key=key, reverse=True)[:rows]
        return [
            {
                "op": event.key,
                "calls": event.count,
                "self_device_ms": round(device_time(event) / 1e3, 3),
                "self_cpu_ms": round(event.self_cpu_time_total / 1e3, 3),
            }
            for event in chosen
        ]

    return {
        "by_focus_line": [{"where": where, **{k: round(v, 3) for k, v in t.items()}} for where, t in ordered[:rows]],
        "top_device_ops": top(device_time),
        "top_cpu_ops": top(lambda event: event.self_cpu_time_total),
        "syncs": {event.key: event.count for event in averages if event.key in SYNC_OPS},
        "device_ms_total": round(sum(device_time(event) for event in averages) / 1e3, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[65536, 262144])
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument(
        "--backend", default="sdpa", help="Focus backend (default sdpa, as gpu_attention.py without flash-attn)"
    )
    parser.add_argument("--rows", type=int, default=25, help="rows kept in each table")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from gpu_attention import error_text, layer_model, write

    import focus_hf
    from focus_hf.attention.hard import path_record
    from focus_hf.commands.bench import provenance

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("benchmarks/gpu/profile_layer.py needs a CUDA GPU with --device cuda; none is available here.")
        return 2
    dtype = torch.bfloat16 if cuda else torch.float32
    model, config, _ = layer_model(
        args.heads, args.kv_heads, args.groups, args.window, max(args.lengths), device, dtype, "sdpa"
    )
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    result = {
        **provenance(device, shlex.join(sys.orig_argv)),
        "benchmark": "torch.profiler over one Focus prefill of gpu_attention.py's layer, by focus_hf line",
        "layer": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": 64, "groups": args.groups,
                  "window": args.window, "backend": args.backend, "dtype": str(dtype).removeprefix("torch.")},
        "rows": [],
    }  # fmt: skip

    def prefill(ids) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for n in args.lengths:
        for top_k in args.top_k:
            row: dict = {"tokens": n, "top_k": top_k}
            try:
                focus_hf.set_routing(model, "hard", top_k=top_k, backend=args.backend)
                ids = torch.randint(0, config.vocab_size, (1, n), device=device)
                with torch.no_grad():
                    prefill(ids)  # compiles what is compiled per shape
                    row["wall_s"] = prefill(ids)
                    with torch.profiler.profile(activities=activities, with_stack=True) as profiler:
                        row["profiled_wall_s"] = prefill(ids)
                row.update(summarise(profiler, args.rows), gpu_path=path_record())
            except Exception as error:  # noqa: BLE001 - one call failing must not lose the others
                row["error"] = error_text(error)
            result["rows"].append(row)
            write(args.out, result)
            brief = {k: row.get(k) for k in ("tokens", "top_k", "wall_s", "device_ms_total", "syncs", "error")}
            print(json.dumps(brief), flush=True)
            for line in row.get("by_focus_line", [])[:12]:
                print(f"    {line['device_ms']:10.3f} ms device {line['cpu_ms']:10.3f} ms cpu {line['calls']:6d}  "
                      f"{line['where']}", flush=True)  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
