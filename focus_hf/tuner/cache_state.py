"""What a routed layer keeps on the KV cache it decodes with, beside the keys and values.

Three things ride on a transformers `Cache` object, each by (adapter, layer): the routing state (`RoutingState`: the
Sinkhorn column sums and each cached key's groups, `attach_routing_states`), the group-sorted copies of the distant
keys that decoding steps read (`grouped_key_copies`), and the run of decoding steps that take one branch of
`FocusLayer.forward` (`DecodingRun`). They live and die with the cache's own tensors: a reused or reset cache starts
them afresh, and the cache's batch reshuffles (beam and contrastive search) are applied to the routing states too.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from focus_hf.attention.routing import PENDING_LIMIT, RoutingState

if TYPE_CHECKING:
    from focus_hf.tuner.layer import FocusLayer, RouterSettings

# The routing states, by (adapter, layer).
STATES_ATTRIBUTE = "_focus_routing_states"
# The run of decoding steps under way in each layer (`DecodingRun`), by (adapter, layer).
RUNS_ATTRIBUTE = "_focus_decoding_runs"
# Group-sorted copies of each routed layer's distant keys (`attention.cpu.grouped_keys`), by (adapter, layer).
GROUPED_ATTRIBUTE = "_focus_grouped_keys"
# Stands in for them once the cache has reordered its samples: decoding then gathers until the cache starts afresh.
REORDERED = "reordered"


def select_samples(state: RoutingState, index: torch.Tensor) -> RoutingState:
    """`state` with its samples (dim 0 of every tensor) taken at `index`."""
    index = index.to(state.valid_count.device)
    return dataclasses.replace(
        state,
        valid_count=state.valid_count.index_select(0, index),
        column_lse=state.column_lse.index_select(0, index),
        key_probs=state.key_probs.index_select(0, index),
        key_groups=state.key_groups.index_select(0, index),
        key_sink=state.key_sink.index_select(0, index),
        pending_hidden=None if state.pending_hidden is None else state.pending_hidden.index_select(0, index),
        pending_valid=None if state.pending_valid is None else state.pending_valid.index_select(0, index),
        noted_steps=None if state.noted_steps is None else state.noted_steps.index_select(index),
    )


def attach_routing_states(cache: Any) -> dict:
    """The routing states riding on `cache`, created on first use.

    The states are per sample, like the cache's keys and values, so every batch reshuffle the cache does
    (beam search's `reorder_cache`, contrastive search's `batch_repeat_interleave` / `batch_select_indices`)
    is applied to them too: the cache's own methods are wrapped on this instance. Cropping (assisted decoding)
    cannot be followed (the Sinkhorn column sums of the shorter prefix are gone); the next forward call then
    refuses to run rather than route from a stale state.
    """
    states = getattr(cache, STATES_ATTRIBUTE, None)
    if states is not None:
        return states
    states = {}
    setattr(cache, STATES_ATTRIBUTE, states)

    def follow(method_name: str, index_of: Callable[..., torch.Tensor]) -> None:
        original = getattr(cache, method_name, None)
        if original is None:
            return

        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            for key, state in list(states.items()):
                states[key] = select_samples(state, index_of(state, *args, **kwargs))
            # The group-sorted copies hold the old samples' keys; beam search would reorder them every step.
            setattr(cache, GROUPED_ATTRIBUTE, REORDERED)
            return result

        setattr(cache, method_name, wrapped)

    follow("reorder_cache", lambda state, beam_idx: beam_idx)
    follow("batch_select_indices", lambda state, indices: indices)
    follow(
        "batch_repeat_interleave",
        lambda state, repeats: torch.arange(state.valid_count.shape[0]).repeat_interleave(repeats),
    )
    return states


def grouped_key_copies(cache: Any, layer_key: tuple[str, int], fresh: bool) -> Optional[dict]:
    """The group-sorted key copies of one layer's routing on `cache` (by run of kv heads), emptied when the routing
    starts afresh on it (an empty or reset cache): they hold the cache's keys, so they live and die with them.

    None for a cache that offloads its layers to save accelerator memory (copies of every layer's keys kept on the
    accelerator would undo that) and for one that has reordered its samples (beam or contrastive search) until it
    starts afresh: decoding gathers from the cache there."""
    if getattr(cache, "offloading", False):
        return None
    stores = getattr(cache, GROUPED_ATTRIBUTE, None)
    if stores == REORDERED:
        if not fresh:
            return None
        stores = None
    if stores is None:
        stores = {}
        setattr(cache, GROUPED_ATTRIBUTE, stores)
    if fresh or layer_key not in stores:
        stores[layer_key] = {}
    return stores[layer_key]


@dataclass
class DecodingRun:
    """A run of one layer's one-token decoding steps on one cache that take the same branch of `FocusLayer.forward`,
    from the step that found so while the routing state has seen fewer than `until` tokens: steps that decode as the
    base model's (`top_k` None), or routed steps whose key side waits (`note_step`) and whose queries probe the
    query router's `top_k` groups. It rides on the cache, beside the routing states: each cache decoded in turn keeps
    its own.

    The first step of the run makes the whole decision; the later ones check only what may have changed since (the
    adapter and its options, the model's mode, the cache's length, padding, observers, gradients)."""

    settings: RouterSettings
    options: tuple  # the layer's overrides and mode when the run began (`FocusLayer._run_options`)
    until: float
    top_k: Optional[int] = None

    def next_state(
        self, layer: FocusLayer, key: tuple[str, int], hidden: torch.Tensor, cache: Any, mask: Any
    ) -> Optional[RoutingState]:
        """The routing state on `cache` of layer and adapter `key` if this call of `layer` is the run's next step
        (every condition of the branch holds; no padding), else None."""
        state = getattr(cache, STATES_ATTRIBUTE, {}).get(key)
        if (
            state is not None
            and mask is None
            and hidden.shape[1] == 1
            and state.seen < self.until
            and hidden.shape[0] == state.valid_count.shape[0]
            and layer.focus_settings[key[0]] is self.settings
            and layer._run_options() == self.options
            and not layer.routing_observers
            # Cropped (assisted decoding) or reset: the full path refuses or starts afresh.
            and int(cache.get_seq_length(layer.cache_layer_index)) == state.seen
            and not torch.compiler.is_compiling()
            and not layer._routers_need_gradient(key[0])
        ):
            return state
        return None


def block_until(state: RoutingState, settings: RouterSettings) -> int:
    """How many tokens `state` may have seen for a decoding step's token to wait (`note_step`, `defer_tokens`): each
    step adds one; once as many wait as a block holds, `settle` runs, which bounds their memory."""
    waiting = state.pending + len(state.noted_steps or ())
    return state.seen + min(PENDING_LIMIT, settings.window) - waiting
