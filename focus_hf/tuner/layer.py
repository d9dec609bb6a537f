"""`FocusLayer`: the router that wraps one attention module."""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from focus_hf.attention.backends import canonical_backend
from focus_hf.attention.function import (
    ATTENTION_NAME,
    ROUTING_ARGUMENT,
    FocusRuntimeError,
    LayerRouting,
    as_bool_mask,
    first_restricted_length,
)
from focus_hf.attention.gpu.verify import is_verified, verify_shape
from focus_hf.attention.paths import path_platform
from focus_hf.attention.routing import (
    RoutingState,
    TokenRouting,
    constant_rows,
    defer_noted_steps,
    defer_tokens,
    note_step,
    probed_groups,
    route_tokens,
    routing_scores,
    scaled_directions,
    settle,
    waiting_step,
)
from focus_hf.tuner.cache_state import (
    RUNS_ATTRIBUTE,
    STATES_ATTRIBUTE,
    DecodingRun,
    attach_routing_states,
    block_until,
    grouped_key_copies,
)
from focus_hf.tuner.config import ROUTING_MODES, FocusConfig, FocusConfigError
from focus_hf.tuner.devices import execution_device


@dataclass
class RouterSettings:
    """The per-adapter options a layer needs at run time (copied from the adapter's `FocusConfig`)."""

    num_groups: int
    group_dim: int
    window: int
    top_k: int
    sink_tokens: int
    temperature: float
    sinkhorn_iterations: int
    routing_mode: str
    gate_floor: float
    query_projection: bool = False
    dense_heads: Optional[list] = None
    dense_below: int = 0
    probe_mass: Optional[float] = None

    @classmethod
    def from_config(cls, config: FocusConfig) -> "RouterSettings":
        return cls(**{name: getattr(config, name) for name in cls.__dataclass_fields__})

    @functools.cached_property
    def dense_kv_heads(self) -> dict[int, tuple[int, ...]]:
        """The kv heads of each layer that keep full attention, sorted (`dense_heads` by layer; read at every
        call of every routed layer, so worked out once - settings are replaced, never edited, when options change)."""
        by_layer: dict[int, set[int]] = {}
        for layer, head in self.dense_heads or []:
            by_layer.setdefault(layer, set()).add(head)
        return {layer: tuple(sorted(heads)) for layer, heads in by_layer.items()}


def query_validity(
    attention_mask: Optional[torch.Tensor], batch: int, q_len: int, device: torch.device, cached_tokens: int = 0
) -> torch.Tensor:
    """[batch, q] True for real tokens: a token is padding iff the model's mask hides it from itself.

    A query's own column is after the cached tokens', or, where a sliding-window cache keeps fewer, last; a static
    cache's mask also has columns for the slots not written yet, after the queries'."""
    mask = as_bool_mask(attention_mask)
    if mask is None:
        # Every token real: a decoding step shares one read-only constant (this runs in every layer at every step).
        return (
            constant_rows(batch, q_len, True, device)
            if q_len == 1
            else torch.ones(batch, q_len, dtype=torch.bool, device=device)
        )
    first_query = min(cached_tokens, mask.shape[-1] - q_len)
    if q_len == 1:  # a decoding step: one element, read as a view (this runs in every layer at every step)
        return mask[:, 0, :, first_query].expand(batch, 1)
    diagonal = torch.arange(q_len, device=device)
    valid = mask[:, 0, diagonal, first_query + diagonal]
    return valid.expand(batch, q_len)


HARD_BACKWARD_MESSAGE = (
    "Backward pass through Focus layer {layer} in hard routing mode: hard routing picks groups with an argmax, which "
    "is not differentiable, so the routers would get no gradient. The model is in eval mode, where routing_mode "
    "'auto' routes hard (a new adapter takes the mode of the model it is added to, as a loaded one does): call "
    "model.train() before training (the transformers Trainer does), or set_routing(model, 'soft')."
)

EVAL_MODE_NO_GRADIENT_MESSAGE = (
    "Focus routes hard because the model is in eval mode (routing_mode 'auto'; a new adapter takes the mode of the "
    "model it is added to, as a loaded one does), and hard routing gives the routers no gradient: a backward pass "
    "from this forward leaves them untrained, or fails with torch's 'element 0 of tensors does not require grad' "
    "where nothing else trains. To train, call model.train() first (the transformers Trainer does) or "
    "set_routing(model, 'soft'); for inference, run under torch.no_grad() or torch.inference_mode(), which also "
    "silences this warning."
)


