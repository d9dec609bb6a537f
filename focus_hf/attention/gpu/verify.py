"""Show a device's fast paths exact before they run there; otherwise fall back to the reference path, and say so once.

The fast paths depend on what their kernels return - each kernel's log-sum-exp base and layout, its answer for a row
without visible keys, which blocks of a FlexAttention block mask it reads - and those are facts about one torch /
flash-attn build on one device, not promises: torch's CUDA memory-efficient kernel, for one, answers an empty row
with log-sum-exp 0.0 where the CPU kernel answers finfo.min, which once made merged results wrong on CUDA only. So
before the first call with a new (device, dtype, head shape), `verified_kernels` runs each kernel the path will use
on small inputs whose answers are known (float64 on the same inputs), rows without keys and sequences shorter than
their keys included, and the whole GPU path on two small routed cases against the dense oracle. A failure is
printed once, naming what differed, and every later call of that configuration takes the reference path (exact,
dense, slow) instead of returning unverified numbers. The check costs well under a second plus the kernels' first
compilation, once per process and configuration.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from focus_hf.attention.backends import cuda_sdpa_kernel
from focus_hf.attention.gpu.block_masks import BLOCK, check_block_lists, full_blocks_visible
from focus_hf.attention.gpu.cpu_standins import varlen_attention_standin
from focus_hf.attention.gpu.gpu_path import gpu_sparse_attention, pattern_attention
from focus_hf.attention.gpu.kernels import NEG, GpuKernels, gpu_kernels, standin_flex, standin_kernels
from focus_hf.attention.gpu.window import window_attention
from focus_hf.attention.pattern import allowed_pairs, probes
from focus_hf.attention.reference import dense_attention

# Largest absolute difference from the float64 answer a check accepts, by input dtype (outputs are O(1)).
TOLERANCE = {torch.float64: 1e-6, torch.float32: 2e-3, torch.bfloat16: 4e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class Configuration:
    """What a verdict holds for: one kernel set, device, dtype and head shape (query heads per kv head, head dim; the
    checks run two kv heads, which covers any number: heads are independent in every kernel)."""

    kernels: str
    device: str
    dtype: torch.dtype
    per_kv: int
    head_dim: int

    @property
    def heads(self) -> int:
        return 2 * self.per_kv

    @property
    def kv_heads(self) -> int:
        return 2


# Verdicts of this process: None (exact) or what failed.
_verdicts: dict[Configuration, Optional[str]] = {}
# Configurations whose windowed varlen call was not exact, and how: their window band takes `bands` (still the GPU
# path).
_window_failures: dict[Configuration, str] = {}


def configuration(query: torch.Tensor, key: torch.Tensor, kernels: GpuKernels) -> Configuration:
    per_kv = query.shape[1] // key.shape[1]
    return Configuration(kernels.name, str(query.device), query.dtype, per_kv, query.shape[-1])


def is_verified(device: torch.device, dtype: torch.dtype, per_kv: int, head_dim: int, backend: str = "auto") -> bool:
    """Whether this process holds a verdict for a call of this shape (cheap: one dictionary lookup)."""
    kernels = gpu_kernels(device, backend)
    return Configuration(kernels.name, str(device), dtype, per_kv, head_dim) in _verdicts


@torch.compiler.disable
def verify_shape(device: torch.device, dtype: torch.dtype, per_kv: int, head_dim: int, backend: str = "auto") -> None:
    """Reach a verdict for calls of this shape now, outside any torch.compile graph: `tuner.layer` calls it before
    the attention function runs, so that a compiled model's attention finds the verdict and never breaks its graph."""
    query = torch.zeros(1, per_kv, 1, head_dim, device=device, dtype=dtype)
    key = torch.zeros(1, 1, 1, head_dim, device=device, dtype=dtype)
    verified_kernels(query, key, backend=backend)


