"""Router distillation: teach each layer's router to keep the attention mass the frozen model actually uses.

The language-model loss is a poor teacher for a selector: it rewards routers that change the model, not routers
that keep it. Here each layer's router is fitted to the model's own attention, layer by layer, with no
backpropagation through the model body (SeerAttention and DuoAttention distil their selectors the same way):

1. one dense pass of the base model per calibration sequence keeps, for every routed layer, the hidden states
   entering the attention block and, for sampled queries beyond the window, the mass on window + sinks and the
   `top_m` distant keys with the most mass (`focus_hf.fitting.capture`);
2. for each layer, Adam maximises the mass the soft routing keeps, per head and query:

       kept = local + sum_g q_g * (sum over the top keys j of mass_j * k_jg + tail * mean_j k_jg)

   where k are the keys' causal-Sinkhorn group probabilities (the assignment hard mode takes its top-1 from),
   q the query's probe probabilities (its own Sinkhorn row, or softmax of the query router), and `tail` the
   distant mass beyond the top keys, assumed spread like the groups. The loss is mean(-log kept) plus
   `balance_weight` x (K * sum_g mean(k_g)^2 - 1), which is 0 for balanced groups: the fast path's cost grows
   with the largest group.

Because the loss of a layer depends only on that layer's inputs, layers are fitted one after another; a run can
stop after any layer and resume (`checkpoint_dir`). Under a multi-process launch each process captures and fits on
its share of the sequences and the processes sum their gradients (`focus_hf.fitting.parallel`): every process ends
with the routers one process would fit on all the sequences.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from focus_hf.attention.routing import causal_sinkhorn
from focus_hf.files import replacing, write_atomically
from focus_hf.fitting.capture import DistantAttention, capture_layers, distant_attention, query_positions
from focus_hf.fitting.parallel import all_sum, global_sum, is_main_process, shard, sum_gradients
from focus_hf.tuner.controls import focus_layers
from focus_hf.tuner.layer import FocusLayer

CHECKPOINT_WEIGHTS = "distill_checkpoint.safetensors"
CHECKPOINT_STATE = "distill_state.json"


@dataclass
class DistillSettings:
    """Options of `distill_routers`.

    Attributes:
        steps: Adam steps per layer.
        lr: learning rate.
        top_m: distant keys kept per (head, query) as the target.
        queries_per_sequence: random queries beyond the window per sequence (the last 64 are always in).
        balance_weight: weight of the group-balance penalty.
        seed: seed of the query sample.
    """

    steps: int = 100
    lr: float = 0.01
    top_m: int = 64
    queries_per_sequence: int = 1024
    balance_weight: float = 0.5
    seed: int = 0


class _ConstantSparseMatmul(torch.autograd.Function):
    """matrix @ dense for a constant sparse CSR `matrix` whose transpose is given: the backward is then one more
    sparse product, instead of the slow generic path that transposes the CSR matrix at every step."""

    @staticmethod
    def forward(ctx, dense: torch.Tensor, matrix: torch.Tensor, transpose: torch.Tensor) -> torch.Tensor:
        ctx.transpose = transpose
        return matrix @ dense

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.transpose @ grad, None, None


@dataclass
class LayerTargets:
    """What one layer's router is fitted to, for all calibration sequences (stacked on dim 0).

    The top distant keys of every (sequence, head, query) are held as a sparse matrix `mass` of shape
    [S * H * n, S * T] (row: sequence, head, query; column: sequence, key), so that the mass per key group is one
    sparse product with the keys' group probabilities.
    """

    hidden: torch.Tensor  # [S, T, hidden_size]
    queries: torch.Tensor  # [S, n]
    local: torch.Tensor  # [S, H, n]
    tail: torch.Tensor  # [S, H, n] distant mass beyond the top keys
    mass: torch.Tensor  # sparse CSR [S * H * n, S * T]
    mass_transposed: torch.Tensor  # sparse CSR [S * T, S * H * n]
    head_weight: torch.Tensor  # [H] 0 for heads that stay dense


def _stack(attentions: list[DistantAttention], hiddens: list[torch.Tensor], head_weight: torch.Tensor) -> LayerTargets:
    top_keys = torch.stack([a.top_keys for a in attentions])  # [S, H, n, m]
    top_mass = torch.stack([a.top_mass for a in attentions])
    local = torch.stack([a.local for a in attentions])
    samples, heads, n, m = top_keys.shape
    seq = hiddens[0].shape[0]
    rows = torch.arange(samples * heads * n).repeat_interleave(m)
    columns = (top_keys + torch.arange(samples).view(samples, 1, 1, 1) * seq).reshape(-1)
    shape = (samples * heads * n, samples * seq)
    with warnings.catch_warnings():  # torch calls sparse CSR "beta"; only matmul with a dense matrix is used here
        warnings.simplefilter("ignore", UserWarning)
        coo = torch.sparse_coo_tensor(torch.stack([rows, columns]), top_mass.reshape(-1), shape).coalesce()
        mass, mass_transposed = coo.to_sparse_csr(), coo.t().coalesce().to_sparse_csr()
    return LayerTargets(
        hidden=torch.stack(hiddens),
        queries=torch.stack([a.queries for a in attentions]),
        local=local,
        tail=(1.0 - local - top_mass.sum(-1)).clamp_min(0.0),
        mass=mass,
        mass_transposed=mass_transposed,
        head_weight=head_weight,
    )


def collect_targets(
    model: nn.Module, sequences: Sequence[torch.Tensor], settings: DistillSettings, progress: bool = True
) -> dict[int, LayerTargets]:
    """Run the base model over `sequences` (equal lengths) and keep every routed layer's distillation targets
    (of this process's share of the sequences under a multi-process launch)."""
    layers = focus_layers(model)
    adapter = _adapter_name(layers[0])
    config = layers[0].focus_settings[adapter]
    sampled = query_sample(sequences, config.window, settings)
    mine = shard(len(sequences))
    per_layer: dict[int, tuple[list, list]] = {layer.layer_index: ([], []) for layer in layers}
    bar = _progress(len(mine), "capturing attention", progress)
    for index in mine:
        ids, queries = sequences[index], sampled[index]
        captures = capture_layers(model, ids)
        for index, capture in captures.items():
            attention = distant_attention(
                capture, queries, window=config.window, sinks=config.sink_tokens, top_m=settings.top_m
            )
            per_layer[index][0].append(attention)
            per_layer[index][1].append(capture.hidden.cpu())
        del captures
        bar.update(1)
    bar.close()
    return {layer.layer_index: layer_targets(layer, *per_layer[layer.layer_index]) for layer in layers}


def query_sample(sequences: Sequence[torch.Tensor], window: int, settings: DistillSettings) -> list[torch.Tensor]:
    """The target query positions of each sequence (equal lengths), drawn in order from `settings.seed`."""
    lengths = {len(ids.reshape(-1)) for ids in sequences}
    if len(lengths) != 1:
        raise ValueError(f"Distillation sequences must have one length, got {sorted(lengths)}.")
    generator = torch.Generator().manual_seed(settings.seed)
    (length,) = lengths
    return [query_positions(length, window, settings.queries_per_sequence, generator) for _ in sequences]


def layer_targets(layer: FocusLayer, attentions: list[DistantAttention], hiddens: list[torch.Tensor]) -> LayerTargets:
    """One layer's `LayerTargets` from its per-sequence attention summaries and attention inputs [seq, hidden]."""
    config = layer.focus_settings[_adapter_name(layer)]
    dense = {tuple(pair) for pair in config.dense_heads or []}
    heads = attentions[0].local.shape[0]
    kv_heads = _kv_heads(layer, heads)
    weight = torch.tensor(
        [0.0 if (layer.layer_index, h // (heads // kv_heads)) in dense else 1.0 for h in range(heads)]
    )
    return _stack(attentions, hiddens, weight)


def _kv_heads(layer: FocusLayer, heads: int) -> int:
    config = layer.base_layer.config
    return getattr(config, "num_key_value_heads", None) or heads


def _adapter_name(layer: FocusLayer) -> str:
    name = layer._active_router()
    if name is None:
        raise ValueError("The Focus adapter is disabled; enable it before distilling its routers.")
    return name


def _progress(total: int, description: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, disable=not (enabled and is_main_process()))


def kept_mass(layer: FocusLayer, adapter: str, targets: LayerTargets) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft kept mass [S, H, n] of every target query under the layer's current router, and the key probabilities."""
    settings = layer.focus_settings[adapter]
    hidden = targets.hidden.to(layer.focus_proj[adapter].device)
    scores, query_scores = layer.routing_scores(adapter, hidden)
    valid = torch.ones(scores.shape[:2], dtype=torch.bool, device=scores.device)
    key_log_probs, _ = causal_sinkhorn(scores, valid, settings.sinkhorn_iterations)
    key_probs = key_log_probs.exp()  # [S, T, K]
    probe_scores = key_log_probs if query_scores is None else torch.log_softmax(query_scores, dim=-1)
    rows = targets.queries.to(scores.device)
    probe = probe_scores.gather(1, rows[..., None].expand(-1, -1, settings.num_groups)).exp()  # [S, n, K]
    samples, heads, n = targets.local.shape
    flat_probs = key_probs.reshape(-1, settings.num_groups).cpu()
    group_mass = _ConstantSparseMatmul.apply(flat_probs, targets.mass, targets.mass_transposed)
    group_mass = group_mass.to(scores.device).view(samples, heads, n, settings.num_groups)
    local, tail = targets.local.to(scores.device), targets.tail.to(scores.device)
    # Tail keys of query i are among its earlier tokens; their groups are taken to follow the prefix average.
    prefix_mean = key_probs.cumsum(1) / torch.arange(1, key_probs.shape[1] + 1, device=scores.device)[None, :, None]
    tail_groups = prefix_mean.gather(1, rows[..., None].expand(-1, -1, settings.num_groups))  # [S, n, K]
    group_mass = group_mass + tail[..., None] * tail_groups[:, None]
    kept = local + (probe[:, None] * group_mass).sum(-1)
    return kept, key_probs


def _router_parameters(layer: FocusLayer, adapter: str) -> list[nn.Parameter]:
    parameters = [layer.focus_proj[adapter], layer.focus_centroids[adapter]]
    if adapter in layer.focus_query_proj:
        parameters.append(layer.focus_query_proj[adapter])
    return parameters


@dataclass
class LayerResult:
    """How one layer's fit ended (soft kept mass and balance on the calibration targets)."""

    layer: int
    kept_before: float
    kept_after: float
    largest_group: float
    loss: float


def fit_layer(layer: FocusLayer, targets: LayerTargets, settings: DistillSettings) -> LayerResult:
    """Fit one layer's router to its targets with Adam; the router parameters are updated in place.

    Under a multi-process launch `targets` hold this process's share of the sequences; the loss's means run over
    every process's share and the gradients are summed before each step, so all processes take the same steps.
    """
    adapter = _adapter_name(layer)
    num_groups = layer.focus_settings[adapter].num_groups
    parameters = _router_parameters(layer, adapter)
    saved_flags = [p.requires_grad for p in parameters]
    weight = targets.head_weight[None, :, None]
    samples, _, queries = targets.local.shape
    all_samples = float(all_sum(torch.tensor(float(samples))))  # over all processes
    denominator = float(weight.sum()) * all_samples * queries
    tokens = all_samples * targets.hidden.shape[1]
    with torch.no_grad():
        before = _weighted_mean(kept_mass(layer, adapter, targets)[0], weight)
    optimizer = torch.optim.Adam(parameters, lr=settings.lr)
    fit = balance = torch.tensor(math.nan)
    try:
        for p in parameters:
            p.requires_grad_(True)
        for _ in range(settings.steps):
            optimizer.zero_grad(set_to_none=True)
            with torch.enable_grad():
                kept, key_probs = kept_mass(layer, adapter, targets)
                fit = -(kept.clamp_min(1e-6).log() * weight.to(kept.device)).sum() / max(denominator, 1.0)
                share = global_sum(key_probs.sum(dim=(0, 1))) / tokens
                balance = num_groups * (share**2).sum() - 1.0
                (fit + settings.balance_weight * balance).backward()
            sum_gradients(parameters)
            optimizer.step()
    finally:
        for p, flag in zip(parameters, saved_flags):
            p.requires_grad_(flag)
            p.grad = None
    loss_value = float(all_sum(fit)) + settings.balance_weight * float(balance.detach())
    with torch.no_grad():
        kept, key_probs = kept_mass(layer, adapter, targets)
        groups = key_probs.argmax(-1)
        sizes = all_sum(torch.bincount(groups.flatten().cpu(), minlength=num_groups))
        largest = float(sizes.max() / sizes.sum())
    return LayerResult(layer.layer_index, before, _weighted_mean(kept, weight), largest, loss_value)


def _weighted_mean(kept: torch.Tensor, weight: torch.Tensor) -> float:
    """The mean of `kept` weighted by head, over every process's sequences."""
    weight = weight.to(kept.device).expand_as(kept)
    totals = all_sum(torch.stack([(kept * weight).sum(), weight.sum()]).cpu())
    return float(totals[0] / totals[1].clamp_min(1.0))


def _save_checkpoint(folder: Path, layers: list[FocusLayer], adapter: str, done: list[LayerResult]) -> None:
    if not is_main_process():
        return  # every process holds the same routers
    folder.mkdir(parents=True, exist_ok=True)
    finished = {result.layer for result in done}
    tensors = {}
    for layer in layers:
        if layer.layer_index in finished:
            for parameter_name, parameter in zip(
                ("proj", "centroids", "query_proj"), _router_parameters(layer, adapter)
            ):
                tensors[f"{layer.layer_index}.{parameter_name}"] = parameter.detach().cpu().contiguous()
    # Each file whole or not at all, the weights first: a run stopped in between (Ctrl-C, a full disk) leaves weights
    # of more layers than the state lists, and a resumed run reads those it lists.
    with replacing(folder / CHECKPOINT_WEIGHTS) as weights:
        save_file(tensors, str(weights))
    state = {"layers_done": [asdict(result) for result in done]}
    write_atomically(folder / CHECKPOINT_STATE, json.dumps(state, indent=1))


def _load_checkpoint(folder: Path, layers: list[FocusLayer], adapter: str) -> list[LayerResult]:
    state_path = folder / CHECKPOINT_STATE
    if not state_path.is_file():
        return []
    done = [LayerResult(**row) for row in json.loads(state_path.read_text())["layers_done"]]
    tensors = load_file(str(folder / CHECKPOINT_WEIGHTS))
    by_index = {layer.layer_index: layer for layer in layers}
    with torch.no_grad():
        for result in done:
            for parameter_name, parameter in zip(
                ("proj", "centroids", "query_proj"), _router_parameters(by_index[result.layer], adapter)
            ):
                saved = tensors.get(f"{result.layer}.{parameter_name}")
                if saved is None or saved.shape != parameter.shape:
                    raise ValueError(
                        f"The distillation checkpoint in {folder} does not match this adapter "
                        f"(layer {result.layer} {parameter_name}); delete it or start without resume."
                    )
                parameter.copy_(saved.to(parameter.device, parameter.dtype))
    return done


def distill_routers(
    model: nn.Module,
    sequences: Sequence[torch.Tensor],
    settings: Optional[DistillSettings] = None,
    *,
    checkpoint_dir: Optional[str | os.PathLike] = None,
    progress: bool = True,
) -> list[LayerResult]:
    """Fit every router of the model's active Focus adapter to the model's own attention (layer-local).

    Args:
        model: a model with an active Focus adapter (its routers are updated in place; the model stays frozen).
        sequences: calibration token ids, one tensor [seq] per sequence, all of one length: the length the
            adapter is meant for. Under a multi-process launch, give every process all of them: each works on
            its share.
        settings: a `DistillSettings` (defaults if None).
        checkpoint_dir: where to save progress after each layer; an existing checkpoint there is resumed.
        progress: show progress bars.

    Returns:
        One `LayerResult` per layer (soft kept mass before / after, largest group share, final loss).
    """
    settings = settings or DistillSettings()
    layers = focus_layers(model)
    adapter = _adapter_name(layers[0])
    folder = Path(checkpoint_dir) if checkpoint_dir is not None else None
    done = _load_checkpoint(folder, layers, adapter) if folder is not None else []
    finished = {result.layer for result in done}
    remaining = [layer for layer in layers if layer.layer_index not in finished]
    if not remaining:
        return done
    targets = collect_targets(model, sequences, settings, progress)
    bar = _progress(len(remaining), "distilling routers", progress)
    for layer in remaining:
        result = fit_layer(layer, targets.pop(layer.layer_index), settings)
        done.append(result)
        bar.set_postfix(layer=result.layer, kept=f"{result.kept_after:.3f}", largest=f"{result.largest_group:.2f}")
        bar.update(1)
        if folder is not None:
            _save_checkpoint(folder, layers, adapter, done)
    bar.close()
    return sorted(done, key=lambda result: result.layer)


def save_distilled_adapter(
    model: nn.Module,
    out_dir: str | os.PathLike,
    results: Sequence[LayerResult],
    settings: DistillSettings,
    *,
    base_model_name_or_path: Optional[str] = None,
    metadata: Optional[dict] = None,
) -> dict:
    """Save the adapter folder (adapter_config.json, adapter_model.safetensors, training_log.json).

    Returns:
        The training log written to training_log.json.
    """
    from focus_hf.base_models import weights_source
    from focus_hf.fitting.metadata import base_model_id, jsonable, versions
    from focus_hf.fitting.trainer import TRAINING_LOG_NAME

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    adapter = _adapter_name(focus_layers(model)[0])
    config = model.peft_config[adapter] if hasattr(model, "peft_config") else None
    base_id = base_model_id(model, base_model_name_or_path or (config.base_model_name_or_path if config else None))
    readme = out / "README.md"
    previous_card = readme.read_bytes() if readme.is_file() else None
    # As in focus_hf.fitting.trainer: save without the base id (PEFT would ask the Hub about it), record it after.
    if config is not None:
        config.base_model_name_or_path, config.inference_mode = None, True
    try:
        model.save_pretrained(os.fspath(out))
    finally:
        if config is not None:
            config.base_model_name_or_path, config.inference_mode = base_id, False
    config_path = out / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    saved["base_model_name_or_path"] = base_id
    write_atomically(config_path, json.dumps(saved, indent=2, sort_keys=True))
    if previous_card is not None:
        write_atomically(readme, previous_card)
    elif readme.exists():
        readme.unlink()
    log = {
        "objective": "distill",
        "settings": asdict(settings),
        "layers": [asdict(result) for result in sorted(results, key=lambda r: r.layer)],
        "kept_before": sum(r.kept_before for r in results) / max(len(results), 1),
        "kept_after": sum(r.kept_after for r in results) / max(len(results), 1),
        "largest_group_max": max((r.largest_group for r in results), default=None),
        "trainable_parameters": sum(
            p.numel() for layer in focus_layers(model) for p in _router_parameters(layer, adapter)
        ),
        "base_model": base_id,
        "base_weights": weights_source(model),
        "config": jsonable(saved),
        "versions": versions(),
    }
    if metadata:
        log["metadata"] = jsonable(metadata)
    write_atomically(out / TRAINING_LOG_NAME, json.dumps(log, indent=2) + "\n")
    return log
