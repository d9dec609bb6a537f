"""Where a Focus prefill's time goes: torch's profiler over `layer_prefill.py`'s layer, summarised by focus_hf line.

One prefill per (length, top-k) of the one-layer Llama-shaped model of `benchmarks/gpu/layer_prefill.py` (random weights
and routers) with Focus hard mode, after a warm-up call of the same length (so that compilation is not profiled), is
timed bare, then recorded by `torch.profiler` with Python stacks. The JSON keeps, per call:

- `wall_s` (the bare call) and `profiled_wall_s`;
- `by_focus_line`: device and CPU time grouped by the innermost focus_hf frame that issued each operator (file, line,
  function): which step of the path the time belongs to;
- `top_device_ops` / `top_cpu_ops`: torch's own table rows (operator, calls, self time), most expensive first;
- `syncs`: the calls that wait for the device (`aten::item`, `aten::_local_scalar_dense`, `cudaStreamSynchronize`,
  `cudaDeviceSynchronize`) and how many times each ran.

The Python stacks torch records are empty on some CUDA builds (torch 2.11 on the H200: every operator came out
"(outside focus_hf)"), so during the profiled call every focus_hf function is also wrapped in a `record_function`
range named after it (`labelled_functions`), and an operator belongs to the innermost range around it.

On CUDA, `--mask-costs` then times the own-group pass's FlexAttention call of a top-2 prefill
(`gpu_path.fold_probed_groups`) with the same block lists under other `mask_mod`s (`MASK_VARIANTS`): how much of the
kernel's time its mask takes. (At commit 432b95d it timed the window band's call, which reading the pattern in its mask
made 50 times slower than a mask of the indices alone: the window band now runs in plain torch,
`focus_hf/attention/gpu/bands.py`.)

    python benchmarks/gpu/profile_layer.py --device cuda --lengths 65536 262144 --top-k 1 2 --out profile.json

`--device cpu` runs it in float32 at small sizes (a check of the script; CPU times only).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Optional

SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def device_time(event) -> float:
    """An event's self time on the device in microseconds (torch >= 2.4 names it device_time, earlier cuda_time)."""
    if hasattr(event, "self_device_time_total"):
        return float(event.self_device_time_total)
    return float(getattr(event, "self_cuda_time_total", 0.0))


UNREADABLE = "(a name torch recorded as invalid UTF-8)"


def readable(read: Callable[[], Any]) -> Any:
    """`read()`, or UNREADABLE where torch's profiler hands back a name that is not valid UTF-8 (seen once on the
    CPU: one row of a profile lost to a UnicodeDecodeError)."""
    try:
        return read()
    except UnicodeDecodeError:
        return UNREADABLE


def focus_frame(event) -> str:
    """The innermost focus_hf Python frame an event ran in ("focus_hf/path.py(line): function"), or "(outside
    focus_hf)": from the event's recorded stack where torch fills it, else from the ranges around it (its parents:
    the Python functions' own events with `with_stack`, and `labelled_functions`' ranges)."""
    frames = list(readable(lambda: getattr(event, "stack", None) or []))
    parent = event
    while parent is not None:  # after the stack: the ranges around the event, `labelled_functions`' among them
        frames.append(readable(lambda: parent.name))
        parent = parent.cpu_parent
    for frame in frames:
        if "focus_hf/" in frame:
            return frame[frame.index("focus_hf/") :]
    return "(outside focus_hf)"


# Modules whose functions run inside torch.compile (FlexAttention's compiled calls): a record_function there would
# break the graph that `fullgraph=True` requires.
UNLABELLED_MODULES = ("focus_hf.attention.gpu.flex",)


@contextlib.contextmanager
def labelled_functions():
    """Every module-level focus_hf function, wherever a focus_hf module holds it, wrapped in a `record_function` named
    "focus_hf/<module path>.py: <function>" while the context is open; restored after."""
    import types

    import torch

    def wrap(function):
        label = f"{function.__module__.replace('.', '/')}.py: {function.__qualname__}"

        @functools.wraps(function)
        def labelled(*args, **kwargs):
            with torch.profiler.record_function(label):
                return function(*args, **kwargs)

        return labelled

    wrapped, replaced = {}, []
    for name, module in list(sys.modules.items()):
        if not name.startswith("focus_hf") or name.startswith(UNLABELLED_MODULES) or module is None:
            continue
        for attribute, value in list(vars(module).items()):
            home = getattr(value, "__module__", None) or ""  # None for a function made by exec (seen in CI)
            if (
                isinstance(value, types.FunctionType)
                and home.startswith("focus_hf")
                and not home.startswith(UNLABELLED_MODULES)
            ):
                if value not in wrapped:
                    wrapped[value] = wrap(value)
                setattr(module, attribute, wrapped[value])
                replaced.append((module, attribute, value))
    try:
        yield
    finally:
        for module, attribute, value in replaced:
            setattr(module, attribute, value)


