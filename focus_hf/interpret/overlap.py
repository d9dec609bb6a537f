"""How two groupings of the same tokens agree, whatever their groups are called: the adjusted Rand index and the
share of tokens in the group of the other grouping that holds most of their own group.

Group numbers are arbitrary labels (group 3 of one adapter has nothing to do with group 3 of another), so both
measures compare which tokens are grouped together, not the numbers.
"""

from __future__ import annotations

import torch


def _contingency(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    first, second = first.reshape(-1).long(), second.reshape(-1).long()
    if first.shape != second.shape:
        raise ValueError(f"the groupings cover {first.numel()} and {second.numel()} tokens: give the same tokens")
    table = torch.zeros(int(first.max()) + 1, int(second.max()) + 1, dtype=torch.float64)
    table.index_put_((first, second), torch.ones_like(first, dtype=torch.float64), accumulate=True)
    return table


def adjusted_rand_index(first: torch.Tensor, second: torch.Tensor) -> float:
    """The adjusted Rand index of two groupings (1: the same partition of the tokens, about 0: as by chance)."""
    table = _contingency(first, second)

    def pairs(counts: torch.Tensor) -> float:
        return float((counts * (counts - 1) / 2).sum())

    together = pairs(table)
    rows, columns, total = pairs(table.sum(1)), pairs(table.sum(0)), pairs(table.sum().reshape(1))
    expected = rows * columns / total if total else 0.0
    best = (rows + columns) / 2
    return 1.0 if best == expected else (together - expected) / (best - expected)


def matched_share(first: torch.Tensor, second: torch.Tensor) -> float:
    """The share of tokens that `second` puts in the group holding most of their `first` group's tokens."""
    table = _contingency(first, second)
    return float(table.max(dim=1).values.sum() / table.sum())
