"""Configuration of a Focus adapter."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from peft.config import PeftConfig
from peft.utils import PeftType

from focus_hf.defaults import FOCUS_DEFAULTS, ROUTING_MODES
from focus_hf.errors import FocusConfigError, UnknownOptionError
from focus_hf.files import PEFT_TYPE_NAME
from focus_hf.tuner.targets import check_target_modules

# Accepted range of each numeric option, inclusive. The upper bounds are far above any useful value and keep a
# forward's cost bounded; temperature and gate_floor are bounded away from 0 so that scores and log-gates stay finite.
FIELD_RANGES: dict[str, tuple[float, float]] = {
    "num_groups": (1, 1024),
    "group_dim": (1, 4096),
    "window": (0, 1 << 24),
    "dense_below": (0, 1 << 31),
    "top_k": (1, 1024),
    "sink_tokens": (0, 4096),
    "sinkhorn_iterations": (1, 100),
    "temperature": (1e-3, 1e3),
    "gate_floor": (1e-12, 1.0),
}
_INTEGER_FIELDS = frozenset(
    {"num_groups", "group_dim", "window", "dense_below", "top_k", "sink_tokens", "sinkhorn_iterations"}
)


@dataclass
class FocusConfig(PeftConfig):
    """Configuration of a Focus adapter: a learned router in front of every attention layer.

    Each routed attention layer gets a projection `W_g` (hidden_size x group_dim) and `num_groups` centroids
    (num_groups x group_dim). Tokens are assigned to groups by causal Sinkhorn routing; attention between
    tokens more than `window` positions apart is allowed only when the key's group is among the query's
    `top_k` groups. The first `sink_tokens` tokens of every sequence stay visible to all later tokens.

    Args:
        num_groups: Number of groups K each layer sorts tokens into.
        group_dim: Width d_g of the routing space.
        window: Keys at most `window` positions behind a query are always attended (full local attention).
        top_k: Groups each query probes in hard mode (1 <= top_k <= num_groups).
        probe_mass: Adaptive probing: a query probes its groups best first and stops once the groups probed hold
            at least this share of its routing probability, so confident queries probe one group and unsure ones
            up to `top_k`. None (the default) probes exactly `top_k` groups.
        sink_tokens: Leading tokens every query may attend to (attention sinks); 0 disables them.
        temperature: Softmax temperature tau of the routing scores (cosine similarity / tau).
        sinkhorn_iterations: Causal Sinkhorn balancing iterations.
        query_projection: Give queries their own projection into the routing space (same centroids). Keys keep
            their Sinkhorn-balanced group from `W_g`; a query probes the groups where the keys it needs are filed,
            which need not be its own group. Adds hidden_size x group_dim parameters per layer.
        dense_heads: `[layer_index, kv_head]` pairs (routed-layer order) whose kv head, and the query heads that
            share it, keep full attention: speed traded for exactness where routing loses the most attention mass
            (`focus_hf.calibrate_dense_heads` picks them from a recall audit, `focus_hf.retrieval_dense_heads`
            from the heads that copy from far back).
        dense_below: In hard mode, a query with fewer keys than this (itself and the tokens before it) attends
            densely, exactly as the base model; later queries use the Focus pattern. Per query, not per call, so
            a text gives the same outputs whether it is run at once, in chunks or token by token (the routers
            still run, so a longer continuation routes from where it stands). Set it to the length below which
            the sparse path is not faster: then Focus changes nothing where it would not save time. 0 (the
            default) routes every query beyond the window.
        routing_mode: `"auto"` (soft while training, hard in eval mode), `"soft"` or `"hard"`.
        gate_floor: Smallest same-group probability the soft gate uses, so the log-gate stays finite.
        target_modules: Attention module names (or a regex) to route; `None` routes every supported
            self-attention module.
        layers_to_transform: Route only the attention modules of these layer indices (an int or a list), as in
            PEFT's LoRA: the index is the number after the layers container in the module name
            (`model.layers.3.self_attn` is layer 3). None routes every layer.
        layers_pattern: Name of the layers container (`"layers"`, `"h"`, or a list of names) used to read that index,
            for models whose module names hold more than one number; needs `layers_to_transform`.
        modules_to_save: Modules besides the routers to train and save with the adapter (e.g. `["lm_head"]`), through
            PEFT's own `ModulesToSaveWrapper`: a trainable copy per adapter, saved beside the routers, reloaded with
            them, deleted with the adapter. A routed attention module cannot be one of them.
        init_weights: True (the default): key and query projections start equal, so each query first probes the
            groups of keys like itself. False: every router tensor is drawn independently at random (the query
            projection too), as PEFT's tests ask of every adapter type to make a fresh adapter differ from the default
            one. Both draw from torch's global generator; loading overwrites either.
        hidden_size: Hidden size of the base model, recorded when the adapter is created so that a
            mismatching base model is refused before any weight is loaded.
        num_routed_layers: Number of attention layers routed, recorded likewise.
        base_model_type: `config.model_type` of the base model, recorded likewise.
    """

    num_groups: int = field(default=FOCUS_DEFAULTS["num_groups"], metadata={"help": "Number of groups K per layer."})
    group_dim: int = field(default=FOCUS_DEFAULTS["group_dim"], metadata={"help": "Width of the routing space d_g."})
    window: int = field(default=FOCUS_DEFAULTS["window"], metadata={"help": "Local window w of full attention."})
    top_k: int = field(default=FOCUS_DEFAULTS["top_k"], metadata={"help": "Groups each query probes in hard mode."})
    probe_mass: Optional[float] = field(
        default=FOCUS_DEFAULTS["probe_mass"],
        metadata={"help": "Adaptive probing: stop once the probed groups hold this routing mass."},
    )
    sink_tokens: int = field(
        default=FOCUS_DEFAULTS["sink_tokens"], metadata={"help": "Leading tokens always visible; 0 disables."}
    )
    temperature: float = field(default=FOCUS_DEFAULTS["temperature"], metadata={"help": "Routing temperature tau."})
    sinkhorn_iterations: int = field(
        default=FOCUS_DEFAULTS["sinkhorn_iterations"], metadata={"help": "Causal Sinkhorn iterations."}
    )
    query_projection: bool = field(
        default=False, metadata={"help": "Give queries their own routing projection (keys keep W_g)."}
    )
    dense_heads: Optional[list[list[int]]] = field(
        default=None, metadata={"help": "[layer, kv_head] pairs that keep full attention."}
    )
    dense_below: int = field(
        default=0, metadata={"help": "Hard mode: queries with fewer keys attend densely (0: route every query)."}
    )
    routing_mode: str = field(default=FOCUS_DEFAULTS["routing_mode"], metadata={"help": "'auto', 'soft' or 'hard'."})
    gate_floor: float = field(
        default=FOCUS_DEFAULTS["gate_floor"], metadata={"help": "Floor of the soft gate's probability."}
    )
    target_modules: Optional[Union[list[str], str]] = field(
        default=None, metadata={"help": "Attention modules to route; None routes all supported ones."}
    )
    layers_to_transform: Optional[Union[list[int], int]] = field(
        default=None, metadata={"help": "Layer indices to route; None routes every layer."}
    )
    layers_pattern: Optional[Union[list[str], str]] = field(
        default=None, metadata={"help": "Layers container holding the layer index (with layers_to_transform)."}
    )
    modules_to_save: Optional[list[str]] = field(
        default=None, metadata={"help": "Modules besides the routers to train and save with the adapter."}
    )
    init_weights: bool = field(
        default=True, metadata={"help": "True: query projection starts as the key projection; False: all random."}
    )
    hidden_size: Optional[int] = field(default=None, metadata={"help": "Recorded hidden size of the base."})
    num_routed_layers: Optional[int] = field(default=None, metadata={"help": "Recorded routed layer count."})
    base_model_type: Optional[str] = field(default=None, metadata={"help": "Recorded base model_type."})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = PeftType[PEFT_TYPE_NAME]  # the member `focus_hf.tuner.patches` adds
        self.validate()

    def validate(self) -> None:
        """Raise `FocusConfigError` naming the bad field and the accepted range (see `FIELD_RANGES`).

        The ranges keep an adapter from someone else from making a forward take minutes (100,000 Sinkhorn
        iterations) or return NaN (a temperature of 1e-40); they are checked at creation and again at load.
        """
        for name, (low, high) in FIELD_RANGES.items():
            value = getattr(self, name)
            if name in _INTEGER_FIELDS:
                if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                    raise FocusConfigError(f"FocusConfig.{name} must be an integer in [{low}, {high}], got {value!r}.")
            elif (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
                or not low <= value <= high
            ):
                raise FocusConfigError(f"FocusConfig.{name} must be a number in [{low:g}, {high:g}], got {value!r}.")
        if not self.top_k <= self.num_groups:
            raise FocusConfigError(
                f"FocusConfig.top_k must be between 1 and num_groups={self.num_groups}, got {self.top_k!r}."
            )
        if self.probe_mass is not None and (
            not isinstance(self.probe_mass, (int, float))
            or isinstance(self.probe_mass, bool)
            or not 0 < self.probe_mass <= 1
        ):
            raise FocusConfigError(
                f"FocusConfig.probe_mass must be None or a number in (0, 1], got {self.probe_mass!r}."
            )
        if not self.gate_floor < 1:
            raise FocusConfigError(f"FocusConfig.gate_floor must be in [1e-12, 1), got {self.gate_floor!r}.")
        check_target_modules(self.target_modules)
        if self.routing_mode not in ROUTING_MODES:
            raise FocusConfigError(
                f"FocusConfig.routing_mode must be one of {ROUTING_MODES}, got {self.routing_mode!r}."
            )
        if not isinstance(self.query_projection, bool):
            raise FocusConfigError(
                f"FocusConfig.query_projection must be true or false, got {self.query_projection!r}."
            )
        self._validate_peft_options()
        if self.dense_heads is not None:
            pairs = self.dense_heads if isinstance(self.dense_heads, (list, tuple)) else [self.dense_heads]
            for pair in pairs:
                if (
                    not isinstance(pair, (list, tuple))
                    or len(pair) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pair)
                ):
                    raise FocusConfigError(
                        "FocusConfig.dense_heads must be a list of [layer_index, kv_head] pairs of integers >= 0, "
                        f"got {self.dense_heads!r}."
                    )
            self.dense_heads = sorted({(int(layer), int(head)) for layer, head in pairs})
            self.dense_heads = [list(pair) for pair in self.dense_heads]

    def _validate_peft_options(self) -> None:
        """The options every PEFT user knows from LoRA, checked as LoRA checks them."""
        layers = self.layers_to_transform
        if layers is not None:
            values = [layers] if isinstance(layers, int) else layers
            if (
                not isinstance(values, (list, tuple))
                or not values
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)
            ):
                raise FocusConfigError(
                    "FocusConfig.layers_to_transform must be None, a layer index >= 0 or a non-empty list of them, "
                    f"got {layers!r}."
                )
            if isinstance(layers, tuple):
                self.layers_to_transform = list(layers)
            if isinstance(self.target_modules, str):
                raise FocusConfigError(
                    "FocusConfig.layers_to_transform cannot be used with a regex target_modules (as in LoRA): put the "
                    "layer indices in the regex, or pass target_modules as a list of names."
                )
        pattern = self.layers_pattern
        if pattern is not None:
            if not (isinstance(pattern, str) and pattern) and not (
                isinstance(pattern, (list, tuple)) and pattern and all(isinstance(p, str) and p for p in pattern)
            ):
                raise FocusConfigError(
                    f"FocusConfig.layers_pattern must be None, a name or a list of names, got {pattern!r}."
                )
            if layers is None:
                raise FocusConfigError(
                    "FocusConfig.layers_pattern only says where to read the layer index: set layers_to_transform too."
                )
        saved = self.modules_to_save
        if saved is not None:
            if not isinstance(saved, (list, tuple, set)) or not all(isinstance(m, str) and m for m in saved):
                raise FocusConfigError(
                    f"FocusConfig.modules_to_save must be None or a list of module names, got {saved!r}."
                )
            self.modules_to_save = list(saved)
        if not isinstance(self.init_weights, bool):
            raise FocusConfigError(
                f"FocusConfig.init_weights must be true or false (Focus has no named initialisations), "
                f"got {self.init_weights!r}."
            )


# PEFT task type -> the transformers auto-class mapping whose classes have that task. The Hub's "Use this model"
# snippet for a PEFT adapter picks `AutoModelFor<Task>` from `task_type` (CAUSAL_LM, SEQ_2_SEQ_LM, TOKEN_CLS, SEQ_CLS).
_TASK_MAPPINGS = {
    "CAUSAL_LM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "SEQ_CLS": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "TOKEN_CLS": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "QUESTION_ANS": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "FEATURE_EXTRACTION": "MODEL_MAPPING_NAMES",
}
_COMMIT_SHA_LENGTH = 40
# config.json keys that transformers writes but does not keep as they were (versions, dtype spelling, load-time state).
_UNSAVED_CONFIG_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype", "_name_or_path", "architectures"})


def wrapped_model_task(model: object) -> Optional[str]:
    """The PEFT task type of a transformers model, read from its class as transformers' auto classes map it
    (`LlamaForCausalLM` and `GPT2LMHeadModel` -> `"CAUSAL_LM"`, `LlamaModel` -> `"FEATURE_EXTRACTION"`); None for a
    class no auto class names."""
    from transformers.models.auto import modeling_auto

    name = type(model).__name__
    for task, mapping_name in _TASK_MAPPINGS.items():
        for classes in getattr(modeling_auto, mapping_name, {}).values():
            if name in ((classes,) if isinstance(classes, str) else tuple(classes)):
                return task
    return None


def base_model_commit(model: object) -> Optional[str]:
    """The Hub commit a model loaded by its Hub id was read from, as the huggingface_hub cache records it: the commit
    the default branch pointed to when the model was loaded, provided that commit's cached config.json is the model's
    configuration. None for a model from a local folder, one not in the cache, or one loaded at another revision
    whose configuration differs."""
    import json

    from huggingface_hub import try_to_load_from_cache

    model_config = getattr(model, "config", None)
    name = getattr(model_config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    if not isinstance(name, str) or not name or os.path.exists(name) or name.count("/") != 1:
        return None
    try:
        cached = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not a valid repo id
        return None
    if not isinstance(cached, str):
        return None
    commit = Path(cached).parent.name
    try:
        saved = json.loads(Path(cached).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    current = model_config.to_dict()
    same = all(current.get(key) == value for key, value in saved.items() if key not in _UNSAVED_CONFIG_KEYS)
    return commit if same and len(commit) == _COMMIT_SHA_LENGTH else None


def record_wrapped_model(config: FocusConfig, model: object) -> None:
    """Record in `config` what the Hub needs to load the adapter from its page: the wrapped model's task (`task_type`,
    unless set) and the commit of its Hub checkpoint (`revision`, unless set: `base_model_commit`). Adapters saved
    without them (task_type null) load as before."""
    if config.task_type is None:
        config.task_type = wrapped_model_task(model)
    if config.revision is None:
        config.revision = base_model_commit(model)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(FocusConfig))
_dataclass_init = FocusConfig.__init__


# Options of other PEFT configs (LoRA's mostly) that Focus does not take, with the reason; docs/limitations.md lists
# them. The unknown-option error names the reason instead of a bare "unknown".
UNSUPPORTED_PEFT_OPTIONS: dict[str, str] = {
    **dict.fromkeys(
        ("r", "lora_alpha", "lora_dropout", "use_rslora", "use_dora", "fan_in_fan_out", "init_lora_weights",
         "rank_pattern", "alpha_pattern", "lora_bias", "use_qalora", "loftq_config", "eva_config", "corda_config"),
        "Focus has no low-rank weight update: a router chooses which keys each query attends to",
    ),  # fmt: skip
    "bias": "Focus trains no bias (only its routers, and the modules in modules_to_save)",
    "exclude_modules": "choose the routed attention modules with target_modules or layers_to_transform",
    "target_parameters": "Focus wraps attention modules, not parameters",
    "trainable_token_indices": "train the embedding through modules_to_save=['embed_tokens'] instead",
    "ensure_weight_tying": "Focus ties no weights; a tied module in modules_to_save is trained as one copy",
    "layer_replication": "Focus routes the model's own layers only",
    "megatron_config": "Megatron-parallel layers are not routed",
}


@functools.wraps(_dataclass_init)
def _strict_init(self: FocusConfig, *args, **kwargs) -> None:
    # PEFT silently drops unknown config keys when the error says "got an unexpected keyword argument" (it catches
    # that TypeError and warns). An adapter whose config we do not understand may route differently than its author
    # intended, so it is refused with a message PEFT does not swallow; the error is a TypeError all the same, as any
    # PEFT config raises for an option it does not take.
    unknown = sorted(set(kwargs) - _FIELD_NAMES)
    if unknown:
        reasons = [f"{name}: {UNSUPPORTED_PEFT_OPTIONS[name]}" for name in unknown if name in UNSUPPORTED_PEFT_OPTIONS]
        raise UnknownOptionError(
            f"FocusConfig does not take the option(s) {unknown}"
            + (f" ({'; '.join(reasons)}; see docs/limitations.md)" if reasons else "")
            + f". Known options: {sorted(_FIELD_NAMES)}. Remove them from the call or from adapter_config.json, or "
            "upgrade focus_hf if the adapter was made by a newer version."
        )
    _dataclass_init(self, *args, **kwargs)


FocusConfig.__init__ = _strict_init  # type: ignore[method-assign]
