"""A one-node Slurm cluster for the tests: munged, slurmctld and slurmd on this machine.

Everything lives in a temporary directory (key, sockets, state, spool, logs, slurm.conf) on free
ports, so it touches no system configuration and can run beside another cluster. No cgroups:
processes are tracked through /proc (proctrack/linuxproc) and tasks are not bound (task/none).
The `slurm` fixture starts it once per session and always stops it (jobs cancelled, daemons
SIGTERMed, then SIGKILLed); it skips with the reason when the daemons are not installed (`make
test` installs them: slurmd, slurmctld, slurm-client, munge).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sinfo", "scancel")
START_S = 60


@dataclass
class SlurmCluster:
    dir: Path
    conf: Path

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return {**base, "SLURM_CONF": str(self.conf)}

    def srun(self, ntasks: int, *argv: str) -> list[str]:
        return ["srun", f"--ntasks={ntasks}", "--time=5", "--kill-on-bad-exit=1", *argv]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                         for p in sorted(self.dir.glob("*.log")))


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the test cluster's slurmd and munged run as root (CI runs as root)"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (`make system-deps` installs slurmd, " \
               f"slurmctld, slurm-client and munge)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf(d: Path, host: str) -> str:
    cpus = max(2, os.cpu_count() or 1)
    return f"""\
ClusterName=dptrain{os.getpid()}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=10 State=UP OverSubscribe=YES
"""


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in reversed(procs):
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def start(d: Path) -> tuple[SlurmCluster, list[subprocess.Popen]]:
    """Start munged, slurmctld and slurmd in the foreground (so the caller owns their pids) and
    wait until the node is idle. On failure, stops what started and raises with the logs."""
    d.chmod(0o700)  # munged refuses a key or socket in a directory others may write
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    cluster = SlurmCluster(d, d / "slurm.conf")
    cluster.conf.write_text(_conf(d, host))
    subprocess.run(["mungekey", "--create", f"--keyfile={d}/munge.key"], check=True,
                   capture_output=True, timeout=30)
    env = cluster.env(dict(os.environ))
    commands = [
        ["munged", "--foreground", "--force", f"--key-file={d}/munge.key",
         f"--socket={d}/munge.sock", f"--pid-file={d}/munged.pid",
         f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
        ["slurmctld", "-D", "-i", "-f", str(cluster.conf)],
        ["slurmd", "-D", "-f", str(cluster.conf)],
    ]
    procs: list[subprocess.Popen] = []
    try:
        for argv in commands:
            with open(d / f"{argv[0]}.out", "w") as out:
                procs.append(subprocess.Popen(argv, env=env, stdout=out,
                                              stderr=subprocess.STDOUT,
                                              start_new_session=True))
            if argv[0] == "munged":
                _wait(lambda: (d / "munge.sock").exists(), procs, cluster, "munged's socket")
        _wait(lambda: subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                     text=True, timeout=10).stdout.strip() == "idle",
              procs, cluster, "the node to be idle")
    except BaseException:
        _stop(procs)
        raise
    return cluster, procs


def _wait(ready, procs: list[subprocess.Popen], cluster: SlurmCluster, what: str) -> None:
    deadline = time.monotonic() + START_S
    while not ready():
        dead = [p.args[0] for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"test Slurm cluster: waiting for {what}, "
                               f"{'exited: ' + ', '.join(dead) if dead else 'timed out'}\n"
                               f"{cluster.logs()}")
        time.sleep(0.3)


def stop(cluster: SlurmCluster, procs: list[subprocess.Popen]) -> None:
    subprocess.run(["scancel", "--full", "--user=root"], env=cluster.env(dict(os.environ)),
                   capture_output=True, timeout=30)
    _stop(procs)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> Iterator[SlurmCluster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"Slurm tests skipped: {reason}")
    cluster, procs = start(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        stop(cluster, procs)
