"""Training Focus routers with transformers' `Trainer`.

Only the routers (one projection and one set of centroids per attention layer) are trainable in a Focus
adapter; everything else is frozen by PEFT. `train_adapter` runs the ordinary causal language-model loss through
`transformers.Trainer`, so the usual launchers (accelerate, torchrun/DDP, FSDP, bf16 mixed precision) work
unchanged, and checkpoints under `<out_dir>/checkpoints` make a run resumable.

While it trains, `GroupBalanceCallback` watches how tokens spread over the groups, from the routing that the
training forward passes compute anyway (no extra forward pass): the share of tokens in each layer's largest group
("dominance"). Uniform routing gives 1/num_groups; a dominance near 1 means the layer routes every token to one
group, which silently turns the sparse pattern back into full attention (or starves it). The callback logs a
warning when a layer's dominance exceeds a threshold.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import get_last_checkpoint

from focus_hf.base_models import weights_source
from focus_hf.files import CHECKPOINTS_DIR, write_atomically
from focus_hf.fitting.metadata import base_model_id, jsonable, versions
from focus_hf.interpret.groups import RoutingRecorder, group_assignments
from focus_hf.quiet import quiet_logs
from focus_hf.tuner.controls import focus_layers

__all__ = [
    "CHECKPOINTS_DIR",
    "TRAINING_LOG_NAME",
    "GroupBalanceCallback",
    "TokenBlockDataset",
    "dominance",
    "train_adapter",
]

logger = logging.getLogger(__name__)
# Trainer orders checkpoints by modification time and says so when two were written within a second of each other
# (short runs, small models): it then orders them by step, which is what the rotation needs anyway.
_TRAINER_NOISE = {"transformers.trainer_utils": (r"mtime may not be reliable on this filesystem",)}

TRAINING_LOG_NAME = "training_log.json"
DEFAULT_DOMINANCE_THRESHOLD = 0.5


class TokenBlockDataset(torch.utils.data.Dataset):
    """Fixed-length token blocks (`data.token_blocks`) as causal-LM examples: input_ids = labels = the block."""

    def __init__(self, blocks: torch.Tensor) -> None:
        if blocks.dim() != 2 or blocks.shape[0] == 0:
            raise ValueError(f"expected a non-empty LongTensor [n_blocks, seq_len], got shape {tuple(blocks.shape)}")
        self.blocks = blocks.long()

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block}


def dominance(groups: torch.Tensor, num_groups: int, valid: Optional[torch.Tensor] = None) -> float:
    """Share of tokens whose (top-1) group is the most popular one.

    Args:
        groups: LongTensor [..., top_k] of group indices, as in `group_counts`.
        num_groups: K.
        valid: optional bool mask of shape `groups.shape[:-1]` of the tokens to count.
    """
    return _largest_share(group_counts(groups, num_groups, valid))


def _largest_share(counts: torch.Tensor) -> float:
    total = counts.sum()
    return float(counts.max() / total) if total > 0 else 0.0


def group_counts(groups: torch.Tensor, num_groups: int, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Tokens per group (int64 [num_groups]) counting each token's own group.

    Args:
        groups: LongTensor [..., top_k] (as recorded by `FocusLayer` or returned by `group_assignments`); the
            first entry of the last dimension is the token's own (top-1) group.
        num_groups: K.
        valid: optional bool mask of shape `groups.shape[:-1]`, False for tokens not to count (padding).
    """
    own = groups[..., 0]
    if valid is not None:
        own = own[valid]
    return torch.bincount(own.reshape(-1).cpu(), minlength=num_groups)[:num_groups]


def _num_groups(layer: nn.Module) -> int:
    return max(settings.num_groups for settings in layer.focus_settings.values())


