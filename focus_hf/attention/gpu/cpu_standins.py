"""CPU stand-ins of the CUDA attention kernels: the same arguments, the same results and the same conventions.

The GPU path (`gpu_path`) is built from kernels that only run on CUDA, and the conventions it depends on - what a row
without any visible key returns, the log-sum-exp's base and layout, which blocks of a FlexAttention block mask are
read - are the kernels' own. Each stand-in below reproduces one kernel's conventions in plain float64 torch, as
measured on the kernel (and re-checked on every CUDA machine by `verify` and tests/attention/gpu/test_cuda.py), so that
CI runs the GPU path's logic exactly on the CPU. They are slow (dense scores, one pass per segment) and meant for
tests and for `backend="gpu-path"` on CPU.

- `flex_attention_standin`: FlexAttention's forward as the compiled kernel runs it: only the key blocks a query
  block lists are read, `mask_mod` is applied in the partial blocks and not in the full ones, a row without a
  visible key gets output 0 and log-sum-exp -inf (natural log), GQA by `enable_gqa`. (Eager flex_attention on CPU
  evaluates `mask_mod` over every pair and ignores the block lists, so it cannot stand in for the kernel.)
- `varlen_attention_standin`: `torch.nn.attention.varlen.varlen_attn` / flash-attn's `flash_attn_varlen_func`:
  packed [tokens, heads, dim], one sequence per `cu_seq` range, causal aligned to the bottom right when a sequence
  has fewer queries than keys, a sliding window of `window` keys before each query's own (flash-attn's
  `window_size=(window, 0)`: keys r + Lk - Lq - window .. r + Lk - Lq), log-sum-exp [heads, tokens]; without `gqa`
  (torch 2.11) the heads must match.
- `efficient_attention_standin`: torch's CUDA memory-efficient kernel (`_scaled_dot_product_efficient_attention`):
  log-sum-exp padded to a multiple of 32 queries, and a row whose keys are all hidden by the bias returns output 0
  and log-sum-exp 0.0 (not -inf) - the convention that made merged partials wrong on CUDA.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

# The memory-efficient kernel pads its log-sum-exp to this many queries.
EFFICIENT_LSE_ALIGNMENT = 32


def _softmax_parts(scores: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 weights, log-sum-exp (natural log, -inf for rows without a visible key) and which rows have one."""
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    has_key = visible.any(dim=-1)
    weights = torch.where(has_key[..., None], torch.exp(scores - lse[..., None].clamp_min(-1e300)), 0.0)
    return weights, lse, has_key