def verified_kernels(
    query: torch.Tensor, key: torch.Tensor, kernels: Optional[GpuKernels] = None, backend: str = "auto"
) -> Optional[GpuKernels]:
    """The GPU path's kernels for this call's configuration once shown exact (checked on first use), else None:
    the caller then runs the reference path. `kernels`: the kernels to check and use (default: those of the device
    and `backend`, `kernels.gpu_kernels`)."""
    kernels = kernels or gpu_kernels(query.device, backend)
    config = configuration(query, key, kernels)
    if config not in _verdicts:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "focus_hf checks its GPU path on each device before using it, which cannot run inside torch.compile: "
                "run one forward call (or `focus_hf.set_routing`) before compiling the model."
            )
        window_failure = check(kernels, config, checks=(check_window,))
        if window_failure is not None:
            _window_failures[config] = window_failure
        failure = check(_checked(kernels, config), config)
        _verdicts[config] = failure
        if failure is None and window_failure is not None:
            print(
                f"focus_hf: the sliding-window variable-length call was not exact on {config.device} "
                f"({config.kernels}, {config.dtype}): {window_failure}. The window band of the GPU path runs in plain "
                "torch there instead (exact, slower). Please report this with your torch version.",
                file=sys.stderr,
            )
        if failure is not None:
            print(
                f"focus_hf: the fast Focus attention path did not reproduce exact results on {config.device} "
                f"({config.kernels}, {config.dtype}, {config.per_kv} query heads per kv head of {config.head_dim}): "
                f"{failure}. Every "
                "call of this kind now runs the reference path (exact, dense, slower). Please report this with your "
                "torch version.",
                file=sys.stderr,
            )
    return _checked(kernels, config) if _verdicts[config] is None else None


def _checked(kernels: GpuKernels, config: Configuration) -> GpuKernels:
    """`kernels` less the windowed varlen call where it was not exact for `config`."""
    return replace(kernels, varlen_window=False) if config in _window_failures else kernels


def verify(
    query: torch.Tensor, key: torch.Tensor, kernels: Optional[GpuKernels] = None, backend: str = "auto"
) -> Optional[str]:
    """Check now (or read this process's verdict): None when exact, else what failed."""
    kernels = kernels or gpu_kernels(query.device, backend)
    verified_kernels(query, key, kernels)
    return _verdicts[configuration(query, key, kernels)]


def verdicts() -> dict[str, str]:
    """This process's verdicts, for benchmark rows: "exact", or what failed, by configuration ("kernels, device,
    dtype, query heads per kv head x head dim")."""
    return {
        f"{config.kernels}, {config.device}, {str(config.dtype).removeprefix('torch.')}, "
        f"{config.per_kv}x{config.head_dim}": failure
        or ("exact" if config not in _window_failures else f"exact, window band in torch ({_window_failures[config]})")
        for config, failure in _verdicts.items()
    }


def forget_verdicts() -> None:
    """Drop this process's verdicts (tests)."""
    _verdicts.clear()
    _window_failures.clear()