def profiled(prefill: Callable[[], float], activities: list, rows: int, profile: Optional[Callable] = None) -> dict:
    """One prefill under torch's profiler (`profile`, default torch.profiler.profile) with `labelled_functions`,
    summarised (`summarise`), with its wall time (`profiled_wall_s`), the try that gave it (`profile_tries`) and
    whether it recorded Python stacks. torch's profiler has now and then handed back invalid UTF-8 on the CPU - in a
    name, or while it turned its results into events, where `readable` cannot reach (two CI runs lost the row so):
    such a profile is taken again, the third time without Python stacks (the labelled ranges still place each
    operator in its focus_hf function)."""
    import torch

    profile = profile or torch.profiler.profile
    failure: Optional[UnicodeDecodeError] = None
    for tries, with_stack in enumerate((True, True, False), start=1):
        try:
            with labelled_functions(), profile(activities=activities, with_stack=with_stack) as profiler:
                wall_s = prefill()
            summary = summarise(profiler, rows)
        except UnicodeDecodeError as error:
            failure = error
            continue
        return {"profiled_wall_s": wall_s, **summary, "profile_tries": tries, "with_stack": with_stack}
    raise failure


def summarise(profiler, rows: int) -> dict:
    """The profile's totals by focus_hf line, its most expensive operators and its synchronisations."""
    by_line: dict[str, dict[str, float]] = defaultdict(lambda: {"device_ms": 0.0, "cpu_ms": 0.0, "calls": 0})
    for event in profiler.events():
        if getattr(event, "device_type", None) is not None and "CPU" not in str(event.device_type):
            continue  # a kernel's time is its launching operator's self device time
        if readable(lambda: event.name).startswith("focus_hf/"):
            continue  # a label's range (`labelled_functions`): its operators carry the time
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
                "op": readable(lambda: event.key),
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
        "syncs": {key: event.count for event in averages if (key := readable(lambda: event.key)) in SYNC_OPS},
        # From the launching operators only: torch's table lists each kernel's time twice (the kernel, its operator).
        "device_ms_total": round(sum(line["device_ms"] for line in by_line.values()), 3),
    }


def diagonal_mask(captured):
    """A mask from the indices alone (loads nothing): not the own-group pass's answer, a floor on the same block
    lists."""

    def mask_mod(b, h, q_index, kv_index):
        return kv_index <= q_index

    return mask_mod


def no_mask(captured):
    """Every pair of the listed blocks: the kernel's own cost on these block lists."""

    def mask_mod(b, h, q_index, kv_index):
        return q_index >= 0

    return mask_mod


def rule_mask_of(captured):
    """The own-group pass's pairs read by `pair_rule.rule_mask` (seven loads per pair), as the path ran them up to
    commit 432b95d."""
    from focus_hf.attention.gpu.pair_rule import rule_mask

    return rule_mask(captured["rule"])


# name -> (what it is, the mask_mod built from the captured call; None: the call's own)
MASK_VARIANTS = {
    "path": ("the path's own: each entry's range of sorted keys, `pair_rule.range_mask` (2 loads per row)", None),
    "rule": ("the same pairs by `pair_rule.rule_mask` (7 loads per pair, int64, the model's-mask term)", rule_mask_of),
    "diagonal": ("kv <= q from the indices alone (loads nothing; a floor, not the own-group pass)", diagonal_mask),
    "none": ("every pair of the listed blocks (the kernel's floor on these lists)", no_mask),
}


def capture_own_group_pass(n: int, heads: int, kv_heads: int, groups: int, window: int, device, dtype, kernels) -> dict:
    """One top-2 prefill of `gpu_path.gpu_sparse_attention` on random routing, recording the own-group pass's
    FlexAttention call (`fold_probed_groups`): its inputs and block lists, and the `pair_rule` rule of the same
    pairs."""
    import dataclasses

    import torch

    import focus_hf.attention.gpu.gpu_path as gpu_path

    captured: dict = {}
    generator = torch.Generator(device=device).manual_seed(n)
    query = torch.randn(1, heads, n, 64, device=device, dtype=dtype, generator=generator)
    key, value = (torch.randn(1, kv_heads, n, 64, device=device, dtype=dtype, generator=generator) for _ in "kv")
    scores = torch.rand(1, n, groups, device=device, generator=generator)
    query_groups = scores.argsort(dim=-1, descending=True)[..., :2]
    key_groups = query_groups[..., 0]
    key_sink = torch.arange(n, device=device)[None] < 4

    def record_flex(query, key, value, blocks, scale):
        captured.update(call=(query, key, value, blocks, scale))
        return kernels.raw_flex(query, key, value, blocks, scale)

    recorder = dataclasses.replace(kernels, raw_flex=record_flex)
    arguments = (query, key, value, None, query_groups, key_groups, key_sink, groups, window, 64**-0.5, recorder, False)
    gpu_path.gpu_sparse_attention(*arguments)
    call = captured["call"]
    # The same call with a model's mask (all True, broadcast from one element) builds the own-group pass by `rule_mask`:
    # its rule.
    real_rule = gpu_path.make_rule

    def record_rule(*args):
        captured["rule"] = real_rule(*args)
        return captured["rule"]

    gpu_path.make_rule = record_rule
    try:
        everywhere = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        gpu_path.gpu_sparse_attention(*arguments[:-1], False, everywhere)
    finally:
        gpu_path.make_rule = real_rule
    captured["call"] = call
    return captured


