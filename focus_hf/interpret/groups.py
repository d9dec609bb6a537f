"""One channel to observe the routing of Focus layers: `record_routing(model)`.

Every routed layer hands the routing it computed in a forward pass (a `TokenRouting`: each token's group
log-probabilities and its top-k groups) to the observers registered on it. `record_routing` registers one
observer per call and removes it on exit, so several recorders (`group_assignments`, the training callback's
balance check, `focus-hf inspect`) can watch the same model at once without disturbing each other. Observing
changes nothing in what the layers compute.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Optional

import torch
from torch import nn

from focus_hf.attention.routing import TokenRouting
from focus_hf.tuner.controls import focus_layers
from focus_hf.tuner.layer import FocusLayer


class RoutingRecorder:
    """Collects, per routed layer, the `TokenRouting` of every forward call while attached.

    Recorded tensors are detached from the autograd graph. Use `record_routing(model)`, or `attach()` / `detach()`
    when the recording spans callbacks (as in a `TrainerCallback`).
    """

    def __init__(self, layers: list[FocusLayer]) -> None:
        self.layers = list(layers)
        self._routings: dict[int, list[TokenRouting]] = {layer.layer_index: [] for layer in self.layers}

    def _observe(self, layer: FocusLayer, routing: TokenRouting) -> None:
        detached = dataclasses.replace(
            routing,
            log_probs=routing.log_probs.detach(),
            query_log_probs=None if routing.query_log_probs is None else routing.query_log_probs.detach(),
        )
        self._routings.setdefault(layer.layer_index, []).append(detached)

    def attach(self) -> "RoutingRecorder":
        for layer in self.layers:
            layer.routing_observers.append(self._observe)
        return self

    def detach(self) -> None:
        for layer in self.layers:
            if self._observe in layer.routing_observers:
                layer.routing_observers.remove(self._observe)

    def routings(self) -> dict[int, list[TokenRouting]]:
        """layer index -> the routings recorded so far, one per forward call, oldest first."""
        return {index: list(calls) for index, calls in self._routings.items()}

    def take(self) -> dict[int, list[TokenRouting]]:
        """The routings recorded so far (as `routings()`), and start afresh."""
        taken = self.routings()
        for calls in self._routings.values():
            calls.clear()
        return taken

    def key_groups(self) -> dict[int, torch.Tensor]:
        """layer index -> LongTensor [batch, seq]: the group every recorded token is filed under as a key."""
        return {
            index: torch.cat([r.key_groups for r in calls], dim=1) for index, calls in self._routings.items() if calls
        }

    def groups(self) -> dict[int, torch.Tensor]:
        """layer index -> LongTensor [batch, seq, top_k]: every recorded token's groups, calls joined along seq."""
        return {
            index: torch.cat([r.top_groups for r in calls], dim=1) for index, calls in self._routings.items() if calls
        }


@contextlib.contextmanager
def record_routing(model: nn.Module, layers: Optional[list[FocusLayer]] = None) -> Iterator[RoutingRecorder]:
    """Record the routing of every Focus layer of `model` (or of `layers`) during the `with` block.

    Raises:
        ValueError: the model carries no Focus adapter (and no `layers` are given).
    """
    recorder = RoutingRecorder(focus_layers(model) if layers is None else layers).attach()
    try:
        yield recorder
    finally:
        recorder.detach()


@torch.no_grad()
def group_assignments(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
) -> dict[int, torch.LongTensor]:
    """The groups each token keeps in hard mode, per routed layer.

    Runs one forward pass of `model` (without cache). Padding positions get groups too; ignore them.

    Returns:
        layer index -> LongTensor [batch, seq, top_k], the groups each token probes as a query, best first. Without
        `query_projection` the first entry is also the token's own group as a key; with it, read the keys' groups
        from `record_routing(model)` and `RoutingRecorder.key_groups()`. With adaptive probing (`probe_mass`), a
        slot the token does not probe repeats its first group.
    """
    with record_routing(model) as recorder:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return recorder.groups()


@torch.no_grad()
def routing_records(model: nn.Module, input_ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each routed layer's group and routing confidence for every token of one forward pass (in eval mode).

    Returns:
        layer index -> (groups LongTensor [batch, seq]: the token's own group (its best one, as
        `group_assignments` gives first), confidence FloatTensor [batch, seq]: that group's Sinkhorn
        probability).
    """
    was_training = model.training
    with record_routing(model) as recorder:
        model.eval()
        model(input_ids=input_ids, use_cache=False)
        model.train(was_training)
    records: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for index, calls in recorder.routings().items():
        if not calls:
            continue  # adapter disabled or inactive on this layer
        routing = calls[-1]
        groups = routing.key_groups
        confidence = routing.log_probs.gather(-1, groups[..., None])[..., 0].exp()
        records[index] = (groups.cpu(), confidence.float().cpu())
    return records
