"""The Focus pattern as one FlexAttention `mask_mod` that says everything, for every call of the GPU path.

Each FlexAttention call of the path attends *rows* (query entries) to *columns* (key slots): the whole pattern
in token order, the own-group pass with keys sorted by group and one row per (query, probed group), a decoding step over
the paged copy's slots. `PairRule` describes any of them with small tensors - for each row its query's position, its
row in the model's mask and the groups it probes; for each column its key's position (-1: no key), group and sink
flag - and `rule_mask` turns it into the one `mask_mod` all calls use:

    pair allowed  iff  key real and not after the query, allowed by the model's mask, and
                       (within the window or a sink, and of a group the row does not probe   [if near_unprobed]
                        or of a group the row probes                                          [if probed])

The own-group pass takes the probed part, the whole pattern and a decoding step both (the window band, the near unprobed
part alone, runs in plain torch: `bands`). The own-group pass without a model's mask reads its pairs from ranges of its
sorted keys instead (`range_mask`): the same pairs, far fewer loads. The block lists of a call are then only a sparsity
hint (`block_masks` rule 6): FlexAttention run eagerly, which applies `mask_mod` to every pair and ignores the lists,
gives the compiled kernel's answer.

Why one function whose closure holds only tensors: torch.compile guards a compiled kernel on the mask's code and on
what its closure holds - a Python number there is a constant compiled in, so every new length, window or decoding
step would compile again, and each new mask function would too. Here the code never changes, every number that
changes per call is a tensor, and the only Python number, the probe slots, is rounded up to a power of two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from focus_hf.attention.gpu.block_masks import BLOCK, blocks_of

PROBE_NONE = -3  # a probe slot that matches no key: keys' groups are >= -1 (not routed yet) or -2 (padding columns)
NO_KEY = -1  # the position of a column without a key (padding, an empty slot, past the keys)
NO_QUERY = -1  # the position of a row without a query (past the queries, an excluded entry): it sees no key


@dataclass(frozen=True)
class PairRule:
    """What one FlexAttention call's rows and columns are (see the module docstring). Rows and columns cover whole
    blocks of BLOCK, since kernels evaluate masks on whole blocks.

    Attributes:
        row_position: [batch, rows] int64, the position of the row's query among the keys; -1: no query.
        row_query: [batch, rows] int64, the row's query index in the call (its row of the model's mask).
        row_probes: [batch, rows, slots] int64, the groups the row probes (PROBE_NONE: none).
        column_position: [batch, columns] int64, the key's position; NO_KEY: no key.
        column_group: [batch, columns] int64, the key's group (-1: not routed yet).
        column_sink: [batch, columns] bool, whether the key is a sink.
        window: 0-d int64, the local window w.
        near_unprobed: 0-d bool, take the pairs within the window or with a sink whose group the row does not probe.
        probed: 0-d bool, take the pairs whose group the row probes.
        model_mask: 1-d bool, the model's mask (True: may attend) flattened, one spare True at its end.
        model_steps: three 0-d int64, the flat mask's strides of batch, query and key (0 where broadcast).
    """

    row_position: torch.Tensor
    row_query: torch.Tensor
    row_probes: torch.Tensor
    column_position: torch.Tensor
    column_group: torch.Tensor
    column_sink: torch.Tensor
    window: torch.Tensor
    near_unprobed: torch.Tensor
    probed: torch.Tensor
    model_mask: torch.Tensor
    model_steps: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def rule_mask(rule: PairRule) -> Callable:
    """The `mask_mod(b, h, q_index, kv_index) -> bool` of `rule`: the same code for every rule (see the module
    docstring), reading only the rule's tensors."""
    row_position, row_query, row_probes = rule.row_position, rule.row_query, rule.row_probes
    column_position, column_group, column_sink = rule.column_position, rule.column_group, rule.column_sink
    window, near_unprobed, probed_part, model_mask = rule.window, rule.near_unprobed, rule.probed, rule.model_mask
    batch_step, row_step, column_step = rule.model_steps
    slots = row_probes.shape[-1]

    def mask_mod(b, h, q_index, kv_index):
        query_position = row_position[b, q_index]
        key_position = column_position[b, kv_index]
        group = column_group[b, kv_index]
        probed = row_probes[b, q_index, 0] == group
        for slot in range(1, slots):
            probed = probed | (row_probes[b, q_index, slot] == group)
        near = (query_position - key_position <= window) | column_sink[b, kv_index]
        visible = (key_position >= 0) & (key_position <= query_position)
        model = model_mask[b * batch_step + row_query[b, q_index] * row_step + key_position.clamp(min=0) * column_step]
        return visible & model & ((near & ~probed & near_unprobed) | (probed & probed_part))

    return mask_mod