class GroupBalanceCallback(TrainerCallback, ExportableState):
    """Tracks each routed layer's group dominance during training and warns when groups collapse.

    The routing each training forward pass computes is recorded (through `focus_hf.interpret.groups.RoutingRecorder`),
    counted per layer, and every `every` optimizer steps the dominance over those steps is appended to `history`
    and checked against `threshold`. The history is saved with each checkpoint and restored on resume.

    Args:
        every: steps between dominance checks.
        threshold: dominance above which a layer is reported as collapsing (uniform routing gives 1/K).
        history: earlier records (restored from a checkpoint).
        train_seconds: wall time of earlier runs (restored from a checkpoint).
    """

    def __init__(
        self,
        every: int = 10,
        threshold: float = DEFAULT_DOMINANCE_THRESHOLD,
        history: Optional[list[dict[str, Any]]] = None,
        train_seconds: float = 0.0,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every
        self.threshold = threshold
        self.history: list[dict[str, Any]] = list(history or [])
        self.train_seconds = float(train_seconds)
        self.warnings: list[str] = []
        self._layers: list[nn.Module] = []
        self._recorder: Optional[RoutingRecorder] = None
        self._counts: dict[int, torch.Tensor] = {}
        self._run_started: Optional[float] = None

    # --- ExportableState: saved into trainer_state.json with every checkpoint ---------------------------------
    def state(self) -> dict:
        return {
            "args": {"every": self.every, "threshold": self.threshold},
            "attributes": {"history": self.history, "train_seconds": self.elapsed()},
        }

    def elapsed(self) -> float:
        """Training wall time so far, earlier (resumed-from) runs included."""
        running = time.perf_counter() - self._run_started if self._run_started is not None else 0.0
        return self.train_seconds + running

    # --- recording -----------------------------------------------------------------------------------------------
    def _start_recording(self) -> None:
        self._stop_recording()
        self._recorder = RoutingRecorder(self._layers).attach()

    def _stop_recording(self) -> None:
        if self._recorder is not None:
            self._recorder.detach()
            self._recorder = None

    def _collect(self) -> None:
        if self._recorder is None:
            return
        recorded = self._recorder.take()
        for layer in self._layers:
            calls = recorded.get(layer.layer_index) or []
            if calls:
                counts = sum(group_counts(routing.top_groups, _num_groups(layer)) for routing in calls)
                previous = self._counts.get(layer.layer_index)
                self._counts[layer.layer_index] = counts if previous is None else previous + counts

    def check(self, step: int) -> Optional[dict[str, Any]]:
        """Turn the counts gathered since the last check into a history record; warn about collapsing layers."""
        if not self._counts:
            return None
        layers = sorted(self._counts)
        values = [round(_largest_share(self._counts[index]), 4) for index in layers]
        worst = max(range(len(layers)), key=values.__getitem__)
        record = {
            "step": step,
            "layers": layers,
            "dominance": values,
            "max": values[worst],
            "max_layer": layers[worst],
            "mean": round(sum(values) / len(values), 4),
        }
        self.history.append(record)
        self._counts = {}
        collapsing = [f"layer {index}: {value:.2f}" for index, value in zip(layers, values) if value > self.threshold]
        if collapsing:
            message = (
                f"Focus groups are collapsing at step {step}: share of tokens in the largest group exceeds "
                f"{self.threshold:.2f} in {len(collapsing)}/{len(layers)} layers ({', '.join(collapsing[:8])}"
                f"{', ...' if len(collapsing) > 8 else ''}). A collapsed layer attends (almost) fully and gains no "
                "sparsity; try more Sinkhorn iterations, a higher temperature or a lower learning rate."
            )
            self.warnings.append(message)
            logger.warning(message)
        return record

    # --- TrainerCallback hooks ---------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        try:
            self._layers = focus_layers(model) if model is not None else []
        except ValueError:  # not a Focus model (e.g. a LoRA baseline trained the same way): nothing to track
            self._layers = []
        self._counts = {}
        self._run_started = time.perf_counter()
        self._start_recording()

    def on_step_end(self, args, state, control, **kwargs):
        self._collect()
        if state.global_step % self.every == 0 and state.is_world_process_zero:
            self.check(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self._collect()
        if state.is_world_process_zero and (not self.history or self.history[-1]["step"] != state.global_step):
            self.check(state.global_step)
        self.train_seconds = self.elapsed()
        self._run_started = None
        self._stop_recording()


class _ResumedScheduleSync(TrainerCallback):
    """After resuming, put the learning rate the current schedule gives at the resumed step into the optimizer.

    The optimizer state restored from a checkpoint carries the learning rate of the run that wrote it; when the
    resumed run has a different `steps` (the schedule was stretched), the first resumed step would otherwise use
    the old schedule's value (e.g. 0 at the end of a finished cosine schedule).
    """

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if optimizer is None or not isinstance(lr_scheduler, torch.optim.lr_scheduler.LambdaLR):
            return
        rates = [
            base * schedule(lr_scheduler.last_epoch)
            for base, schedule in zip(lr_scheduler.base_lrs, lr_scheduler.lr_lambdas)
        ]
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate
        lr_scheduler._last_lr = rates


def _adapter_config(model: nn.Module, adapter_name: str) -> Any:
    configs = getattr(model, "peft_config", None)
    if not configs or adapter_name not in configs:
        raise ValueError(
            f"{type(model).__name__} has no adapter {adapter_name!r}: train_adapter expects a PeftModel made with "
            "get_peft_model(model, focus_hf.FocusConfig(...))."
        )
    return configs[adapter_name]


def cpu_only_distributed() -> bool:
    """Launched as several processes (torchrun / accelerate launch) on a machine without CUDA or XPU.

    transformers' `TrainingArguments` then needs `use_cpu=True` to set up data-parallel training (gloo); without
    it each process silently trains alone on all the data.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    xpu = getattr(torch, "xpu", None)
    return not torch.cuda.is_available() and not (xpu is not None and xpu.is_available())


def train_adapter(
    model: nn.Module,
    train_blocks: torch.Tensor,
    out_dir: str | os.PathLike,
    *,
    steps: int = 100,
    lr: float = 5e-3,
    batch_size: int = 1,
    seed: int = 0,
    save_steps: Optional[int] = None,
    logging_steps: int = 1,
    warmup_steps: float = 0.05,
    lr_scheduler_type: str = "cosine",
    gradient_accumulation_steps: int = 1,
    resume: bool = False,
    balance_every: Optional[int] = None,
    dominance_threshold: float = DEFAULT_DOMINANCE_THRESHOLD,
    balance_blocks: Optional[torch.Tensor] = None,
    base_model_name_or_path: Optional[str] = None,
    adapter_name: str = "default",
    progress_bar: bool = True,
    save_total_limit: Optional[int] = 2,
    extra_metadata: Optional[dict[str, Any]] = None,
    callbacks: Optional[list[TrainerCallback]] = None,
    **training_args: Any,
) -> dict[str, Any]:
    """Train the routers of a Focus adapter with `transformers.Trainer` and save a ready-to-load adapter folder.

    Args:
        model: a `PeftModel` carrying a Focus adapter (`get_peft_model(model, FocusConfig(...))`). Only its
            trainable parameters (the routers) are updated.
        train_blocks: LongTensor [n_blocks, seq_len] of training tokens, e.g. `data.token_blocks(...)`.
        out_dir: where the adapter is written (`adapter_config.json`, `adapter_model.safetensors`,
            `training_log.json`); checkpoints go to `<out_dir>/checkpoints`.
        steps: optimizer steps in total (a resumed run continues up to this count).
        lr: peak learning rate of AdamW.
        batch_size: blocks per device per step.
        seed: seed of initialisation-independent randomness (data order, dropout).
        save_steps: checkpoint every this many steps (default: a quarter of `steps`, at least 1).
        logging_steps: loss / learning-rate logging interval.
        warmup_steps: warm-up steps (a float < 1 is a fraction of `steps`).
        lr_scheduler_type: transformers scheduler name.
        gradient_accumulation_steps: micro-batches per optimizer step.
        resume: continue from the last checkpoint under `<out_dir>/checkpoints` (starts fresh when there is none).
        balance_every: steps between group-dominance checks (default: `logging_steps`, at least 1).
        dominance_threshold: dominance above which a warning says the groups are collapsing.
        balance_blocks: optional held-out blocks; the dominance of the final routers on them is recorded.
        base_model_name_or_path: base model to record in the adapter config (an alias maps to its Hub id);
            default: read from the model's config.
        adapter_name: the adapter to train.
        progress_bar: show Trainer's progress bar.
        save_total_limit: checkpoints kept.
        extra_metadata: added to `training_log.json` under "metadata".
        callbacks: further `TrainerCallback`s.
        **training_args: any further `TrainingArguments` (e.g. `bf16=True`, `gradient_checkpointing=True`).

    Returns:
        The training log (also written to `<out_dir>/training_log.json`).
    """
    out_dir = Path(out_dir)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    config = _adapter_config(model, adapter_name)
    dataset = TokenBlockDataset(train_blocks)
    seq_len = dataset.blocks.shape[1]
    if getattr(config, "window", None) is not None and seq_len - 1 <= config.window:
        raise ValueError(
            f"training blocks of {seq_len} tokens fit in the local window ({config.window}): attention is full there, "
            "so the routers would get no gradient. Use blocks longer than window + 1 tokens, or a smaller window."
        )
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters: was the adapter loaded with is_trainable=False?")
    checkpoint_dir = out_dir / CHECKPOINTS_DIR
    save_steps = save_steps or max(steps // 4, 1)
    every = balance_every or max(logging_steps, 1)

    resume_from = None
    previous_state: Optional[dict[str, Any]] = None
    if resume and checkpoint_dir.is_dir():
        resume_from = get_last_checkpoint(os.fspath(checkpoint_dir))
    if resume and resume_from is None:
        logger.warning("resume=True but no checkpoint was found under %s; training from the start.", checkpoint_dir)
    if resume_from is not None:
        state_file = Path(resume_from) / "trainer_state.json"
        if state_file.is_file():
            previous_state = json.loads(state_file.read_text())

    balance = GroupBalanceCallback(every=every, threshold=dominance_threshold)
    if previous_state is not None:
        saved = previous_state.get("stateful_callbacks", {}).get(GroupBalanceCallback.__name__)
        saved = saved[0] if isinstance(saved, list) and saved else saved
        if isinstance(saved, dict):
            balance.history = list(saved.get("attributes", {}).get("history", []))
            balance.train_seconds = float(saved.get("attributes", {}).get("train_seconds", 0.0))

    defaults = dict(
        output_dir=os.fspath(checkpoint_dir),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        learning_rate=lr,
        weight_decay=0.0,
        warmup_steps=warmup_steps,
        lr_scheduler_type=lr_scheduler_type,
        seed=seed,
        data_seed=seed,
        logging_steps=logging_steps,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=save_steps,
        save_total_limit=save_total_limit,
        report_to="none",
        disable_tqdm=not progress_bar,
        dataloader_pin_memory=torch.cuda.is_available(),
        include_num_input_tokens_seen=True,
        remove_unused_columns=False,
    )
    if cpu_only_distributed():
        # Without it, Trainer under torchrun on CPU-only machines runs every process as a separate one-process job.
        defaults["use_cpu"] = True
    defaults.update(training_args)
    args = TrainingArguments(**defaults)

    started = time.perf_counter()
    extra_callbacks = [balance, *(callbacks or [])]
    if resume_from is not None:
        extra_callbacks.append(_ResumedScheduleSync())
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=extra_callbacks)
    with quiet_logs(_TRAINER_NOISE):
        result = trainer.train(resume_from_checkpoint=resume_from)
    run_seconds = time.perf_counter() - started
    model.eval()

    heldout = None
    if balance_blocks is not None:
        # Every process runs this forward (a sharded FSDP model needs all ranks); only the main one records it.
        device = next(p for p in model.parameters()).device
        assignments = group_assignments(model, balance_blocks.to(device))
        layers = sorted(assignments)
        values = [round(dominance(assignments[i], _num_groups(_layer_by_index(model, i))), 4) for i in layers]
        heldout = {"blocks": int(balance_blocks.shape[0]), "layers": layers, "dominance": values, "max": max(values)}

    base_id = base_model_id(model, base_model_name_or_path)
    # PEFT's save_pretrained asks the Hub whether a Hub-id base has a config.json (to decide about embedding
    # layers, which Focus never trains): save without the id and record it afterwards, so saving stays offline.
    config.base_model_name_or_path = None
    config.inference_mode = True
    readme = out_dir / "README.md"
    previous_card = readme.read_bytes() if readme.is_file() else None
    # Trainer.save_model gathers sharded (FSDP/DeepSpeed) weights and writes on the main process only.
    trainer.save_model(os.fspath(out_dir))
    config.inference_mode = False
    config.base_model_name_or_path = base_id
    if not trainer.is_world_process_zero():
        return {}
    config_path = out_dir / "adapter_config.json"
    saved_config = json.loads(config_path.read_text())
    saved_config["base_model_name_or_path"] = base_id
    write_atomically(config_path, json.dumps(saved_config, indent=2, sort_keys=True))
    # PEFT writes a generic template card over README.md: keep the one that was there (focus_hf.card writes ours),
    # or none. Trainer also pickles its arguments next to the adapter; adapters are safetensors-only.
    if previous_card is not None:
        write_atomically(readme, previous_card)
    elif readme.exists():
        readme.unlink()
    (out_dir / "training_args.bin").unlink(missing_ok=True)

    state = trainer.state
    losses = [
        {key: entry[key] for key in ("step", "loss", "learning_rate", "grad_norm", "epoch") if key in entry}
        for entry in state.log_history
        if "loss" in entry
    ]
    summary = next((entry for entry in reversed(state.log_history) if "train_runtime" in entry), {})
    world = max(args.world_size, 1)
    tokens_seen = int(
        state.num_input_tokens_seen or state.global_step * batch_size * gradient_accumulation_steps * world * seq_len
    )
    log = {
        "steps": state.global_step,
        "max_steps": steps,
        "resumed_from": os.fspath(Path(resume_from).relative_to(out_dir)) if resume_from else None,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "world_size": world,
        "train_blocks": int(dataset.blocks.shape[0]),
        "tokens_seen": tokens_seen,
        "lr": lr,
        "lr_scheduler_type": lr_scheduler_type,
        "warmup_steps": warmup_steps,
        "seed": seed,
        "wall_time_s": round(balance.train_seconds, 2),
        "run_wall_time_s": round(run_seconds, 2),
        "train_loss": result.training_loss if result is not None else None,
        "final_loss": losses[-1]["loss"] if losses else None,
        "trainable_parameters": sum(p.numel() for p in trainable),
        "base_model": config.base_model_name_or_path,
        "base_weights": weights_source(model),
        "config": jsonable(config.to_dict()),
        "loss": losses,
        "dominance": balance.history,
        "dominance_threshold": dominance_threshold,
        "dominance_warnings": len(balance.warnings),
        "heldout_dominance": heldout,
        "trainer_summary": {k: v for k, v in summary.items() if k != "step"},
        "versions": versions(),
    }
    if extra_metadata:
        log["metadata"] = jsonable(extra_metadata)
    write_atomically(out_dir / TRAINING_LOG_NAME, json.dumps(log, indent=2) + "\n")
    return log


def _layer_by_index(model: nn.Module, index: int) -> nn.Module:
    return next(layer for layer in focus_layers(model) if layer.layer_index == index)


def remove_checkpoints(out_dir: str | os.PathLike) -> None:
    """Delete `<out_dir>/checkpoints` (after a finished run whose resumability is no longer needed)."""
    shutil.rmtree(Path(out_dir) / CHECKPOINTS_DIR, ignore_errors=True)
