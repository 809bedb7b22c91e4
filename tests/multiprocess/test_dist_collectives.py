"""Collectives and process-group start-up on 2 real gloo ranks (docs/design.md, 4 and 5)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch

from dptrain.runtime import (
    all_gather_object,
    all_reduce_flat,
    barrier,
    broadcast_object,
    broadcast_tensors,
    init_distributed,
    is_main_process,
    means,
    reduce_sum_count,
    resolve_env,
    shutdown_distributed,
)
from tests._world import WorldFailed, run_world

pytestmark = pytest.mark.dist


def _collectives(rank: int, world_size: int) -> dict:
    out = {}
    # Rank-distinct inputs with exact expected sums; two dtypes make two buckets.
    a = torch.full((3, 2), float(rank + 1))
    b = torch.arange(5, dtype=torch.float64) * (rank + 1)
    c = torch.tensor([rank + 1], dtype=torch.int64)
    out["calls_sum"] = all_reduce_flat([a, b, c])
    out["a"], out["b"], out["c"] = a.tolist(), b.tolist(), c.tolist()
    m = torch.tensor([1.0, 2.0]) * (rank + 1)
    all_reduce_flat([m], average=True)
    out["mean"] = m.tolist()
    torch.manual_seed(123)
    w = torch.randn(4) if rank == 0 else torch.zeros(4)
    broadcast_tensors([w])
    out["broadcast"] = w.tolist()
    out["object"] = broadcast_object({"seed": 7, "rank": rank})
    out["gathered"] = all_gather_object(f"r{rank}")
    # Uneven counts: rank 0 holds 3 samples with 1 error, rank 1 holds 2 with 2 errors.
    sums = reduce_sum_count({"error": (1.0, 3.0)} if rank == 0 else {"error": (2.0, 2.0)})
    out["sums"] = sums
    out["mean_error"] = means(sums)["error"]
    barrier()
    out["is_main"] = is_main_process()
    # Different names and counts per rank (a rank with no test samples has no metrics at all).
    out["uneven_names"] = reduce_sum_count({"loss": (1.0, 1.0)} if rank == 0 else
                                           {"error": (1.0, 2.0)})
    out["one_rank_empty"] = reduce_sum_count({"loss": (4.0, 2.0), "error": (1.0, 2.0)}
                                             if rank == 0 else {})
    return out


def test_collectives_give_exact_results_on_every_rank():
    results = run_world(_collectives, world_size=2)
    for rank, r in enumerate(results):
        assert r["calls_sum"] == 3, "one all-reduce per dtype: float32, float64, int64"
        assert r["a"] == [[3.0, 3.0]] * 3
        assert r["b"] == [0.0, 3.0, 6.0, 9.0, 12.0]
        assert r["c"] == [3]
        assert r["mean"] == [1.5, 3.0]
        assert r["broadcast"] == results[0]["broadcast"] != [0.0] * 4
        assert r["object"] == {"seed": 7, "rank": 0}
        assert r["gathered"] == ["r0", "r1"]
        assert r["sums"] == {"error": (3.0, 5.0)} and r["mean_error"] == 0.6
        assert r["is_main"] == (rank == 0)
        assert r["uneven_names"] == {"error": (1.0, 2.0), "loss": (1.0, 1.0)}
        assert r["one_rank_empty"] == {"error": (1.0, 2.0), "loss": (4.0, 2.0)}


def _init_from_env(rank: int, world_size: int) -> dict:
    env = resolve_env()
    runtime = init_distributed(env, backend="auto", timeout=timedelta(seconds=20))
    t = torch.tensor([float(rank + 1)])
    all_reduce_flat([t])
    info = dict(launcher=env.launcher, backend=runtime.backend, device=str(runtime.device),
                value=t.item(), threads=torch.get_num_threads())
    shutdown_distributed()
    shutdown_distributed()  # safe twice
    return info


def _slurm_env(rank: int) -> dict[str, str]:
    return {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2",
            "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost",
            "SLURM_JOB_ID": os.environ["SLURM_JOB_ID"]}  # the parent's: the same on both ranks


def _init_as_slurm(rank: int, world_size: int) -> dict:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):
        os.environ.pop(k, None)
    os.environ.update(_slurm_env(rank))
    return _init_from_env(rank, world_size)


def test_init_from_hand_set_env_and_from_slurm_variables():
    """Real rendezvous over TCP: RANK/WORLD_SIZE/MASTER_*, then Slurm's variables with the
    master host taken from the node list and the port derived from the job id."""
    for r in run_world(_init_from_env, world_size=2, init="env"):
        assert (r["launcher"], r["backend"], r["device"], r["value"]) == ("env", "gloo", "cpu", 3.0)
    for r in run_world(_init_as_slurm, world_size=2, init="none",
                       env={"SLURM_JOB_ID": str(os.getpid())}):
        assert (r["launcher"], r["value"]) == ("slurm", 3.0)


def _rank1_never_arrives(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(60)
        return
    t = torch.ones(1)
    all_reduce_flat([t])


def _rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    t = torch.ones(1)
    all_reduce_flat([t])


def test_a_failed_or_missing_rank_ends_the_world_with_a_named_error():
    """Contract 4: no silent hang. A raise is reported with the rank's traceback; a rank that
    never arrives makes the waiting rank fail inside the collective, naming itself and the op."""
    start = time.monotonic()
    with pytest.raises(WorldFailed) as info:
        run_world(_rank1_raises, world_size=2, timeout_s=30)
    assert "rank 1 failed" in str(info.value) and "rank 1 broke on purpose" in str(info.value)
    with pytest.raises(WorldFailed) as info:
        run_world(_rank1_never_arrives, world_size=2, timeout_s=60, group_timeout_s=5)
    text = str(info.value)
    assert "rank 0 failed" in text and "RankFailure: rank 0 of 2: all_reduce of 1 element" in text
    assert "HINT: rank(s) [1] did not reach it" in text
    assert time.monotonic() - start < 60
