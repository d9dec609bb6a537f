"""`focus_hf.fitting.parallel` without a process group (the one-process identity) and its refusal of too few items."""

from __future__ import annotations

import pytest
import torch

from focus_hf.fitting import parallel


def test_one_process_is_the_identity(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert parallel.world() == (0, 1) and parallel.is_main_process()
    assert parallel.shard(3) == [0, 1, 2]
    local = torch.tensor([1.0, 2.0], requires_grad=True)
    assert parallel.global_sum(local) is local
    assert torch.equal(parallel.all_sum(local), local.detach())
    assert not parallel.start_process_group()


def test_shard_splits_by_rank_and_refuses_idle_processes(monkeypatch):
    monkeypatch.setattr(parallel, "world", lambda: (1, 2))
    assert parallel.shard(5) == [1, 3]
    monkeypatch.setattr(parallel, "world", lambda: (0, 4))
    with pytest.raises(ValueError, match="3 calibration sequences cannot be shared by 4 processes"):
        parallel.shard(3)
