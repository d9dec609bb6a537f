"""Hard-mode Focus attention: one call's path, looked up in the table of paths (`paths.PATHS`).

`hard_attention` takes the call's pattern (`pattern.FocusPattern`) and runs it on one entry of the table: the entry
named by `path`, else the backend's choice. Every backend but "auto" runs the first entry of its platform that takes
the call (`paths.default_path`); "auto" runs the entry of the side a measured crossover picks (`crossover`, measured
once per machine and shape through this very function, so that what it times is what runs):

- on the CPU, the pattern as one dense masked call below the crossover, the sparse path above it - in the C kernels or
  in torch operations, whichever was the faster at the nearest length measured (a prefill far longer than any length
  measured runs on both once, timed: `crossover.race_sparse_paths`);
- on CUDA, the base model's attention (torch's flash SDPA) for the queries with fewer keys than the crossover, the GPU
  path for the others: per query, as `FocusConfig.dense_below`, so that "auto" never runs the GPU path where it was
  measured slower than flash SDPA. Without a measurement there (`FOCUS_HF_NO_CALIBRATION`, a failed measurement) every
  query attends as the base model.

On the GPU path no entry that needs verifying runs before `gpu.verify` has shown its kernels exact on that device,
dtype and head shape; where it could not, calls take the reference path (exact, in query chunks: slow, never out of
memory) - under "auto" the base model's attention - as do calls past torch's recompile limit for FlexAttention
(`gpu.flex`), with one printed warning. `fallback_calls` counts them: a figure measured on a fallback is not a Focus
figure. `path_record` says which entries ran.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import replace
from typing import Optional, Union

import torch

from focus_hf.attention import crossover
from focus_hf.attention.backends import canonical_backend, check_backend, check_device
from focus_hf.attention.cpu.grouped_keys import GroupedKeys
from focus_hf.attention.gpu.flex import FlexRecompileLimit, flex_compilations
from focus_hf.attention.gpu.paged_keys import PagedKeys
from focus_hf.attention.gpu.verify import verdicts, verified_kernels
from focus_hf.attention.paths import PATHS, AttentionPath, PathCall, default_path, measured_path, path_platform
from focus_hf.attention.pattern import FocusPattern

# Calls of this process that took the reference path (or, under "auto", the base attention) instead of the GPU path,
# by reason; and the entries that ran this process's calls.
_fallbacks: Counter = Counter()
_ran: Counter = Counter()
_warned: set[str] = set()


def fallback_calls() -> dict[str, int]:
    """How many hard-mode calls of this process ran the exact reference path (under "auto": the base attention)
    instead of the GPU path, by reason: "unverified" (`verify` refused the configuration) and "recompile limit"
    (`gpu.flex.FlexRecompileLimit`)."""
    return dict(_fallbacks)


def paths_run() -> dict[str, int]:
    """How many calls of this process each entry of the table ran (`paths.PATHS`; a call split between the base
    attention and the GPU path counts for both), outside torch.compile graphs."""
    return dict(_ran)


def path_record() -> dict:
    """What ran this process's hard-mode calls, for benchmark rows: the entries of the table (`paths_run`), `verify`'s
    verdicts by configuration, the calls that fell back (`fallback_calls`: a figure measured on a fallback is not a
    Focus figure), and FlexAttention's compilations by kind of call (`gpu.flex.flex_compilations`)."""
    return {
        "paths": paths_run(),
        "verdicts": verdicts(),
        "fallback_calls": fallback_calls(),
        "flex_compilations": flex_compilations(),
    }


def forget_fallbacks() -> None:
    """Reset `fallback_calls` and `paths_run` (benchmarks count per configuration; tests)."""
    _fallbacks.clear()
    _ran.clear()


def _fall_back(reason: str, detail: str = "") -> None:
    _fallbacks[reason] += 1
    if detail and reason not in _warned:
        _warned.add(reason)
        print(f"focus_hf: {detail}; such calls now run the exact reference path (slower).", file=sys.stderr)


def path_kind(
    query_groups: torch.Tensor, key_groups: torch.Tensor, decode: bool, own_group: Optional[bool] = None
) -> str:
    """Which sparse path a call takes (`crossover.KINDS`): "decode", "probe" (a separate query router with
    top_k = 1, `probe_part`), "separate" (one with top_k > 1) or "shared" (queries probe their own key group first;
    `own_group` says so, None: read from the groups)."""
    if decode:
        return "decode"
    if own_group is None:
        own_group = torch.equal(query_groups[..., 0], key_groups[:, key_groups.shape[1] - query_groups.shape[1] :])
    if own_group:
        return "shared"
    return "probe" if query_groups.shape[-1] == 1 else "separate"