class _HardRoutingBackward(torch.autograd.Function):
    """Identity on the attention output whose backward refuses: see `FocusLayer.forward`."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, anchor: torch.Tensor, layer: int) -> torch.Tensor:
        ctx.layer = layer
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise FocusRuntimeError(HARD_BACKWARD_MESSAGE.format(layer=ctx.layer))


def _refuse_backward(output: Any, anchor: torch.Tensor, layer: int) -> Any:
    """The attention module's output (a tensor, or a tuple whose first item is one) with its first tensor passed
    through `_HardRoutingBackward` when it requires grad, tied to the router parameter `anchor`. When it requires
    none (nothing before it trains), it is left alone and `EVAL_MODE_NO_GRADIENT_MESSAGE` is warned, once: the
    error torch raises at a backward pass, or the routers left untrained beside a module that trains, say nothing
    of eval mode."""
    if isinstance(output, torch.Tensor) and output.requires_grad:
        return _HardRoutingBackward.apply(output, anchor, layer)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor) and output[0].requires_grad:
        return (_HardRoutingBackward.apply(output[0], anchor, layer), *output[1:])
    warnings.warn(EVAL_MODE_NO_GRADIENT_MESSAGE, UserWarning, stacklevel=2)
    return output


def _parameter_state(parameter: torch.Tensor) -> tuple:
    """What changes when a router parameter does: its identity and storage (replaced, moved with `.to()`) and, where it
    tracks one, its version, which in-place updates (optimizer steps, loading) bump. An inference tensor (made under
    torch.inference_mode) has no version: it is written in place only under inference_mode, by loading
    (`FocusLayer._load_from_state_dict` counts those) or by hand."""
    try:
        version = parameter._version
    except RuntimeError:  # an inference tensor (asked first: it costs a call at every routed decoding step)
        version = None
    return id(parameter), parameter.data_ptr(), parameter.device, version


class FocusLayer(nn.Module, BaseTunerLayer):
    """Wraps a self-attention module: routes its input tokens and hands the routing to the attention function.

    Parameters per adapter: `focus_proj[name]` (hidden_size x group_dim) and `focus_centroids[name]`
    (num_groups x group_dim). Only these are trained; the wrapped module is untouched.
    """

    adapter_layer_names = ("focus_proj", "focus_centroids", "focus_query_proj")
    other_param_names = ("focus_settings",)

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: FocusConfig, layer_index: int) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.layer_index = layer_index
        # Which of the KV cache's layers holds this attention's keys (asked at every call).
        self.cache_layer_index: int = getattr(base_layer, "layer_idx", 0)
        # Whether the wrapped module takes the keyword argument that hands its attention function the routing.
        self._passes_keywords = any(
            parameter.kind is inspect.Parameter.VAR_KEYWORD
            for parameter in inspect.signature(base_layer.forward).parameters.values()
        )
        current = base_layer.config._attn_implementation
        # Restored by unload(); "focus" here means an earlier adapter switched it already.
        self.base_attn_implementation = current if current != ATTENTION_NAME else "sdpa"
        self.focus_proj = nn.ParameterDict()
        self.focus_centroids = nn.ParameterDict()
        self.focus_query_proj = nn.ParameterDict()
        self.focus_settings: dict[str, RouterSettings] = {}
        # Run-time overrides set by `focus_hf.set_routing`; None means "use the adapter's config".
        self.mode_override: Optional[str] = None
        self.top_k_override: Optional[int] = None
        self.backend = "auto"
        self.decode_copy = True  # decoding steps read a group-sorted copy of the distant keys (`grouped_keys`)
        # Called with (layer, TokenRouting) after each routing; managed by `focus_hf.interpret.groups.record_routing`.
        self.routing_observers: list[Callable[[FocusLayer, TokenRouting], None]] = []
        self._kept_values: dict[tuple, tuple[tuple, torch.Tensor]] = {}  # `_kept`, by (adapter, what)
        self._weights_loaded = 0  # state dicts loaded into this layer (`_kept`)
        self._every_head_dense_for: Optional[tuple[RouterSettings, bool]] = None  # `_every_head_dense`
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config)
        # A new module starts in train mode; the router takes the mode of the module it wraps instead, so that a
        # fresh adapter on an eval-mode model routes as its saved-and-reloaded copy does ("auto": hard in eval mode).
        self.train(base_layer.training)

    def update_layer(self, adapter_name: str, config: FocusConfig) -> None:
        """Create the router parameters of `adapter_name` (random init, `FocusConfig.init_weights`; loading
        overwrites them)."""
        hidden_size = config.hidden_size
        # Routers always hold real fp32 values where the wrapped module computes, also when accelerate keeps its
        # weights on the meta device (offloaded) or the base runs in bf16/fp16 or is quantized.
        device = execution_device(self.base_layer)
        generator_scale = 1.0 / math.sqrt(hidden_size)
        projection = torch.randn(hidden_size, config.group_dim, device=device) * generator_scale
        centroids = torch.randn(config.num_groups, config.group_dim, device=device)
        centroids = torch.nn.functional.normalize(centroids, dim=-1)
        self.focus_proj[adapter_name] = nn.Parameter(projection)
        self.focus_centroids[adapter_name] = nn.Parameter(centroids)
        if config.query_projection:
            if config.init_weights:
                # Queries start where their keys are filed: a query first probes the groups of keys like itself.
                query_projection = projection.clone()
            else:
                query_projection = torch.randn(hidden_size, config.group_dim, device=device) * generator_scale
            self.focus_query_proj[adapter_name] = nn.Parameter(query_projection)
        self.focus_settings[adapter_name] = RouterSettings.from_config(config)
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def set_adapter(self, adapter_names: str | list[str], inference_mode: bool = False) -> None:
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        if len(names) > 1:
            raise FocusRuntimeError(
                f"Focus routes with one adapter at a time; set_adapter({names!r}) would activate {len(names)}. "
                "Call set_adapter with a single name."
            )
        super().set_adapter(adapter_names, inference_mode=inference_mode)

    def set_routing(
        self, mode: Optional[str], top_k: Optional[int], backend: Optional[str], decode_copy: Optional[bool] = None
    ) -> None:
        """Override the routing mode / top-k / backend of every adapter of this layer (None: keep config), and
        choose whether decoding keeps a group-sorted copy of the distant keys (None: keep the current choice)."""
        if mode is not None and mode not in ROUTING_MODES:
            raise FocusConfigError(f"Unknown routing mode {mode!r}; expected one of {ROUTING_MODES}.")
        backend = canonical_backend(backend, warn=False)  # `controls.set_routing` warned of a former name
        for settings in self.focus_settings.values():
            if top_k is not None and not 1 <= top_k <= settings.num_groups:
                raise FocusConfigError(f"top_k must be between 1 and num_groups={settings.num_groups}, got {top_k}.")
        self.mode_override = None if mode == "auto" else mode
        self.top_k_override = top_k
        self.backend = backend
        if decode_copy is not None:
            self.decode_copy = bool(decode_copy)

    def _active_router(self) -> Optional[str]:
        # Asked at every call of every layer: peft's attributes rather than its properties over them, and
        # `focus_settings`, a plain dict with the names of `focus_proj`, rather than the ParameterDict, which is
        # reached through nn.Module.__getattr__'s lookups.
        if self._disable_adapters:
            return None
        active = self._active_adapter
        if isinstance(active, str):  # the usual case
            return active if active in self.focus_settings else None
        active = [name for name in active if name in self.focus_settings]
        if len(active) > 1:
            raise FocusRuntimeError(
                f"{len(active)} Focus adapters are active at once ({active}); routing uses one adapter at a time. "
                "Call set_adapter with a single name."
            )
        return active[0] if active else None

    def _routing_state(
        self, cache: Any, adapter_name: str, batch: int, settings: RouterSettings, device: torch.device
    ) -> RoutingState:
        # int(): a StaticCache counts its tokens in a tensor.
        cached_tokens = 0 if cache is None else int(cache.get_seq_length(self.cache_layer_index))
        if cached_tokens == 0:
            return RoutingState.empty(batch, settings.sinkhorn_iterations, settings.num_groups, device)
        states = getattr(cache, STATES_ATTRIBUTE, None)
        state = None if states is None else states.get((adapter_name, self.layer_index))
        if state is None or state.seen != cached_tokens or state.valid_count.shape[0] != batch:
            raise FocusRuntimeError(
                f"The KV cache holds {cached_tokens} tokens but the Focus router of layer {self.layer_index} has "
                f"routed {0 if state is None else state.seen}: the cache was filled without this adapter, or "
                "cropped (assisted decoding), which Focus does not support: generate without an assistant model."
            )
        return state

    def routing_scores(self, adapter_name: str, hidden: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Key-side scores [batch, seq, K] and, with a query router, query-side scores (else None), both / tau."""
        query_scores = None
        if adapter_name in self.focus_query_proj:
            query_scores = self.router_scores(adapter_name, hidden, query_side=True)
        return self.router_scores(adapter_name, hidden, query_side=False), query_scores

    def router_scores(self, adapter_name: str, hidden: torch.Tensor, query_side: bool) -> torch.Tensor:
        """Scores [batch, seq, K] / tau of the key-side router, or of the query router (`query_side`)."""
        projection = (self.focus_query_proj if query_side else self.focus_proj)[adapter_name]
        centroids = self.focus_centroids[adapter_name]
        temperature = self.focus_settings[adapter_name].temperature
        return routing_scores(
            hidden, projection, centroids, temperature, self._kept_directions(adapter_name, centroids, temperature)
        )

    def _kept_directions(
        self, adapter_name: str, centroids: torch.Tensor, temperature: float
    ) -> Optional[torch.Tensor]:
        """The centroids' `scaled_directions`, worked out once per state of the centroids (decoding routes one token
        per layer per step, where their normalisation is half the router's operations); None where autograd must
        see them computed."""
        return self._kept(
            (adapter_name, "directions"),
            (centroids,),
            temperature,
            lambda: scaled_directions(centroids.detach(), temperature),
        )

    def _kept(
        self, name: tuple, parameters: tuple[torch.Tensor, ...], temperature: float, compute: Callable
    ) -> Optional[torch.Tensor]:
        """`compute()`, a function of `parameters` and the temperature, worked out once per state of them; None where
        autograd must see it computed."""
        if torch.is_grad_enabled() and any(parameter.requires_grad for parameter in parameters):
            return None
        state = (temperature, self._weights_loaded, *(_parameter_state(p) for p in parameters))
        # One read and one write of the dict, each of a whole (state, value) pair: threads that call the layer at once
        # may each work a value out, and each reads a pair that belongs together.
        kept = self._kept_values.get(name)
        if kept is None or kept[0] != state:
            # An ordinary tensor, also when worked out under inference_mode: a later call outside it may have autograd
            # record an operation on it (the routers frozen while something else trains), which an inference tensor
            # refuses.
            with torch.inference_mode(False), torch.no_grad():
                kept = (state, compute())
            self._kept_values[name] = kept
        return kept[1]

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        # Loading writes the routers in place: under inference_mode that leaves no trace `_parameter_state` can see.
        self._weights_loaded += 1
        super()._load_from_state_dict(*args, **kwargs)

    def query_probes(self, adapter_name: str, hidden: torch.Tensor, top_k: int) -> torch.Tensor:
        """The groups the query router sends `hidden` [batch, seq, hidden_size] to, best first: [batch, seq, top_k]
        (`routing.probed_groups` of its log-probabilities).

        Without `probe_mass` only the order of a row's scores counts, which neither dividing it by the projection's
        norm nor the log-softmax changes: in inference the probes are then the top-k of hidden @ (W_q D), D the
        centroids' scaled directions, one matrix product where a decoding step would otherwise run eight operations
        per layer."""
        settings = self.focus_settings[adapter_name]
        if settings.probe_mass is None:
            projection, centroids = self.focus_query_proj[adapter_name], self.focus_centroids[adapter_name]

            def probe_matrix() -> torch.Tensor:
                return projection.detach().float() @ scaled_directions(centroids.detach(), settings.temperature)

            matrix = self._kept((adapter_name, "probes"), (projection, centroids), settings.temperature, probe_matrix)
            if matrix is not None:
                rows = hidden if hidden.dtype == matrix.dtype else hidden.to(matrix.dtype)
                return probed_groups(rows @ matrix, top_k)
        query_log_probs = torch.log_softmax(self.router_scores(adapter_name, hidden, query_side=True), dim=-1)
        return probed_groups(query_log_probs, top_k, settings.probe_mass)

    def route_tokens(
        self,
        adapter_name: str,
        hidden: torch.Tensor,
        valid: Optional[torch.Tensor] = None,
        state: Optional[RoutingState] = None,
        top_k: Optional[int] = None,
    ) -> tuple[TokenRouting, RoutingState]:
        """Route `hidden` [batch, seq, hidden_size] with `adapter_name`, after `state` (None: a fresh sequence)."""
        settings = self.focus_settings[adapter_name]
        batch, seq = hidden.shape[:2]
        if valid is None:
            valid = torch.ones(batch, seq, dtype=torch.bool, device=hidden.device)
        if state is None:
            state = RoutingState.empty(batch, settings.sinkhorn_iterations, settings.num_groups, hidden.device)
        scores, query_scores = self.routing_scores(adapter_name, hidden)
        return route_tokens(
            scores,
            valid,
            state,
            iterations=settings.sinkhorn_iterations,
            top_k=top_k or self.top_k_override or settings.top_k,
            sink_tokens=settings.sink_tokens,
            query_scores=query_scores,
            probe_mass=settings.probe_mass,
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        adapter_name = self._active_router()
        if adapter_name is None:
            return self.base_layer(*args, **kwargs)
        settings = self.focus_settings[adapter_name]
        hidden = args[0] if args else kwargs["hidden_states"]
        # transformers >= 5.24 passes the cache as `cache` (`past_key_values` before, deprecated until 5.40).
        cache = kwargs["cache"] if kwargs.get("cache") is not None else kwargs.get("past_key_values")
        layer_key = (adapter_name, self.layer_index)  # the key of this layer's state, copies and run on the cache
        runs = getattr(cache, RUNS_ATTRIBUTE, None)
        if runs:
            run = runs.get(layer_key)
            if run is not None:
                state = run.next_state(self, layer_key, hidden, cache, kwargs.get("attention_mask"))
                if state is not None:
                    return self._run_step(run, state, layer_key, hidden, cache, args, kwargs)
                del runs[layer_key]
        batch, q_len = hidden.shape[:2]
        top_k = self.top_k_override or settings.top_k
        mode = self.mode_override or settings.routing_mode
        chosen_by_eval_mode = mode == "auto" and not self.training
        if mode == "auto":
            mode = "soft" if self.training else "hard"
        if mode == "hard" and cache is None and q_len < settings.dense_below and not self.routing_observers:
            # Dense anyway, nothing will continue from this call and nobody watches the groups (`record_routing`,
            # `focus-hf inspect`): routing it would only cost time.
            return self.base_layer(*args, **kwargs)
        state = self._routing_state(cache, adapter_name, batch, settings, hidden.device)
        valid = query_validity(kwargs.get("attention_mask"), batch, q_len, hidden.device, state.seen)
        one_step = cache is not None and q_len == 1
        dense_until = self._dense_decoding_until(adapter_name, mode, state, top_k) if one_step else 0
        if state.seen < dense_until:
            # The base model's decoding step: the token waits, unrouted, until the state is next read.
            if state.seen == 0:  # a new state (else the cache holds it already)
                attach_routing_states(cache)[layer_key] = state
                if self.decode_copy:  # a reused cache starts afresh: drop its old copies
                    grouped_key_copies(cache, layer_key, fresh=True)
            note_step(state, hidden, valid)
            vars(cache).setdefault(RUNS_ATTRIBUTE, {})[layer_key] = DecodingRun(
                settings, self._run_options(), dense_until
            )
            return self.base_layer(*args, **kwargs)
        # A hard-mode decoding step defers its key side: its own group is needed only once it lies beyond the
        # window, so the waiting tokens are routed in blocks (`defer_tokens`, `settle`). Its probes are needed
        # now unless the call attends densely (below dense_below), and can be had without the Sinkhorn step only
        # from a query router. Anything else - soft mode, prefill, observers, a full block - settles first.
        attends_densely = state.seen + q_len < settings.dense_below
        defer = (
            mode == "hard"
            and q_len == 1
            and cache is not None
            and not self.routing_observers
            and (attends_densely or adapter_name in self.focus_query_proj)
            and state.seen < block_until(state, settings)
        )
        if defer and not attends_densely and state.sinks_filled and not torch.compiler.is_compiling():
            # Past every sample's sinks the token is no sink: it waits in the state's list as a dense step's does
            # (`note_step`; the list is Python state, hence not under torch.compile), and the attention reads the
            # keys' groups with the waiting ones in none (`routing.waiting_keys`). So do the next steps, as a run,
            # until a block is full.
            run = DecodingRun(settings, self._run_options(), block_until(state, settings), top_k)
            queries = waiting_step(self.query_probes(adapter_name, hidden, top_k))
            note_step(state, hidden, valid)
            keys = state
            if not self._routers_need_gradient(adapter_name):
                vars(cache).setdefault(RUNS_ATTRIBUTE, {})[layer_key] = run
        elif defer:
            state = defer_noted_steps(state, settings.sink_tokens)
            # No probes where the call attends densely (top_groups -1).
            probes = None if attends_densely else self.query_probes(adapter_name, hidden, top_k)
            queries, keys = defer_tokens(hidden, valid, state, probes=probes, sink_tokens=settings.sink_tokens)
        else:
            state = defer_noted_steps(state, settings.sink_tokens)
            if state.pending:
                key_scores = self.router_scores(adapter_name, state.pending_hidden, query_side=False)
                state = settle(state, key_scores, settings.sinkhorn_iterations)
            queries, keys = self.route_tokens(adapter_name, hidden, valid, state, top_k)
        grouped_keys = None
        if cache is not None:
            attach_routing_states(cache)[layer_key] = keys
            if mode == "hard" and self.decode_copy:
                grouped_keys = grouped_key_copies(cache, layer_key, fresh=state.seen == 0)
        for observer in self.routing_observers:
            observer(self, queries)
        if mode == "hard" and self.training and self._routers_need_gradient(adapter_name):
            raise FocusRuntimeError(
                f"Training in hard routing mode (layer {self.layer_index}): hard routing picks groups with an "
                "argmax, which is not differentiable, so the routers would get no gradient (torch would report "
                "that the loss 'does not require grad'). Train in soft mode - `set_routing(model, 'soft')`, or "
                "'auto', which is soft in train mode - or with the distillation objective; switch to hard mode "
                "for inference after `model.eval()`."
            )
        output = self._attend(settings, mode, top_k, queries, keys, grouped_keys, hidden, args, kwargs)
        if chosen_by_eval_mode and self._routers_need_gradient(adapter_name):
            # Hard because the model is in eval mode, not because it was asked for (`set_routing(model, "hard")`
            # keeps gradients flowing to whatever else trains, the routers aside): hard routing gives the routers
            # no gradient. Where something else trains (the output already requires grad), a backward pass would
            # silently leave the routers untrained; it raises an error that says why instead. An output that needs
            # no gradient is left alone: making it need one would move every later layer onto the differentiable
            # attention paths (slower, other rounding), and a backward pass from it fails in torch anyway ("does
            # not require grad").
            output = _refuse_backward(output, self.focus_proj[adapter_name], self.layer_index)
        return output

    def _attend(
        self,
        settings: RouterSettings,
        mode: str,
        top_k: int,
        queries: TokenRouting,
        keys: RoutingState,
        grouped_keys: Optional[dict],
        hidden: torch.Tensor,
        args: tuple,
        kwargs: dict,
    ) -> Any:
        """The wrapped module's call, its attention function handed this call's routing."""
        routing = LayerRouting(
            mode=mode,
            backend=self.backend,
            window=settings.window,
            num_groups=settings.num_groups,
            top_k=top_k,
            gate_floor=settings.gate_floor,
            queries=queries,
            keys=keys,
            dense_below=settings.dense_below,
            sink_tokens=settings.sink_tokens,
            grouped_keys=grouped_keys,
            dense_kv_heads=settings.dense_kv_heads.get(self.layer_index, ()),
        )
        if mode == "hard" and path_platform(hidden.device, self.backend) == "gpu":
            self._verify_attention(hidden)
        # An argument of this call, never an attribute of the module: threads calling the model at once each hand
        # the attention function their own routing.
        output = self.base_layer(*args, **kwargs, **{ROUTING_ARGUMENT: routing}) if self._passes_keywords else None
        if not routing.consumed:
            raise FocusRuntimeError(
                f"{type(self.base_layer).__name__} did not pass its keyword arguments on to the model's attention "
                "function, so Focus routing would be silently ignored. This architecture is not supported."
            )
        return output

    def _run_step(
        self,
        run: DecodingRun,
        state: RoutingState,
        layer_key: tuple[str, int],
        hidden: torch.Tensor,
        cache: Any,
        args: tuple,
        kwargs: dict,
    ) -> Any:
        """A later step of `run` (`DecodingRun.next_state` found it one): its token waits in `state`; a dense run's
        step is then the base model's, a routed one's attends with the query router's probes."""
        if run.top_k is None:
            note_step(state, hidden, state.noted_steps.every_token_real)
            return self.base_layer(*args, **kwargs)
        queries = waiting_step(self.query_probes(layer_key[0], hidden, run.top_k))
        note_step(state, hidden, state.noted_steps.every_token_real)
        grouped_keys = grouped_key_copies(cache, layer_key, fresh=False) if self.decode_copy else None
        return self._attend(run.settings, "hard", run.top_k, queries, state, grouped_keys, hidden, args, kwargs)

    def _routers_need_gradient(self, adapter_name: str) -> bool:
        """Whether this call records autograd and `adapter_name`'s routers train: hard routing gives them no
        gradient, so the refusals of `forward` apply, and no step may skip them (`DecodingRun`)."""
        return torch.is_grad_enabled() and self.focus_proj[adapter_name].requires_grad

    def _run_options(self) -> tuple:
        """What a `DecodingRun` assumes of this layer besides its adapter's settings: the overrides of mode, top-k
        and backend, the group-sorted copies' switch, and train or eval mode ("auto" routing follows it)."""
        return (self.mode_override, self.top_k_override, self.backend, self.decode_copy, self.training)

    def _dense_decoding_until(self, adapter_name: str, mode: str, state: RoutingState, top_k: int) -> float:
        """How many tokens `state` may have seen for a one-token decoding step to decode as the base model's: one
        whose attention the pattern leaves whole (below `dense_below`, within the window, or every head of the
        layer dense) and that needs nothing else of the routing (`note_step`), the count rising by one a step.
        0 where no step may: soft mode, its groups watched, under torch.compile (the state's list is Python
        state), or where the routers would need a gradient (the refusals of `forward` apply)."""
        if (
            mode != "hard"
            or self.routing_observers
            or torch.compiler.is_compiling()
            or self._routers_need_gradient(adapter_name)
        ):
            return 0
        settings = self.focus_settings[adapter_name]
        until = block_until(state, settings)
        if self._every_head_dense(settings):
            return until
        # A step that has seen n tokens attends over n + 1 keys.
        first = first_restricted_length(mode, settings.window, settings.num_groups, top_k, settings.dense_below)
        return min(until, first - 1)

    def _every_head_dense(self, settings: RouterSettings) -> bool:
        """Whether `dense_heads` keeps every kv head of this layer dense, so that its attention never reads the
        routing (a layer a retrieval-head audit marks whole). Worked out once per settings object (asked at every
        decoding step; settings are replaced, never edited, when options change)."""
        known = self._every_head_dense_for
        if known is not None and known[0] is settings:
            return known[1]
        dense = settings.dense_kv_heads.get(self.layer_index)
        kv_heads = self._kv_heads()
        every = bool(dense) and kv_heads is not None and len(dense) >= kv_heads
        self._every_head_dense_for = (settings, every)
        return every

    def _kv_heads(self) -> Optional[int]:
        """The wrapped attention's kv heads (its query heads without GQA), from its config; None where it has none."""
        config = getattr(self.base_layer, "config", None)
        return getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)

    def _verify_attention(self, hidden: torch.Tensor) -> None:
        """On the GPU path, have the attention's shape verified (`attention.gpu.verify`) before the attention function
        runs: under torch.compile the check cannot run inside its graph, and here it breaks the graph once, at the
        first call, rather than in the attention."""
        if self.backend == "reference" or path_platform(hidden.device, self.backend) != "gpu":
            return
        config = getattr(self.base_layer, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        head_dim = getattr(self.base_layer, "head_dim", None)
        if not heads or not head_dim:
            return  # the attention function checks on its first (eager) call
        per_kv = heads // self._kv_heads()
        if not is_verified(hidden.device, hidden.dtype, per_kv, head_dim, self.backend):
            verify_shape(hidden.device, hidden.dtype, per_kv, head_dim, self.backend)

    def __repr__(self) -> str:
        return "focus." + super().__repr__()