def mask_costs(
    lengths, heads: int, kv_heads: int, groups: int, window: int, device, dtype, repeats: int = 3, backend="inductor"
) -> list:
    """The own-group pass's FlexAttention call of a top-2 prefill (`gpu_path.fold_probed_groups`) at each length, its
    block lists fixed, under each `MASK_VARIANTS` mask_mod: seconds per call (best of `repeats`, after a compiling
    call). `backend`: torch.compile's ("eager" rehearses it on the CPU, on FlexAttention's reference and the twin's
    kernels)."""
    import dataclasses

    import torch

    from focus_hf.attention.gpu.flex import run_compiled
    from focus_hf.attention.gpu.kernels import standin_kernels
    from focus_hf.attention.gpu.verify import gpu_kernels
    from focus_hf.benchmarking.records import error_text

    kernels = gpu_kernels(device) if device.type == "cuda" else standin_kernels()
    # Each variant is a new mask code, compiled apart: more compilations than the path's own bound allows.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 256)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed(function) -> float:
        best = float("inf")
        for _ in range(repeats):
            synchronize()
            start = time.perf_counter()
            function()
            synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    rows = []
    for n in lengths:
        row: dict = {"tokens": n, "top_k": 2, "variants": {}}
        try:
            captured = capture_own_group_pass(n, heads, kv_heads, groups, window, device, dtype, kernels)
        except Exception as error:  # noqa: BLE001 - reported in the row
            row["error"] = error_text(error)
            rows.append(row)
            continue
        query, key, value, blocks, scale = captured["call"]
        row["entries"] = blocks.q_len
        row["max_difference_from_path"] = {}
        expected = None
        for name, (_, make) in MASK_VARIANTS.items():
            variant = blocks if make is None else dataclasses.replace(blocks, mask_mod=make(captured))
            call = functools.partial(run_compiled, "full", query, key, value, variant, scale, backend=backend)
            try:
                output, _ = call()  # compiles this mask's code
                expected = output if make is None else expected
                if expected is not None:  # the rule gives the same pairs: 0 apart
                    difference = (output.float() - expected.float()).abs().max()
                    row["max_difference_from_path"][name] = float(difference)
                row["variants"][name] = timed(call)
            except Exception as error:  # noqa: BLE001 - one variant failing must not lose the others
                row["variants"][name] = error_text(error)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


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
        "--backend", default="sdpa", help="Focus backend (default sdpa, as layer_prefill.py without flash-attn)"
    )
    parser.add_argument("--rows", type=int, default=25, help="rows kept in each table")
    parser.add_argument(
        "--mask-costs", type=int, nargs="*", default=[], metavar="TOKENS",
        help="CUDA: also time the own-group pass's FlexAttention call (top-2) under each MASK_VARIANTS mask_mod at "
        "these lengths",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from layer_prefill import layer_model  # this script's folder

    import focus_hf
    from focus_hf.attention.hard import path_record
    from focus_hf.benchmarking.records import error_text, provenance, write_json

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
        "benchmark": "torch.profiler over one Focus prefill of layer_prefill.py's layer, by focus_hf line",
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
                    row.update(profiled(functools.partial(prefill, ids), activities, args.rows))
                row["gpu_path"] = path_record()
            except Exception as error:  # noqa: BLE001 - one call failing must not lose the others
                row["error"] = error_text(error)
            result["rows"].append(row)
            write_json(args.out, result)
            brief = {k: row.get(k) for k in ("tokens", "top_k", "wall_s", "device_ms_total", "syncs", "error")}
            print(json.dumps(brief), flush=True)
            for line in row.get("by_focus_line", [])[:12]:
                print(f"    {line['device_ms']:10.3f} ms device {line['cpu_ms']:10.3f} ms cpu {line['calls']:6d}  "
                      f"{line['where']}", flush=True)  # fmt: skip
    if args.mask_costs and cuda:
        result["mask_variants"] = {name: what for name, (what, _) in MASK_VARIANTS.items()}
        result["mask_costs"] = mask_costs(
            args.mask_costs, args.heads, args.kv_heads, args.groups, args.window, device, dtype
        )
        write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