def block_visibility(
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    q_len: int,
    kv_len: int,
    block_size: int,
) -> torch.Tensor:
    """Bool [batch, heads or 1, q_len, kv_len]: the pairs inside the key blocks each query block lists (the first
    kv_num_blocks[..., q_block] entries of kv_indices[..., q_block, :])."""
    *lead, q_blocks, width = kv_indices.shape
    listed = torch.arange(width, device=kv_indices.device) < kv_num_blocks[..., None]
    kv_blocks = -(-kv_len // block_size)
    blocks = torch.zeros(*lead, q_blocks, kv_blocks + 1, dtype=torch.bool, device=kv_indices.device)
    # Unlisted entries go to a spare column that is dropped.
    index = torch.where(listed, kv_indices.long().clamp(0, kv_blocks - 1), kv_blocks)
    blocks.scatter_(-1, index, True)
    blocks = blocks[..., :kv_blocks]
    pairs = blocks.repeat_interleave(block_size, dim=-2).repeat_interleave(block_size, dim=-1)
    return pairs[..., :q_len, :kv_len]


def flex_attention_standin(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    full_kv_num_blocks: Optional[torch.Tensor],
    full_kv_indices: Optional[torch.Tensor],
    mask_mod: Callable,
    block_size: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's forward with a block mask given by its block lists ([batch, 1, q_blocks] counts and
    [batch, 1, q_blocks, width] indices), GQA enabled. Returns output [batch, heads, q, dim] in the query's dtype and
    float32 log-sum-exp [batch, heads, q] in the kernel's conventions (see the module docstring)."""
    batch, heads, q_len, _ = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    device = query.device
    partial = block_visibility(kv_num_blocks, kv_indices, q_len, kv_len, block_size)
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q_index = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv_index = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    visible = partial & mask_mod(b, h, q_index, kv_index)
    if full_kv_num_blocks is not None:
        full = block_visibility(full_kv_num_blocks, full_kv_indices, q_len, kv_len, block_size)
        visible = visible | full  # full blocks are read without mask_mod
    repeats = heads // kv_heads
    keys = key.double().repeat_interleave(repeats, dim=1)
    values = value.double().repeat_interleave(repeats, dim=1)
    scores = (query.double() @ keys.transpose(-1, -2)) * scale
    weights, lse, _ = _softmax_parts(scores, visible.expand(batch, heads, q_len, kv_len))
    return (weights @ values).to(query.dtype), lse.float()


def varlen_attention_standin(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float,
    gqa: bool = False,
    window: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal variable-length attention over packed query [Tq, heads, dim] and key/value [Tk, kv_heads, dim], one
    sequence per range of `cu_seq_q` / `cu_seq_k` (int32, [N + 1]). Causal is aligned to the bottom right: in a
    sequence of Lq queries and Lk keys, query r sees keys c <= r + Lk - Lq, and with `window` >= 0 only those with
    c >= r + Lk - Lq - window (flash attention's `window_size=(window, 0)`). Returns output [Tq, heads, dim] and
    float32 log-sum-exp [heads, Tq]. `max_q` / `max_k` must bound the sequences' lengths, as the kernel requires.
    Without `gqa` the kernel takes no GQA: the heads must match."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads and not gqa:
        raise ValueError(f"Expect query and key/value to have the same number of heads, got {heads} and {kv_heads}")
    output = torch.zeros_like(query)
    lse = torch.full((heads, query.shape[0]), float("-inf"), dtype=torch.float32, device=query.device)
    starts_q, starts_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    for q_start, q_end, k_start, k_end in zip(starts_q, starts_q[1:], starts_k, starts_k[1:]):
        q_len, k_len = q_end - q_start, k_end - k_start
        if q_len > max_q or k_len > max_k:
            raise ValueError(f"a sequence of {q_len} queries / {k_len} keys exceeds max_q={max_q} / max_k={max_k}")
        if q_len == 0:
            continue
        queries = query[q_start:q_end].transpose(0, 1).double()  # [heads, Lq, dim]
        keys = key[k_start:k_end].transpose(0, 1).double().repeat_interleave(heads // kv_heads, dim=0)
        values = value[k_start:k_end].transpose(0, 1).double().repeat_interleave(heads // kv_heads, dim=0)
        diagonal = torch.arange(q_len)[:, None] + (k_len - q_len)
        visible = torch.arange(k_len)[None, :] <= diagonal
        if window >= 0:
            visible = visible & (torch.arange(k_len)[None, :] >= diagonal - window)
        weights, row_lse, _ = _softmax_parts((queries @ keys.transpose(-1, -2)) * scale, visible.to(query.device))
        output[q_start:q_end] = (weights @ values).transpose(0, 1).to(query.dtype)
        lse[:, q_start:q_end] = row_lse.float()
    return output, lse


@torch.library.custom_op("focus_hf::varlen_attention_standin", mutates_args=())
def varlen_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    gqa: bool,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`varlen_attention_standin` as an opaque operator, as torch's `varlen_attn` is one: torch.compile traces
    around it (its loop over the sequences reads their lengths from the data)."""
    return varlen_attention_standin(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, gqa=gqa, window=window
    )


@varlen_attention_op.register_fake
def _varlen_attention_shapes(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, gqa, window):
    return torch.empty_like(query), query.new_empty(query.shape[1], query.shape[0], dtype=torch.float32)


def efficient_attention_standin(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: Optional[torch.Tensor],
    compute_log_sumexp: bool,
    dropout_p: float,
    is_causal: bool,
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`torch.ops.aten._scaled_dot_product_efficient_attention` as the CUDA kernel answers: (output [batch, heads,
    L, dim], log-sum-exp [batch, heads, L rounded up to 32] float32, seed, offset). Heads must match (no GQA). A row
    whose keys are all hidden - by the bias at finfo.min, or by the causal flag (top-left aligned) - gets output 0
    and log-sum-exp 0.0."""
    batch, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    if key.shape[1] != heads:
        raise RuntimeError("the memory-efficient kernel takes no GQA: expand the kv heads first")
    scores = (query.double() @ key.double().transpose(-1, -2)) * scale
    visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).expand(batch, heads, q_len, kv_len)
    if bias is not None:
        scores = scores + bias.double()
        visible = visible & (bias > torch.finfo(bias.dtype).min / 2)
    if is_causal:
        visible = visible & torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
    weights, lse, has_key = _softmax_parts(scores, visible)
    lse = torch.where(has_key, lse, 0.0).float()
    padded = torch.zeros(batch, heads, -(-q_len // EFFICIENT_LSE_ALIGNMENT) * EFFICIENT_LSE_ALIGNMENT)
    padded[..., :q_len] = lse
    empty = torch.zeros((), dtype=torch.long)
    return (weights @ value.double()).to(query.dtype), padded.to(query.device), empty, empty
