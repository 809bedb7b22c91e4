"""Threads per rank under the real launchers: `dptrain run` gives each worker its share of the
cores its agent may use and OMP_WAIT_POLICY=PASSIVE when the threads outnumber them, leaves the
user's settings alone, and ranks a launcher bound to cores of their own are not divided again."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests._cli import PYTHON, base_env, dptrain_cmd, run

pytestmark = pytest.mark.e2e

SCRIPT = """
import json, os, sys, torch
from dptrain.runtime import init_distributed
from dptrain.runtime.threads import this_process_share
runtime = init_distributed()
share = this_process_share(runtime.env.local_world_size)
# One write per line: the ranks share the launcher's pipe.
sys.stdout.write("THREADS " + json.dumps({"rank": runtime.env.rank,
                 "threads": torch.get_num_threads(), "policy": os.environ.get("OMP_WAIT_POLICY"),
                 "bound": share.bound, "cpus": sorted(os.sched_getaffinity(0))}) + "\\n")
sys.stdout.flush()
"""


def _ranks(result, n: int) -> list[dict]:
    assert result.returncode == 0, result.output
    rows = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
            if line.startswith("THREADS ")]
    assert sorted(r["rank"] for r in rows) == list(range(n)), result.output
    return rows


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in base_env().items() if not k.startswith(("OMP_", "GOMP_"))}
    env.update(extra)
    return env


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "threads.py"
    path.write_text(SCRIPT)
    return str(path)


def test_dptrain_run_shares_the_usable_cores_and_respects_the_user(script):
    usable = len(os.sched_getaffinity(0))
    rows = _ranks(run(dptrain_cmd("run", "-n", "2", script), env=_env(), timeout_s=120), 2)
    assert [r["threads"] for r in rows] == [max(1, usable // 2)] * 2
    assert [r["policy"] for r in rows] == [None, None]  # no more threads than cores

    rows = _ranks(run(dptrain_cmd("run", "-n", "2", script), env=_env(OMP_NUM_THREADS="2"),
                      timeout_s=120), 2)
    assert [r["threads"] for r in rows] == [2, 2]
    expected = "PASSIVE" if 2 * 2 > usable else None
    assert [r["policy"] for r in rows] == [expected] * 2


@pytest.mark.skipif(not shutil.which("taskset"), reason="taskset (util-linux) not installed")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable CPUs")
def test_dptrain_run_counts_the_cores_it_may_run_on_not_the_machines(script):
    """Started on one CPU of several (taskset, a cpuset), a lone worker gets one thread, not
    one per core of the machine; the user's wait policy is kept."""
    one = min(os.sched_getaffinity(0))
    cmd = ["taskset", "-c", str(one), *dptrain_cmd("run", "-n", "1", script)]
    rows = _ranks(run(cmd, env=_env(OMP_WAIT_POLICY="ACTIVE"), timeout_s=120), 1)
    assert rows == [{"rank": 0, "threads": 1, "policy": "ACTIVE", "bound": False,
                     "cpus": [one]}]


@pytest.mark.skipif(not shutil.which("mpirun.openmpi"), reason="OpenMPI not installed")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable CPUs")
def test_ranks_mpirun_binds_to_a_core_each_are_seen_as_bound(script):
    """The group's own share (no OMP_NUM_THREADS) under mpirun --bind-to core: each rank owns
    its core, so it keeps it whole (one thread) and knows why."""
    cmd = [shutil.which("mpirun.openmpi"), "-np", "2", "--bind-to", "core",
           *(["--allow-run-as-root"] if os.geteuid() == 0 else []), PYTHON, script]
    rows = _ranks(run(cmd, env=_env(), timeout_s=120), 2)
    assert all(r["bound"] and len(r["cpus"]) == 1 and r["threads"] == 1 for r in rows), rows
    assert rows[0]["cpus"] != rows[1]["cpus"]