def range_mask(first: torch.Tensor, end: torch.Tensor) -> Callable:
    """A `mask_mod` by ranges of columns: row r of sample b sees columns first[b, r] <= c < end[b, r] ([batch, rows],
    padded here to whole blocks with empty ranges).

    The own-group pass without a model's mask is such a call - an entry sees a range of its group's sorted keys - and
    this reads two numbers per row where `rule_mask` reads seven per pair: on an H200 a FlexAttention call whose mask
    read the pattern's tensors ran ~50 times slower than one whose mask used the indices alone (the window band at 256K
    tokens, benchmarks/results/gpu/chunked-scan/profile.json)."""
    rows = blocks_of(first.shape[1]) * BLOCK
    first, end = padded(first.long(), 1, rows, 0), padded(end.long(), 1, rows, 0)

    def mask_mod(b, h, q_index, kv_index):
        return (kv_index >= first[b, q_index]) & (kv_index < end[b, q_index])

    return mask_mod


def probe_slots(top_k: int) -> int:
    """Probe slots of a rule: top_k rounded up to a power of two of at least 2 (a new slot count compiles the kernel
    again, and torch compiles a dimension of one apart from the others)."""
    return max(2, 1 << (max(top_k, 1) - 1).bit_length())


def padded(tensor: torch.Tensor, dim: int, length: int, value) -> torch.Tensor:
    """`tensor` padded along `dim` to `length` with `value`, contiguous."""
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor.contiguous()
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_full(shape, value)], dim=dim)


def probe_table(groups: torch.Tensor, rows: int) -> torch.Tensor:
    """[batch, rows, probe_slots(top_k)] int64 from the probed groups [batch, n, top_k]: padded with PROBE_NONE."""
    groups = groups.long()
    groups = padded(groups, 2, probe_slots(groups.shape[-1]), PROBE_NONE)
    return padded(groups, 1, rows, PROBE_NONE)


def _flag(value: bool, device: torch.device) -> torch.Tensor:
    return torch.full((), value, dtype=torch.bool, device=device)


def _number(value: int, device: torch.device) -> torch.Tensor:
    return torch.full((), value, dtype=torch.long, device=device)


def model_terms(
    model_mask: Optional[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The model's mask [batch or 1, 1, q, kv] (None: nothing beyond causal and padding) as a rule's `model_mask` and
    `model_steps`: flattened, so that its shape never depends on which dimensions are broadcast, and one True longer,
    so that it is never of size one (torch compiles sizes of one apart)."""
    if model_mask is None:
        return torch.ones(2, dtype=torch.bool, device=device), tuple(_number(0, device) for _ in range(3))
    mask = model_mask[:, 0]
    steps = [0, 0, 0]
    stride = 1
    for dim in (2, 1, 0):
        if mask.shape[dim] > 1:
            steps[dim] = stride
            stride *= mask.shape[dim]
    return torch.cat([mask.reshape(-1), mask.new_ones(1)]), tuple(_number(step, device) for step in steps)


def _dynamic_lengths(*tensors: torch.Tensor) -> None:
    """Mark the lengths (every dimension but the last of a probe table) as changing from call to call, so that
    torch.compile compiles them as sizes, not constants, from the first compilation."""
    for tensor in tensors:
        for dim in range(min(tensor.dim(), 2)):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def make_rule(
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    columns: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    window: int,
    parts: tuple[bool, bool],
    model_mask: Optional[torch.Tensor],
) -> PairRule:
    """A rule from its rows (position, query index, probes) and columns (position, group, sink), each padded here
    to whole blocks; `parts` = (near_unprobed, probed)."""
    position, query, probes = rows
    row_span = blocks_of(position.shape[1]) * BLOCK
    column_position, column_group, column_sink = columns
    column_span = blocks_of(column_position.shape[1]) * BLOCK
    device = position.device
    mask, steps = model_terms(model_mask, device)
    rule = PairRule(
        row_position=padded(position.long(), 1, row_span, NO_QUERY),
        row_query=padded(query.long(), 1, row_span, 0),
        row_probes=probe_table(probes, row_span),
        column_position=padded(column_position.long(), 1, column_span, NO_KEY),
        column_group=padded(column_group.long(), 1, column_span, -2),
        column_sink=padded(column_sink, 1, column_span, False),
        window=_number(window, device),
        near_unprobed=_flag(parts[0], device),
        probed=_flag(parts[1], device),
        model_mask=mask,
        model_steps=steps,
    )
    if not torch.compiler.is_compiling():  # inside a compiled model, its own compilation decides
        _dynamic_lengths(
            rule.row_position,
            rule.row_query,
            rule.row_probes,
            rule.column_position,
            rule.column_group,
            rule.column_sink,
        )
        torch._dynamo.maybe_mark_dynamic(mask, 0)
    return rule


def token_rule(
    valid: torch.Tensor,
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_sink: torch.Tensor,
    window: int,
    q_len: int,
    parts: tuple[bool, bool],
    model_mask: Optional[torch.Tensor] = None,
) -> PairRule:
    """The rule of a call in token order: rows are the call's queries (the last q_len of the keys), columns the keys
    (`valid` [batch, kv] False for padding)."""
    batch, kv_len = valid.shape
    device = valid.device
    query_index = torch.arange(q_len, device=device).expand(batch, q_len)
    key_position = torch.arange(kv_len, device=device).expand(batch, kv_len)
    return make_rule(
        (query_index + (kv_len - q_len), query_index, query_groups),
        (torch.where(valid, key_position, NO_KEY), key_groups, key_sink),
        window,
        parts,
        model_mask,
    )
