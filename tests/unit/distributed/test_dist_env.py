"""Rank environment resolution for every launcher, and its errors (issue: foundation)."""

from __future__ import annotations

import pytest

from dptrain.runtime import DDPConfig, expand_hostlist, resolve_env
from dptrain.runtime.env import derived_port
from dptrain.errors import ConfigError

MASTER = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"}

CASES = [
    ("single", {}, dict(rank=0, world_size=1, local_rank=0, launcher="single")),
    ("torchrun", {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                  "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", **MASTER},
     dict(rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1,
          launcher="torchrun", master_addr="10.1.2.3", master_port=29400)),
    ("hand-set", {"RANK": "1", "WORLD_SIZE": "2", **MASTER},
     dict(rank=1, world_size=2, local_rank=1, local_world_size=2, launcher="env")),
    ("openmpi", {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                 "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4", **MASTER},
     dict(rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1,
          launcher="openmpi", master_addr="10.1.2.3")),
    ("mpich", {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
               **MASTER},
     dict(rank=2, world_size=4, local_rank=0, local_world_size=2, node_rank=1, launcher="mpich")),
    ("slurm", {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
               "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "4242",
               "SLURM_JOB_NODELIST": "gpu[07-08]"},
     dict(rank=6, world_size=8, local_rank=2, local_world_size=4, node_rank=1, launcher="slurm",
          master_addr="gpu07", master_port=derived_port("4242"))),
    ("slurm step size wins", {"SLURM_PROCID": "1", "SLURM_NTASKS": "8",
                              "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "7",
                              "SLURM_JOB_NODELIST": "n1"},
     dict(rank=1, world_size=2, launcher="slurm", master_addr="n1")),
    ("torchrun inside slurm", {"TORCHELASTIC_RUN_ID": "x", "RANK": "5", "WORLD_SIZE": "8",
                               "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "SLURM_PROCID": "1",
                               "SLURM_NTASKS": "2", **MASTER},
     dict(rank=5, world_size=8, launcher="torchrun")),
    ("mpirun inside slurm", {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                             "SLURM_PROCID": "0", "SLURM_NTASKS": "1", **MASTER},
     dict(rank=1, world_size=2, launcher="openmpi")),
    ("openmpi one node derives", {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                                  "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                                  "OMPI_MCA_ess_base_jobid": "1643708417"},
     dict(master_addr="127.0.0.1", master_port=derived_port("ompi1643708417"))),
    ("mpich one node derives from parent", {"PMI_RANK": "1", "PMI_SIZE": "2"},
     dict(master_addr="127.0.0.1", master_port=derived_port("pmippid777"))),
    ("world of one needs no master", {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"},
     dict(world_size=1, launcher="openmpi", master_addr="")),
]


@pytest.mark.parametrize("name,environ,expected", CASES, ids=[c[0] for c in CASES])
def test_resolves_each_launcher(name, environ, expected):
    env = resolve_env(environ, parent_pid=777)
    for field, value in expected.items():
        assert getattr(env, field) == value, (name, field)


ERRORS = [
    ("rank beyond world", {"RANK": "2", "WORLD_SIZE": "2", **MASTER}, "rank must be in [0, 2)"),
    ("WORLD_SIZE without RANK", {"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
    ("RANK without WORLD_SIZE", {"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ("not an integer", {"RANK": "one", "WORLD_SIZE": "2"}, "RANK must be an integer, got 'one'"),
    ("agent without ranks", {"TORCHELASTIC_RUN_ID": "x"}, "TORCHELASTIC_RUN_ID is set"),
    ("launchers disagree", {"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
                            "OMPI_COMM_WORLD_SIZE": "2", **MASTER},
     "RANK/WORLD_SIZE say rank 0 of 2 but OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE say rank 1"),
    ("partial openmpi", {"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE is not"),
    ("partial master", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"},
     "MASTER_ADDR is set but MASTER_PORT is not"),
    ("hand-set without master", {"RANK": "0", "WORLD_SIZE": "2"}, "mpirun -x MASTER_ADDR"),
    ("multi-node openmpi", {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
                            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "9"},
     "MASTER_ADDR and MASTER_PORT are not set"),
    ("slurm without size", {"SLURM_PROCID": "0"}, "SLURM_NTASKS"),
    ("local rank beyond", {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                           "OMPI_COMM_WORLD_LOCAL_RANK": "2", **MASTER},
     "local rank must be in [0, 2)"),
]


@pytest.mark.parametrize("name,environ,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_inconsistent_environments_name_the_variables(name, environ, message, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "mpi4py", None)  # no mpi4py fallback here
    with pytest.raises(ConfigError) as info:
        resolve_env(environ, parent_pid=None)
    assert message in str(info.value)


@pytest.mark.parametrize("hostlist,expected", [
    ("node1", ["node1"]),
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("a[1-2],b3,c[8-10]", ["a1", "a2", "b3", "c8", "c9", "c10"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("x-[009-011].dom", ["x-009.dom", "x-010.dom", "x-011.dom"]),
])
def test_expand_slurm_hostlist(hostlist, expected):
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize("bad", ["gpu[3-1]", "gpu[a-b]", ""])
def test_bad_hostlist_is_an_error(bad):
    with pytest.raises(ConfigError):
        expand_hostlist(bad)


def test_derived_port_is_stable_and_in_range():
    assert derived_port("123") == derived_port("123")
    assert all(12000 <= derived_port(str(j)) < 32000 for j in range(500))


def test_ddp_config_fields_and_errors():
    cfg = DDPConfig(device_ids=[], backend="gloo", rank=1, world_size=2)
    assert (cfg.rank, cfg.world_size, str(cfg.device)) == (1, 2, "cpu")
    assert str(DDPConfig(device_ids=[0, 1], backend="nccl", rank=3, world_size=4).device) == "cuda:1"
    with pytest.raises(ConfigError, match="rank must be in"):
        DDPConfig(device_ids=[], backend="gloo", rank=2, world_size=2)
    with pytest.raises(ConfigError, match="backend must be one of"):
        DDPConfig(device_ids=[], backend="tcp")
    with pytest.raises(ConfigError, match="needs device_ids"):
        DDPConfig(device_ids=[], backend="nccl")
    from_env = DDPConfig.from_env(environ={"RANK": "1", "WORLD_SIZE": "2", **MASTER})
    assert (from_env.rank, from_env.world_size, from_env.backend) == (1, 2, "auto")
