"""Process-group start-up decisions that need no second process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dptrain.runtime import (
    all_reduce_flat,
    broadcast_object,
    choose_backend,
    distributed,
    init_distributed,
    reduce_sum_count,
)
from dptrain.runtime.env import SINGLE
from dptrain.errors import ConfigError


def test_world_of_one_starts_no_group_and_collectives_are_identities():
    with distributed(SINGLE) as rt:
        assert rt.backend is None and str(rt.device) == "cpu" and not dist.is_initialized()
        t = torch.tensor([2.0, 3.0])
        assert all_reduce_flat([t], average=True) == 0 and t.tolist() == [2.0, 3.0]
        assert reduce_sum_count({"error": (1.0, 4.0)}) == {"error": (1.0, 4.0)}
        assert broadcast_object({"a": 1}) == {"a": 1}


def test_backend_choice_and_errors():
    assert choose_backend("auto", SINGLE) == ("nccl" if torch.cuda.is_available() else "gloo")
    assert choose_backend("gloo", SINGLE) == "gloo"
    with pytest.raises(ConfigError, match="backend must be one of auto, gloo, nccl, mpi"):
        choose_backend("tcp", SINGLE)
    if not dist.is_mpi_available():
        with pytest.raises(ConfigError, match="backend 'mpi' is not available in this torch"):
            choose_backend("mpi", SINGLE)


def test_an_existing_group_is_adopted_with_its_rank(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    rt = init_distributed(SINGLE)
    assert rt.backend == "gloo" and rt.env.world_size == 1
