"""Data parallelism for multi-process launches (`torchrun`, `accelerate launch`) outside transformers' Trainer.

The language-model objective trains through the Trainer, which sets up the process group and averages gradients
itself. Router distillation does not (its loss is local to a layer: one capture, many cheap steps), so it shares
its work here: each process captures and fits on its share of the calibration sequences (`shard`), the loss's
global sums are taken across processes (`global_sum`), and the gradients are summed before every optimizer
step (`sum_gradients`), so every process takes the same step and ends with the same routers - those of one
process on all the sequences, up to float rounding. Without a process group every function here is the
one-process identity.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def world() -> tuple[int, int]:
    """(rank of this process, number of processes); (0, 1) without a process group."""
    if not _distributed():
        return 0, 1
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def is_main_process() -> bool:
    """Whether this process writes files and reports (rank 0, or the only process)."""
    return world()[0] == 0


def start_process_group() -> bool:
    """Join the process group a launcher describes (`WORLD_SIZE` > 1 in the environment) unless one is running.

    Uses NCCL where CUDA is available, gloo otherwise. Returns whether several processes take part.
    """
    if _distributed():
        return world()[1] > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group(backend)
    return True


def end_process_group() -> None:
    """Shut down the process group of a multi-process launch (the Trainer starts one and never ends it).

    Left alive, its communication threads are destroyed at interpreter exit, which now and then aborts a process
    ("terminate called without an active exception") after the work is done and the launcher reports a failure.
    """
    if _distributed():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def shard(count: int) -> list[int]:
    """The indices of `count` items this process works on: every world-size-th one, from its rank.

    Raises:
        ValueError: if there are fewer items than processes (a process would have nothing to do).
    """
    rank, size = world()
    if count < size:
        raise ValueError(
            f"{count} calibration sequences cannot be shared by {size} processes: give at least {size} "
            "(--sequences plus --retrieval-documents) or launch fewer processes."
        )
    return list(range(rank, count, size))


def all_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor` over all processes (a new tensor; no gradient flows through it)."""
    total = tensor.detach().clone()
    if not _distributed():
        return total
    if torch.distributed.get_backend() == "nccl" and total.device.type != "cuda":  # NCCL reduces CUDA tensors only
        gathered = total.cuda()
        torch.distributed.all_reduce(gathered)
        return gathered.to(total.device)
    torch.distributed.all_reduce(total)
    return total


def global_sum(local: torch.Tensor) -> torch.Tensor:
    """The sum of `local` over all processes, differentiable with respect to this process's `local` only.

    When every process backpropagates a loss built on it and the gradients are then summed (`sum_gradients`), the
    result is the gradient of the loss built on the true global sum.
    """
    if not _distributed():
        return local
    return local + (all_sum(local) - local.detach())


def sum_gradients(parameters: Iterable[torch.nn.Parameter]) -> None:
    """Replace each parameter's gradient by its sum over all processes."""
    if not _distributed():
        return
    for parameter in parameters:
        if parameter.grad is not None:
            torch.distributed.all_reduce(parameter.grad)
