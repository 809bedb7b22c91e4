"""`dptrain run` argument translation and `dptrain env` hints, without processes."""

from __future__ import annotations

import pytest

from dptrain.cli.env import hints, relevant_variables
from dptrain.cli.main import build_parser, main
from dptrain.cli.run import torchrun_argv
from dptrain.errors import ConfigError


def _run_args(*argv):
    return build_parser().parse_args(["run", *argv])


def test_single_node_is_standalone_and_wraps_the_script(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    argv = torchrun_argv(_run_args("-n", "3", str(script), "--lr", "0.1"))
    assert argv[:3] == ["--nproc-per-node=3", "--max-restarts=0", "--standalone"]
    assert argv[-5:] == ["-m", "dptrain.launcher.worker", str(script), "--lr", "0.1"]


def test_multi_node_dynamic_and_static_rendezvous(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    dynamic = torchrun_argv(_run_args("--nnodes", "2", "--rdzv-endpoint", "head:29400",
                                      "--max-restarts", "3", str(script)))
    assert "--rdzv-backend=c10d" in dynamic and "--rdzv-endpoint=head:29400" in dynamic
    assert "--max-restarts=3" in dynamic and "--standalone" not in dynamic
    static = torchrun_argv(_run_args("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                                     "head:29400", str(script)))
    assert {"--rdzv-backend=static", "--node-rank=1", "--master-addr=head",
            "--master-port=29400"} <= set(static)
    elastic = torchrun_argv(_run_args("--nnodes", "1:4", "--rdzv-endpoint", "head:29400",
                                      "--rdzv-id", "exp1", str(script)))
    assert {"--nnodes=1:4", "--rdzv-backend=c10d", "--rdzv-endpoint=head:29400",
            "--rdzv-id=exp1"} <= set(elastic)


@pytest.mark.parametrize("argv,message", [
    (["-n", "0", "SCRIPT"], "--nproc must be >= 1"),
    (["--nnodes", "2", "SCRIPT"], "needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "3:2", "SCRIPT"], "nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX"),
    (["--nnodes", "1:2", "--node-rank", "0", "--rdzv-endpoint", "h:1", "SCRIPT"],
     "static rendezvous needs a fixed --nnodes N, got 1:2"),
    (["--max-restarts", "-1", "SCRIPT"], "--max-restarts must be >= 0"),
    (["missing.py"], "script not found: missing.py"),
])
def test_bad_run_options(tmp_path, argv, message):
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(ConfigError, match=message):
        torchrun_argv(_run_args(*[str(script) if a == "SCRIPT" else a for a in argv]))


def test_cli_maps_config_errors_to_exit_code_2(capsys):
    assert main(["run", "-n", "2", "no_such_script.py"]) == 2
    assert "dptrain run: error: script not found" in capsys.readouterr().err


def test_env_hints_name_known_traps():
    found = hints({"NCCL_P2P_DISABLE": "1", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
                  local_world_size=4, cuda_devices=0)
    text = "\n".join(found)
    assert "OMP_NUM_THREADS is unset with 4 local ranks" in text
    assert "NCCL_P2P_DISABLE=1" in text and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in text
    quiet = hints({"OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1"}, 4, 0, cpus=4)
    assert quiet == []
    busy = hints({"OMP_NUM_THREADS": "2", "OMPI_ALLOW_RUN_AS_ROOT": "1"}, 2, 0, cpus=2)
    assert len(busy) == 1 and "OMP_WAIT_POLICY=PASSIVE" in busy[0]
    assert hints({"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive",
                  "OMPI_ALLOW_RUN_AS_ROOT": "1"}, 2, 0, cpus=2) == []


def test_env_lists_only_relevant_variables():
    env = {"MASTER_ADDR": "h", "NCCL_SOCKET_IFNAME": "eth0", "HOME": "/root",
           "OMP_NUM_THREADS": "2", "SLURM_PROCID": "0", "PATH": "/bin"}
    assert list(relevant_variables(env)) == ["MASTER_ADDR", "NCCL_SOCKET_IFNAME",
                                             "OMP_NUM_THREADS", "SLURM_PROCID"]


def test_env_command_prints_versions_launcher_and_backends(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch " in out and "backends: gloo yes" in out
    assert "launcher: env  rank 1/2" in out and "MASTER_PORT=29999" in out


def test_env_command_reports_a_broken_environment(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    assert main(["env"]) == 0
    assert "cannot resolve the rank environment: torchrun/env environment is partial" in \
        capsys.readouterr().out
