"""The adapter a vLLM server runs: fetched and verified with the project's Hub code, checked against the served
model, and split into one router per attention layer."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from focus_hf.aliases import MODEL_ALIASES
from focus_hf.attention.routing import routing_scores, scaled_directions
from focus_hf.errors import FocusServingError
from focus_hf.files import CONFIG_NAME, validate_adapter_folder
from focus_hf.tuner.config import FocusConfig
from focus_hf.tuner.layer import RouterSettings
from focus_hf.vllm.checks import requested_adapter

LAYER_MODULE = "model.layers.{index}.self_attn"


@dataclass
class LayerRouter:
    """The router of one attention layer: its tensors (float32, on the layer's device once moved) and settings."""

    layer_index: int
    settings: RouterSettings
    projection: torch.Tensor
    centroids: torch.Tensor
    query_projection: Optional[torch.Tensor]

    def __post_init__(self) -> None:
        # Worked out once: the centroids never change while serving (`routing.scaled_directions`).
        self.directions = scaled_directions(self.centroids, self.settings.temperature)

    @property
    def dense_kv_heads(self) -> tuple[int, ...]:
        """The kv heads of this layer that keep full attention (`FocusConfig.dense_heads`)."""
        return self.settings.dense_kv_heads.get(self.layer_index, ())

    def to(self, device: torch.device) -> "LayerRouter":
        """This router with its tensors on `device` (itself when they are there already)."""
        if self.projection.device == device:
            return self
        query = None if self.query_projection is None else self.query_projection.to(device)
        return LayerRouter(
            self.layer_index, self.settings, self.projection.to(device), self.centroids.to(device), query
        )

    def scores(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Key-side and (with a query router) query-side scores [tokens, K] / tau of hidden states [tokens, hidden]:
        the same `routing.routing_scores` the transformers adapter computes."""
        temperature = self.settings.temperature
        keys = routing_scores(hidden, self.projection, self.centroids, temperature, self.directions)
        if self.query_projection is None:
            return keys, None
        return keys, routing_scores(hidden, self.query_projection, self.centroids, temperature, self.directions)


@dataclass
class ServedAdapter:
    """A verified Focus adapter and where it came from."""

    source: str  # what the user named: a Hub id or a folder
    revision: str  # the Hub commit served, or "local folder"
    folder: Path
    config: FocusConfig
    routers: dict[int, LayerRouter]

    @property
    def settings(self) -> RouterSettings:
        return RouterSettings.from_config(self.config)

    def describe(self) -> str:
        """One line for the server log: what was loaded and how it routes."""
        config = self.config
        dense = config.dense_heads or []
        probes = f"top-{config.top_k}" + (f" (adaptive, mass {config.probe_mass})" if config.probe_mass else "")
        return (
            f"Focus adapter {self.source} @ {self.revision}: {len(self.routers)} routed layers, K={config.num_groups}, "
            f"{probes}, window={config.window}, sinks={config.sink_tokens}, dense heads={len(dense)} "
            f"(layer, kv head) pairs, dense_below={config.dense_below}, query router="
            f"{'yes' if config.query_projection else 'no'}"
        )


def resolve_adapter_folder(source: str, revision: Optional[str] = None) -> tuple[Path, str]:
    """A local adapter folder as it is, or a Hub id pulled and verified with `focus_hf.hub.pull_adapter` (checksums
    against the Hub's tree, safetensors only, no pickles). Returns (folder, revision served)."""
    if not isinstance(source, str) or not source.strip():
        raise FocusServingError(
            f'"focus_adapter" must name an adapter: a Hub id ("org/name") or a local folder, got {source!r}.'
        )
    local = Path(os.path.expanduser(source))
    if local.is_dir():
        if revision is not None:
            raise FocusServingError(
                f'"focus_adapter_revision" ({revision!r}) applies to Hub ids only; {source} is a local folder.'
            )
        return local, "local folder"
    if os.sep in source.strip("/").replace("/", "", 1) or source.startswith((".", "/", "~")):
        raise FocusServingError(f'"focus_adapter": {source} is neither an existing folder nor a Hub id "org/name".')
    from focus_hf.hub import pull_adapter

    folder = pull_adapter(source, revision=revision)
    return folder, folder.name  # pull_adapter returns the snapshot folder, named after the commit


def _served_model_ids(model: str, hf_config: Any) -> set[str]:
    """The names the served model answers to: what vLLM was given, and the Hub id of an embedded model's converted
    folder (focus_hf's GGUF conversion records its source in config.json)."""
    names = {model.rstrip("/")}
    source = getattr(hf_config, "focus_source", None)
    for spec in MODEL_ALIASES.values():
        if source and source == spec.source:
            names.add(spec.hub_id)
    return names


def check_base_model(config: FocusConfig, model: str, hf_config: Any) -> None:
    """Refuse an adapter made for another model: type, width and layer count must match, and a recorded base model
    name must be the served one (a local folder that records no name is accepted on the checks of its shape)."""
    found = {
        "base_model_type": getattr(hf_config, "model_type", None),
        "hidden_size": getattr(hf_config, "hidden_size", None),
        "num_routed_layers": getattr(hf_config, "num_hidden_layers", None),
    }
    mismatches = [
        f"{name}: adapter has {getattr(config, name)!r}, served model has {value!r}"
        for name, value in found.items()
        if getattr(config, name) is not None and getattr(config, name) != value
    ]
    base = config.base_model_name_or_path
    served = _served_model_ids(model, hf_config)
    is_hub_id = not Path(model).exists()
    if base and base not in served and (is_hub_id or getattr(hf_config, "focus_source", None)):
        mismatches.append(f"base model: adapter was made for {base}, the server runs {model}")
    if mismatches:
        raise FocusServingError(
            "The Focus adapter does not fit the served model (" + "; ".join(mismatches) + "). Serve the model it was "
            f"made for ({base or 'see its adapter_config.json'}), or an adapter made for this one."
        )


def _routers(folder: Path, config: FocusConfig, num_layers: int) -> dict[int, LayerRouter]:
    expected = {
        "focus_proj": (config.hidden_size, config.group_dim),
        "focus_centroids": (config.num_groups, config.group_dim),
    }
    if config.query_projection:
        expected["focus_query_proj"] = (config.hidden_size, config.group_dim)
    modules = {LAYER_MODULE.format(index=index): dict(expected) for index in range(num_layers)}
    # names, dtypes, shapes, finite values, safetensors format; the tensors checked are the ones served
    tensors = validate_adapter_folder(folder, modules)
    settings = RouterSettings.from_config(config)
    routers = {}
    for index in range(num_layers):
        prefix = "base_model.model." + LAYER_MODULE.format(index=index) + "."
        query = tensors.get(prefix + "focus_query_proj")
        routers[index] = LayerRouter(
            index,
            settings,
            tensors[prefix + "focus_proj"].float(),
            tensors[prefix + "focus_centroids"].float(),
            None if query is None else query.float(),
        )
    return routers


@functools.lru_cache(maxsize=4)
def _load(source: str, revision: Optional[str], model: str, hf_config_json: str) -> ServedAdapter:
    from transformers import PretrainedConfig

    hf_config = PretrainedConfig.from_dict(json.loads(hf_config_json))
    folder, served_revision = resolve_adapter_folder(source, revision)
    if not (folder / CONFIG_NAME).is_file():
        raise FocusServingError(f"{source}: no {CONFIG_NAME} in {folder}; not a Focus adapter folder.")
    import focus_hf  # noqa: F401  (registers the FOCUS peft type that FocusConfig.from_pretrained reads)

    config = FocusConfig.from_pretrained(str(folder))
    if config.routing_mode == "soft":
        raise FocusServingError(
            f"{source} routes in soft mode (routing_mode='soft'): soft routing attends to every pair, a training "
            "mode. Serving runs hard (sparse) routing: save the adapter with routing_mode 'auto' or 'hard'."
        )
    if config.target_modules is not None:
        raise FocusServingError(
            f"{source} routes only some attention layers (target_modules={config.target_modules!r}); serving with "
            "vLLM supports adapters that route every layer (target_modules=None)."
        )
    if config.layers_to_transform is not None:
        raise FocusServingError(
            f"{source} routes only some layers (layers_to_transform={config.layers_to_transform!r}); serving with "
            "vLLM supports adapters that route every layer (layers_to_transform=None)."
        )
    if config.modules_to_save:
        raise FocusServingError(
            f"{source} trains modules besides its routers (modules_to_save={config.modules_to_save!r}), which the "
            "vLLM integration does not load (it applies routers only); serve it with transformers, or train an "
            "adapter without modules_to_save."
        )
    check_base_model(config, model, hf_config)
    routers = _routers(folder, config, hf_config.num_hidden_layers)
    return ServedAdapter(source, served_revision, folder, config, routers)


def load_served_adapter(source: str, model: str, hf_config: Any, revision: Optional[str] = None) -> ServedAdapter:
    """Fetch, verify and check the adapter `source` (Hub id or folder) for the served `model` (its name or folder and
    its transformers config). Cached per process: vLLM builds every layer from the same adapter.

    Raises:
        FocusServingError: the adapter does not fit the model, or cannot be served (soft mode, partial routing).
        focus_hf.errors.AdapterFileError / AdapterIntegrityError / NotAFocusAdapterError: bad or tampered files.
    """
    config_json = json.dumps(hf_config.to_dict(), sort_keys=True, default=str)
    return _load(source, revision, model, config_json)


def served_adapter(vllm_config: Any) -> Optional[ServedAdapter]:
    """The adapter the engine of `vllm_config` serves (loaded and checked once per process), or None."""
    if vllm_config is None or vllm_config.model_config is None:
        return None
    requested = requested_adapter(vllm_config.additional_config)
    if requested is None:
        return None
    source, revision = requested
    model_config = vllm_config.model_config
    return load_served_adapter(source, model_config.model, model_config.hf_config, revision=revision)
