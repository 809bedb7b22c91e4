"""The thread share of a rank (dptrain.runtime.threads) and the environment `dptrain run` gives its
workers: affinity, launcher binding, cgroup quota, the user's settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import dptrain.runtime.threads as threads_module
from dptrain.cli.env import hints, thread_lines
from dptrain.launcher.worker_env import thread_environment
from dptrain.runtime.threads import (
    cgroup_quota,
    env_threads,
    oversubscribed,
    share_threads,
    this_process_share,
)

TWO = frozenset({0, 1})


def cpus(n: int, start: int = 0) -> frozenset[int]:
    return frozenset(range(start, start + n))


@pytest.mark.parametrize("local_ranks, mine, parent, quota, threads, sharing, bound", [
    # Unbound: the ranks inherit the launcher's set and divide it.
    (2, TWO, TWO, None, 1, 2, False),
    (1, TWO, TWO, None, 2, 1, False),
    (4, cpus(16), cpus(16), None, 4, 4, False),
    (3, TWO, TWO, None, 1, 3, False),           # never fewer than one thread
    (2, cpus(8), None, None, 4, 2, False),      # parent unreadable: divided (the safe side)
    # Bound by the launcher: one core each (mpirun --bind-to core, srun --cpu-bind=cores).
    (2, frozenset({1}), TWO, None, 1, 1, True),
    (4, cpus(8, 8), cpus(32), None, 8, 1, True),  # srun -c 8: the whole mask, not divided
    (4, cpus(32), cpus(64), None, 16, 2, True),   # 4 ranks bound to 2 sockets: 2 per socket
    # A quota is the cgroup's, shared by every local rank.
    (2, cpus(64), cpus(64), 4, 2, 2, False),
    (4, cpus(8, 8), cpus(32), 4, 1, 1, True),
    (8, cpus(64), cpus(64), 2, 1, 8, False),
])
def test_share_rule(local_ranks, mine, parent, quota, threads, sharing, bound):
    share = share_threads(local_ranks, mine, parent, quota)
    assert (share.threads, share.sharing, share.bound) == (threads, sharing, bound)
    assert ("bound" in share.reason()) == bound


def test_usable_cores_are_the_affinity_capped_by_the_quota():
    assert share_threads(2, cpus(8), None, 3).usable == 3
    assert share_threads(2, cpus(8), None, None).usable == 8


def _child_share(affinity: set[int] | None) -> dict:
    """this_process_share(2) in a real child whose CPU set is `affinity` (None: inherited)."""
    # The module alone (standard library only): no torch import in the child.
    code = (f"import json, runpy; s = runpy.run_path({threads_module.__file__!r})"
            f"['this_process_share']; x = s(2); print(json.dumps([x.threads, x.bound, x.cpus]))")
    pre = (lambda: os.sched_setaffinity(0, affinity)) if affinity else None
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         preexec_fn=pre, timeout=60, check=True).stdout
    return json.loads(out)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable CPUs")
def test_a_real_process_narrower_than_its_parent_counts_as_bound():
    usable = len(os.sched_getaffinity(0))
    assert _child_share(None) == [max(1, usable // 2), False, usable]
    one = min(os.sched_getaffinity(0))
    assert _child_share({one}) == [1, True, 1]


def test_this_process_share_on_the_launcher_side_divides_what_it_may_use():
    share = this_process_share(2, launcher_side=True)
    assert share.cpus == len(os.sched_getaffinity(0)) and not share.bound


def _tree(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        path = tmp_path / "sys" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "sys"


def test_cgroup_v2_quota_is_the_tightest_on_the_path_rounded_up(tmp_path):
    root = _tree(tmp_path, {"cgroup.controllers": "cpu", "job/cpu.max": "250000 100000\n",
                            "job/step/cpu.max": "max 100000\n"})
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step\n")
    assert cgroup_quota(proc, root) == 3
    (root / "job" / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(proc, root) is None
    (root / "job" / "step" / "cpu.max").write_text("50000 100000\n")
    assert cgroup_quota(proc, root) == 1  # half a core still runs one thread


def test_cgroup_v1_quota_and_unreadable_files(tmp_path):
    root = _tree(tmp_path, {"cpu,cpuacct/docker/c1/cpu.cfs_quota_us": "400000\n",
                            "cpu,cpuacct/docker/c1/cpu.cfs_period_us": "100000\n",
                            "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                            "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/docker/c1\n3:cpu,cpuacct:/docker/c1\n0::/\n")
    assert cgroup_quota(proc, root) == 4
    proc.write_text("3:cpu,cpuacct:/\n")
    assert cgroup_quota(proc, root) is None
    assert cgroup_quota(tmp_path / "missing", root) is None
    (root / "cpu,cpuacct" / "docker" / "c1" / "cpu.cfs_period_us").write_text("garbage")
    proc.write_text("3:cpu,cpuacct:/docker/c1\n")
    assert cgroup_quota(proc, root) is None


def test_one_thread_per_rank_is_never_oversubscribed():
    assert not oversubscribed(8, 1, 2)
    assert oversubscribed(2, 2, 2) and not oversubscribed(2, 2, 4)


@pytest.mark.parametrize("value, parsed", [("4", 4), ("2,1", 2), (" 3 ", 3), ("0", None),
                                           ("", None), ("many", None)])
def test_omp_num_threads_parsing(value, parsed):
    assert env_threads({"OMP_NUM_THREADS": value}) == parsed
    assert env_threads({}) is None


def test_dptrain_run_environment_respects_the_user():
    share = share_threads(2, TWO, None, None)
    assert thread_environment(2, {}, share) == {"OMP_NUM_THREADS": "1"}
    # The user's threads outnumber the cores: OpenMP must sleep, not spin.
    assert thread_environment(2, {"OMP_NUM_THREADS": "2"}, share) == \
        {"OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_environment(2, {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"},
                              share) == {}
    assert thread_environment(1, {"OMP_NUM_THREADS": "2"}, share_threads(1, TWO, None, None)) \
        == {}
    assert thread_environment(2, {"OMP_NUM_THREADS": "junk"}, share) == {}
    # More ranks than cores at one thread each: no OpenMP team, nothing to set.
    assert thread_environment(4, {}, share_threads(4, TWO, None, None)) == \
        {"OMP_NUM_THREADS": "1"}


def test_env_shows_the_share_the_policy_and_a_consistent_hint():
    share = share_threads(2, TWO, None, None)
    lines = thread_lines(share, {}, launched=False)
    assert lines[0].startswith("threads per rank: 1 for each of 2 process(es)")
    assert "2 usable CPU(s) shared by 2 local rank(s)" in lines[0]
    assert "default" in lines[1]
    busy = {"OMP_NUM_THREADS": "2"}
    lines = thread_lines(share, busy, launched=False)
    assert "from OMP_NUM_THREADS (the share would be 1" in lines[0]
    assert "PASSIVE, set by `dptrain run`/`train`" in lines[1]
    assert any("OMP_WAIT_POLICY=PASSIVE" in h for h in hints(busy, 2, 0, cpus=2))
    bound = share_threads(2, frozenset({0}), TWO, None)
    lines = thread_lines(bound, busy, launched=True)
    assert "the launcher bound this rank to 1 CPU(s)" in lines[0]
    assert "oversubscribed: 1 x 2 threads on 1 core(s)" in lines[1]


def test_an_explicit_thread_count_wins_and_reaches_the_workers(monkeypatch):
    import torch

    from dptrain.launcher.worker_env import use_threads
    from dptrain.train.options import RESUMABLE_OPTIONS, TrainOptions
    from dptrain.errors import ConfigError

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    before = torch.get_num_threads()
    try:
        use_threads(1)
        assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="--threads must be >= 1"):
        use_threads(-2)
    with pytest.raises(ConfigError, match="threads: expected an integer >= 0"):
        TrainOptions(threads=-1)
    assert "threads" in RESUMABLE_OPTIONS  # how a run is executed, not what it computes


def test_the_group_keeps_the_users_threads_and_warns_when_they_oversubscribe(monkeypatch,
                                                                             caplog):
    """Under mpirun/srun the group cannot set OMP_WAIT_POLICY any more (OpenMP read it when
    torch loaded): local rank 0 says so, once per node, when the threads outnumber the cores."""
    import torch

    from dptrain.runtime.env import DistEnv
    from dptrain.runtime.group import _share_cores

    usable = this_process_share(2).usable
    env = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, node_rank=0,
                  master_addr="127.0.0.1", master_port=1, launcher="openmpi")
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", str(usable))
        torch.set_num_threads(usable)
        _share_cores(env)
        assert torch.get_num_threads() == usable  # the user's count stays
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert (len(warned) == 1 and "OMP_WAIT_POLICY=PASSIVE" in warned[0]) == (usable > 1)
        caplog.clear()
        monkeypatch.delenv("OMP_NUM_THREADS")
        _share_cores(env)  # unset: the share, which never oversubscribes
        assert torch.get_num_threads() == max(1, usable // 2)
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
    finally:
        torch.set_num_threads(before)