def hard_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pattern: FocusPattern,
    *,
    scaling: float,
    backend: str = "auto",
    path: Optional[str] = None,
    key_copy: Optional[Union[list[GroupedKeys], PagedKeys]] = None,
) -> torch.Tensor:
    """Hard-mode Focus attention of one call, on backend "auto", "sdpa", "flash", "gpu-path" or "reference" (see
    `backends`).

    Args:
        query: [batch, heads, q, dim], the last q of the kv tokens.
        key: [batch, kv_heads, kv, dim].
        value: [batch, kv_heads, kv, dim].
        pattern: the call's pattern - groups, sinks, window, the model's mask (`pattern.FocusPattern`).
        scaling: multiplier of q.k.
        backend: "auto", "sdpa", "flash", "gpu-path" or "reference".
        path: the name of the entry of `paths.PATHS` to run, the backend's choice aside (`crossover` times the
            entries so, so that what it times is what runs); None: the backend chooses.
        key_copy: the layer's copy of the distant keys that a one-query decoding step reads instead of gathering:
            the CPU path's group-sorted copies (`grouped_keys`), one per sample, or the GPU path's paged copy of the
            batch (`paged_keys`); None: gather.

    Returns:
        [batch, q, heads, dim]; rows of padding queries are finite and meaningless.
    """
    backend = canonical_backend(backend)
    check_backend(backend, query.device)
    check_device(query.device)
    q_len, kv_len = query.shape[2], key.shape[2]
    if not (isinstance(key_copy, list) and q_len == 1):  # only a step with the group-sorted copies reads the settled
        pattern = pattern.keys_up_to(kv_len)  # groups alone
    call = PathCall(query, key, value, pattern, scaling, key_copy=key_copy)
    on = path_platform(query.device, backend)
    auto = backend == "auto" and path is None
    if backend == "reference" and path is None:
        path = "reference"
    if on == "gpu" and (path is None or PATHS[path].verified):
        kernels = verified_kernels(query, key, backend=backend)
        if kernels is None:  # not shown exact on this device: the exact reference path, under "auto" the base model
            _fall_back("unverified")
            path = "base" if auto else "reference"
        else:
            call = replace(call, kernels=kernels)
    if path is None and PATHS["causal"].takes(call):
        path = "causal"
    if path is not None or not auto:
        return _run(PATHS[path] if path is not None else default_path(call, on), call)
    kind = path_kind(pattern.query_groups, pattern.key_groups, call.decode, pattern.own_group)
    if on == "gpu":
        return _gpu_auto(call, kind)
    side = crossover.auto_path(query, key, pattern.top_k, pattern.num_groups, pattern.window, kind, hard_attention)
    if side == crossover.RACE:
        return crossover.race_sparse_paths(
            query,
            key,
            pattern.top_k,
            pattern.num_groups,
            pattern.window,
            kind,
            lambda sparse: _run(measured_path(call, on, sparse), call),
        )
    return _run(measured_path(call, on, side), call)


def _gpu_auto(call: PathCall, kind: str) -> torch.Tensor:
    """ "auto" on the GPU path: the queries with fewer keys than the measured crossover (`crossover.dense_below`)
    attend as the base model, the others take the GPU path - per query, so that a text gives the same outputs at once
    or in chunks."""
    pattern = call.pattern
    below = crossover.dense_below(
        call.query, call.key, pattern.top_k, pattern.num_groups, pattern.window, kind, hard_attention
    )
    first_keys = call.kv_len - call.q_len + 1  # keys of the call's first query, itself included
    dense = min(max(below - first_keys, 0), call.q_len)
    if dense == call.q_len:
        return _run(PATHS["base"], call)
    if not dense:
        return _run(measured_path(call, "gpu", "sparse"), call)
    seen = call.kv_len - call.q_len + dense  # keys of the base part's last query
    mask = pattern.model_mask
    base = replace(
        call,
        query=call.query[:, :, :dense],
        key=call.key[:, :, :seen],
        value=call.value[:, :, :seen],
        pattern=replace(pattern, model_mask=None if mask is None else mask[..., :dense, :seen]),
    )
    routed = replace(call, query=call.query[:, :, dense:], pattern=pattern.later_queries(dense))
    return torch.cat([_run(PATHS["base"], base), _run(measured_path(routed, "gpu", "sparse"), routed)], dim=1)


def _run(entry: AttentionPath, call: PathCall) -> torch.Tensor:
    """Run `entry` on `call`: a paged copy that the entry does not read misses this call's keys, and is rebuilt when a
    step reads it again; a call past FlexAttention's recompile limit runs the reference path."""
    if isinstance(call.key_copy, PagedKeys) and entry.name != "gpu-paged-decode":
        call.key_copy.invalidate()
    if not torch.compiler.is_compiling():
        _ran[entry.name] += 1
    try:
        return entry.run(call)
    except FlexRecompileLimit as error:
        if isinstance(call.key_copy, PagedKeys):
            call.key_copy.invalidate()
        _fall_back("recompile limit", str(error))
        return PATHS["reference"].run(call)