def _differs(name: str, actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> Optional[str]:
    difference = (actual.double() - expected.double()).abs()
    worst = float(difference.max()) if difference.numel() else 0.0
    if not worst <= tolerance:  # also catches NaN
        return f"{name} differs by {worst:.3g} (tolerance {tolerance:g})"
    return None


def _states(generator: torch.Generator, config: Configuration, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(config.device, config.dtype)


# The routed cases' groups, window and sinks.
CASE_GROUPS, CASE_WINDOW, CASE_SINKS = 4, 19, 3


def _routed_case(
    generator: torch.Generator, config: Configuration, length: int, q_len: int, top_k: int, separate: bool
):
    """Inputs of the GPU path on a small routed case - left padding, sinks, queries after a cache - and the pairs the
    pattern allows there: (query, key, value, valid, query_groups, key_groups, sink, allowed [batch, q, kv])."""
    batch = 2
    query = _states(generator, config, batch, config.heads, q_len, config.head_dim)
    key = _states(generator, config, batch, config.kv_heads, length, config.head_dim)
    value = _states(generator, config, batch, config.kv_heads, length, config.head_dim)
    scores = torch.rand(batch, length, CASE_GROUPS, generator=generator)
    query_groups = scores.argsort(dim=-1, descending=True)[..., :top_k]
    key_groups = torch.randint(CASE_GROUPS, (batch, length), generator=generator) if separate else query_groups[..., 0]
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[0, :21] = False
    sink = valid & (valid.cumsum(dim=1) - 1 < CASE_SINKS)
    positions = torch.arange(length)
    query_groups = query_groups[:, length - q_len :]
    allowed = allowed_pairs(query_groups, key_groups, sink, positions[length - q_len :], positions, CASE_WINDOW)
    allowed = allowed & (positions[length - q_len :, None] >= positions)[None] & valid[:, None, :]
    device = torch.device(config.device)
    routing = tuple(tensor.to(device) for tensor in (valid, query_groups, key_groups, sink))
    return (query, key, value, *routing, allowed.to(device))


def check_flex(kernels: GpuKernels, config: Configuration, generator: torch.Generator) -> Optional[str]:
    """FlexAttention on the block masks the path itself builds - the own-group pass over sorted keys and entries with
    full blocks (an entry of a group with no earlier key sees none), the whole pattern with full blocks, lengths off the
    block size - each checked against the contract first (`block_masks`), then run on the device's kernel and compared
    with FlexAttention's CPU stand-in, rows without visible keys included."""
    recorded: list[tuple] = []
    standins = standin_kernels()

    def record(query, key, value, blocks, scale):
        recorded.append((query, key, value, blocks, scale))
        return standins.raw_flex(query, key, value, blocks, scale)

    recorder = replace(standins, name="recorder", raw_flex=record, raw_varlen=None)
    length = BLOCK + 72
    for top_k, separate in ((1, False), (2, True)):
        query, key, value, valid, query_groups, key_groups, sink, _ = _routed_case(
            generator, config, length, length, top_k, separate
        )
        arguments = (query_groups, key_groups, sink, CASE_GROUPS, CASE_WINDOW, query.shape[-1] ** -0.5, recorder)
        gpu_sparse_attention(query, key, value, valid, *arguments, not separate)
        pattern_attention(query, key, value, valid, query_groups, key_groups, sink, CASE_WINDOW, arguments[5], recorder)
    tolerance = TOLERANCE.get(config.dtype, 4e-2)
    has_empty_row = False
    for query, key, value, blocks, scale in recorded:
        check_block_lists(blocks)
        hidden = full_blocks_visible(blocks)
        if hidden:
            return f"a full block hides pairs: {hidden}"
        output, lse = kernels.flex(query, key, value, blocks, scale)
        expected, expected_lse = standin_flex(query, key, value, blocks, scale)
        empty = expected_lse == float("-inf")
        has_empty_row = has_empty_row or bool(empty.any())
        if not (bool((lse[empty] <= NEG / 2).all()) and bool((output.masked_select(empty[..., None]) == 0).all())):
            return "FlexAttention: a row without visible keys is not (output 0, log-sum-exp -inf)"
        failure = _differs("FlexAttention output", output, expected, tolerance) or _differs(
            "FlexAttention log-sum-exp", lse[~empty], expected_lse[~empty], tolerance
        )
        if failure:
            return failure
    if not has_empty_row:
        return "the flex check has no empty row (a bug in the check)"
    return None


def check_varlen(
    kernels: GpuKernels, config: Configuration, generator: torch.Generator, window: int = -1
) -> Optional[str]:
    """Sequences of fewer queries than keys (bottom-right causal), one without queries, one of a single token; with
    `window` >= 0 within a sliding window (the window band's calls), whose bounds the stand-in states as flash
    attention's."""
    if not kernels.runs_varlen(config.dtype):
        return None
    device = torch.device(config.device)
    query_lengths, key_lengths = [70, 0, 1, 130], [70, 9, 1, 200]
    cu_q = torch.tensor([0, *torch.tensor(query_lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(key_lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    query = _states(generator, config, sum(query_lengths), config.heads, config.head_dim)
    key = _states(generator, config, sum(key_lengths), config.kv_heads, config.head_dim)
    value = _states(generator, config, sum(key_lengths), config.kv_heads, config.head_dim)
    arguments = (cu_q, cu_k, max(query_lengths), max(key_lengths))
    scale = config.head_dim**-0.5
    output, lse = kernels.varlen(query, key, value, *arguments, scale, window)
    expected, expected_lse = varlen_attention_standin(
        query, key, value, *arguments, scale=scale, gqa=True, window=window
    )
    tolerance = TOLERANCE.get(config.dtype, 4e-2)
    name = "varlen" if window < 0 else f"varlen within a window of {window}"
    return _differs(f"{name} output", output, expected, tolerance) or _differs(
        f"{name} log-sum-exp", lse, expected_lse.transpose(0, 1), tolerance
    )


def check_masked_kernel(kernels: GpuKernels, config: Configuration, generator: torch.Generator) -> Optional[str]:
    """torch's CUDA memory-efficient kernel, as the masked and decoding paths call it: a bias that hides every key of
    some rows, GQA, fewer queries than keys."""
    if not config.device.startswith("cuda"):
        return None
    q_len, kv_len = 40, 75
    query = _states(generator, config, 2, config.heads, q_len, config.head_dim)
    key = _states(generator, config, 2, config.kv_heads, kv_len, config.head_dim)
    value = _states(generator, config, 2, config.kv_heads, kv_len, config.head_dim)
    visible = torch.rand(2, 1, q_len, kv_len, generator=generator) < 0.3
    visible[:, :, :3] = False
    bias = torch.where(visible, 0.0, torch.finfo(config.dtype).min).to(config.device, config.dtype)
    scale = config.head_dim**-0.5
    output, lse = cuda_sdpa_kernel(query, key, value, causal=False, bias=bias, scale=scale)
    expected = dense_attention(query.double(), key.double(), value.double(), visible.to(config.device), scaling=scale)
    tolerance = TOLERANCE.get(config.dtype, 4e-2)
    rows = visible.any(dim=-1).expand(2, config.heads, q_len).to(config.device)
    if not bool((lse[~rows] <= NEG / 2).all()):
        return "memory-efficient kernel: a row without visible keys keeps a real log-sum-exp"
    return _differs(
        "memory-efficient output",
        output.transpose(1, 2)[rows.transpose(1, 2)],
        expected[rows.transpose(1, 2)],
        tolerance,
    )


def check_path(kernels: GpuKernels, config: Configuration, generator: torch.Generator) -> Optional[str]:
    """The whole GPU path on two routed cases - own-group top-1, and top-2 from a separate query router - with
    left padding, sinks and queries after a cache, against the dense oracle."""
    length = BLOCK + 37
    # Both with at least two blocks of queries and of keys, as most calls are (torch compiles a size of one apart).
    for top_k, separate, q_len in ((1, False, length), (2, True, length - 30)):
        query, key, value, valid, query_groups, key_groups, sink, allowed = _routed_case(
            generator, config, length, q_len, top_k, separate
        )
        scale = config.head_dim**-0.5
        output = gpu_sparse_attention(
            query,
            key,
            value,
            valid,
            query_groups,
            key_groups,
            sink,
            CASE_GROUPS,
            CASE_WINDOW,
            scale,
            kernels,
            not separate,
        )
        expected = dense_attention(query.double(), key.double(), value.double(), allowed[:, None], scaling=scale)
        rows = valid[:, length - q_len :]
        failure = _differs(
            f"the GPU path (top-{top_k})", output[rows], expected[rows], TOLERANCE.get(config.dtype, 4e-2)
        )
        if failure:
            return failure
    return None


def check_window(kernels: GpuKernels, config: Configuration, generator: torch.Generator) -> Optional[str]:
    """The window band's calls (`window`), where the kernels would take them: the windowed varlen call, then the band
    as a whole - its sliding-window call and its sinks' call over packed indicator columns - on a routed case (left
    padding, sinks, queries after a cache) against the dense oracle of the band's pairs."""
    if not kernels.runs_window(config.dtype):
        return None
    failure = check_varlen(kernels, config, generator, window=CASE_WINDOW)
    if failure:
        return failure
    length = BLOCK + 37
    query, key, value, valid, query_groups, key_groups, sink, allowed = _routed_case(
        generator, config, length, length - 30, 2, True
    )
    band = allowed & ~probes(query_groups, key_groups)  # the allowed pairs of unprobed groups: near ones and sinks
    scale = config.head_dim**-0.5
    output = torch.empty_like(query)
    lse = torch.empty(query.shape[:3], dtype=torch.float32, device=query.device)
    routing = (query_groups, key_groups, sink, CASE_GROUPS, CASE_WINDOW, scale, kernels)
    window_attention(output, lse, query, key, value, valid, *routing, sink_slots=CASE_SINKS)
    expected = dense_attention(query.double(), key.double(), value.double(), band[:, None], scaling=scale)
    rows = band.any(dim=-1) & valid[:, length - query.shape[2] :]
    if not bool((lse.transpose(1, 2)[~band.any(dim=-1)] == NEG).all()):
        return "the window band: a row without a pair of the band keeps a real log-sum-exp"
    name = "the window band (windowed and sinks' varlen calls)"
    return _differs(name, output.transpose(1, 2)[rows], expected[rows], TOLERANCE.get(config.dtype, 4e-2))


CHECKS: tuple[Callable[..., Optional[str]], ...] = (check_masked_kernel, check_flex, check_varlen, check_path)


def check(
    kernels: GpuKernels, config: Configuration, checks: tuple[Callable[..., Optional[str]], ...] = CHECKS
) -> Optional[str]:
    """Run `checks` on `config` (seeded); None when all pass, else the first failure (an exception counts)."""
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            failure = None
            for run in checks:
                failure = failure or run(kernels, config, generator)
    except Exception as error:  # a kernel that cannot run this configuration is not exact here
        return f"{type(error).__name__}: {error}"
    return failure
