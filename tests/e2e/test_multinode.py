"""Two real hosts: network namespaces joined by a veth pair (tests/_netns.py), one node each.

In both namespaces this machine's host name resolves to 127.0.0.1, the trap that makes gloo
advertise the loopback to the other node (`connectFullMesh failed ... remote=[127.0.0.1]`);
nothing here sets GLOO_SOCKET_IFNAME, so every pass relies on dptrain choosing the interface that
reaches the rendezvous host. No traffic leaves the pair: the namespaces have no other route.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._cli import PYTHON, REPO, base_env, dptrain_cmd, mpirun_cmd, run
from tests._netns import Host, TwoHosts, two_hosts, write_rsh_agent  # noqa: F401 - fixture

pytestmark = pytest.mark.e2e
ALLREDUCE = str(REPO / "examples" / "allreduce.py")
# A small TAGI run: 45 steps of 32 digits, a checkpoint every 5 steps.
TRAIN = ["train", "--epochs", "1", "--hidden", "32", "--checkpoint-every", "5", "--no-progress"]


def node_env() -> dict[str, str]:
    env = base_env()
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(var, None)  # the point of these tests: dptrain chooses
    return env


class Nodes:
    """One command per host, started together; output to files so no pipe can block."""

    def __init__(self, pair: TwoHosts, argvs: list[list[str]], logdir: Path,
                 stagger_s: float = 0.0):
        self.pair = pair
        self.logs = [logdir / f"node{i}.log" for i in range(2)]
        self.procs = []
        for host, argv, log in zip(pair.hosts, argvs, self.logs, strict=True):
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen(host.cmd(*argv), cwd=REPO, env=node_env(),
                                                   stdout=out, stderr=subprocess.STDOUT))
            time.sleep(stagger_s)

    def output(self, i: int) -> str:
        return self.logs[i].read_text()

    def wait(self, timeout_s: float) -> list[int]:
        """Both exit codes; past the deadline kill everything in both namespaces and fail."""
        deadline = time.monotonic() + timeout_s
        try:
            return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"nodes still running after {timeout_s}s\n--- node 0\n"
                               f"{self.output(0)}\n--- node 1\n{self.output(1)}") from None

    def kill(self) -> None:
        for host in self.pair.hosts:
            pids = subprocess.run(["ip", "netns", "pids", host.ns], capture_output=True,
                                  text=True).stdout.split()
            subprocess.run(["kill", "-9", *pids], capture_output=True)
        for p in self.procs:
            p.wait(timeout=10)


def _endpoint(host: Host, port: int) -> str:
    return f"{host.name}:{port}"


def test_the_host_name_trap_is_real_in_the_namespaces(two_hosts):  # noqa: F811
    """Without this, the tests below would not show that the interface choice matters."""
    probe = "import socket; print(socket.gethostbyname(socket.gethostname()))"
    done = subprocess.run(two_hosts.a.cmd(sys.executable, "-c", probe), capture_output=True,
                          text=True, timeout=30)
    assert done.stdout.strip() == "127.0.0.1", (socket.gethostname(), done)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_dptrain_run_across_two_hosts(two_hosts, tmp_path, dynamic):  # noqa: F811
    """Static: node ranks given, node a hosts the store. Dynamic (c10d): torch numbers the nodes
    and the workers' store lives at the address each agent was told is its own."""
    a, b = two_hosts.hosts
    endpoint = _endpoint(a, 29411 if dynamic else 29401)
    ranks = ([], []) if dynamic else (["--node-rank", "0"], ["--node-rank", "1"])
    nodes = Nodes(two_hosts, [
        [PYTHON, "-m", "dptrain", "run", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-endpoint", endpoint, *rendezvous, ALLREDUCE]
        for rendezvous in ranks], tmp_path)
    assert nodes.wait(60) == [0, 0], nodes.output(0) + nodes.output(1)
    both = nodes.output(0) + nodes.output(1)
    for rank in (0, 1):  # dynamic: either host may get rank 0
        assert f"rank {rank}/2 (torchrun): all-reduce sum 3 ok" in both, both
    for i, host in enumerate((a, b)):
        out = nodes.output(i)
        assert f"network interface {host.ifname}: the route to the rendezvous host {a.name} " \
               f"({a.address}) leaves from {host.address}" in out, out


def test_mpirun_across_two_hosts(two_hosts, tmp_path):  # noqa: F811
    """OpenMPI starts rank 1 on host b through an rsh agent that enters b's namespace instead
    of ssh; its control traffic is held to the pair's subnet. Each rank names its host's
    address (so rank 1 did run on b), then they all-reduce."""
    a, b = two_hosts.hosts
    subnet = a.address.rsplit(".", 1)[0] + ".0/24"
    agent = write_rsh_agent(two_hosts, tmp_path / "rsh-agent")
    env = node_env()
    env.update(MASTER_ADDR=a.name, MASTER_PORT="29404", PYTHONPATH=str(REPO / "src"))
    script = f"echo on $(ip -o -4 addr | grep -o '10\\.213\\.[0-9.]*/'); {PYTHON} {ALLREDUCE}"
    cmd = mpirun_cmd(2, "--host", f"{a.name}:1,{b.name}:1", "--mca", "plm_rsh_agent", str(agent),
                     "--mca", "oob_tcp_if_include", subnet, "--mca", "btl_tcp_if_include", subnet,
                     *(arg for var in ("MASTER_ADDR", "MASTER_PORT", "PYTHONPATH",
                                       "OMP_NUM_THREADS", "PYTHONUNBUFFERED")
                       for arg in ("-x", var)),
                     "sh", "-c", script)
    result = run(a.cmd(*cmd), env=env, timeout_s=90)
    assert result.returncode == 0, result.output
    for host in (a, b):
        assert f"on {host.address}/" in result.stdout, result.output
    for rank in (0, 1):
        assert f"rank {rank}/2 (openmpi): all-reduce sum 3 ok" in result.stdout, result.output


def _params(out: Path) -> str:
    return json.loads((out / "summary.json").read_text())["params_sha256"]


def _with_own_dir(own: Path, at: Path, *argv: str) -> list[str]:
    """`argv` seeing directory `own` at path `at`: `ip netns exec` gives every command its own
    mount namespace, so the bind mount is this host's alone, as a local disk would be."""
    script = 'own=$0 at=$1; shift; mount --bind "$own" "$at" && exec "$@"'
    return ["sh", "-c", script, str(own), str(at), *argv]


def test_dptrain_train_across_two_hosts_resumes_bit_exactly_after_a_kill(
        two_hosts, tmp_path):  # noqa: F811
    """Rank 1 (on host b) is SIGKILLed at step 12; both agents restart their worker, which
    resumes from the step-10 checkpoint; the result equals an uninterrupted run bit for bit.
    No shared filesystem: both hosts use the same --out path, but each sees its own disk there
    (only host a, rank 0's, ever holds checkpoints; it reads and broadcasts them)."""
    clean = run(dptrain_cmd(*TRAIN, "--nproc", "2", "--out", str(tmp_path / "clean")),
                timeout_s=120)
    assert clean.returncode == 0, clean.output
    disks = [tmp_path / "disk-a", tmp_path / "disk-b"]
    mount_point = tmp_path / "local"
    for d in (*disks, mount_point):
        d.mkdir()
    nodes = Nodes(two_hosts, [
        _with_own_dir(disk, mount_point, PYTHON, "-m", "dptrain", *TRAIN, "--nproc", "1",
                      "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint",
                      _endpoint(two_hosts.a, 29402), "--out", str(mount_point / "run"),
                      "--fail-at", "1:12", "--max-restarts", "1")
        for rank, disk in enumerate(disks)], tmp_path)
    assert nodes.wait(120) == [0, 0], nodes.output(0) + nodes.output(1)
    assert "[rank 1] fault injection (attempt 0): SIGKILL at step 12" in nodes.output(1)
    assert "resumed from" in nodes.output(0) + nodes.output(1)
    # One line per node: the killed rank on b, the step at which rank 0 lost it on a; no
    # traceback of the survivor.
    assert "dptrain train: rank 1 failed (exit code -9, SIGKILL); restarting every worker (1 " \
        "restart(s) left)" in nodes.output(1)
    assert "dptrain train: rank 0 lost rank(s) 1 at step 12 (exit code 5); restarting every " \
        "worker (1 restart(s) left)" in nodes.output(0), nodes.output(0)
    assert "Traceback" not in nodes.output(0) + nodes.output(1)
    assert not list(mount_point.iterdir()), "the hosts' disks stay their own"
    assert list((disks[0] / "run" / "checkpoints").glob("step-*"))
    assert not (disks[1] / "run" / "checkpoints").exists() or \
        not list((disks[1] / "run" / "checkpoints").glob("step-*"))
    assert _params(disks[0] / "run") == _params(tmp_path / "clean")


def test_a_node_whose_peer_vanished_exits_within_the_timeout(two_hosts, tmp_path):  # noqa: F811
    """Host a drops off the network mid-training (its link goes down: no FIN, no RST, the
    packets just stop). Host b must not hang: it fails with a clear error soon after --timeout."""
    a, _ = two_hosts.hosts
    timeout_s = 6
    out = tmp_path / "run"
    nodes = Nodes(two_hosts, [
        [PYTHON, "-m", "dptrain", "train", "--epochs", "200", "--hidden", "16", "--no-progress",
         "--checkpoint-every", "5", "--nproc", "1", "--nnodes", "2", "--node-rank", str(rank),
         "--rdzv-endpoint", _endpoint(a, 29403), "--out", str(out), "--timeout",
         str(timeout_s)]
        for rank in (0, 1)], tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not list((out / "checkpoints").glob("step-*")):
            assert time.monotonic() < deadline, nodes.output(0) + nodes.output(1)
            assert all(p.poll() is None for p in nodes.procs), nodes.output(0) + nodes.output(1)
            time.sleep(0.2)
        subprocess.run(a.cmd("ip", "link", "set", a.ifname, "down"), check=True, timeout=20)
        cut = time.monotonic()
        code = nodes.procs[1].wait(timeout=60)
        took = time.monotonic() - cut
    finally:
        subprocess.run(a.cmd("ip", "link", "set", a.ifname, "up"), timeout=20)
        nodes.kill()
    out_b = nodes.output(1)
    assert code == 1, out_b
    assert "dptrain train: rank 1 failed first" in out_b, out_b
    assert "RankFailure: rank 1 of 2:" in out_b and "failed" in out_b, out_b
    assert took < 5 * timeout_s, f"node b took {took:.1f} s to give up\n{out_b}"


# Rank 1 (host b) dies before the process group in its node's first two attempts; rank 0 would
# wait at the rendezvous until the timeout. Each rank prints the job's attempt and run label.
FLAKY = """
import os, sys
from datetime import timedelta
rank, mine = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"rank {rank}: attempt {os.environ['DPTRAIN_ATTEMPT']} (this node's {mine}), label "
      f"{os.environ['DPTRAIN_RUN_LABEL']}", flush=True)
if rank == 1 and mine < 2:
    sys.exit(3)
import torch
from dptrain.runtime import all_reduce_flat, init_distributed
init_distributed(timeout=timedelta(seconds=90))
t = torch.ones(1)
all_reduce_flat([t])
print(f"rank {rank}: sum {t.item():g}", flush=True)
"""

# Rank 1 raises an expected error (not retried) while rank 0 waits in a collective.
EXPECTED = """
import os
from datetime import timedelta
import torch
from dptrain.runtime import all_reduce_flat, init_distributed
from dptrain.errors import ConfigError
init_distributed(timeout=timedelta(seconds=90))
if os.environ["RANK"] == "1":
    raise ConfigError("--widget must be positive, got -1")
all_reduce_flat([torch.ones(1)])
"""


def _script_on_both(pair: TwoHosts, script: Path, port: int) -> list[list[str]]:
    return [[PYTHON, "-m", "dptrain", "run", "--nnodes", "2", "--nproc-per-node", "1",
             "--node-rank", str(rank), "--rdzv-endpoint", _endpoint(pair.a, port),
             "--max-restarts", "3", str(script)] for rank in (0, 1)]


def test_nodes_that_restarted_unequally_often_meet_again_at_once(
        two_hosts, tmp_path):  # noqa: F811
    """Issue 21: host b's worker fails twice before the rendezvous, so b's agent restarts twice
    while a's worker waits. With a static rendezvous the nodes used to meet under different
    attempts' keys and wait out the 90 s timeout, again and again. Now a's agent follows b to
    the job's attempt 2 and the all-reduce runs long before any timeout. b starts 1.5 s after
    a, and both read the same run label (a multi-node run without --out names its directory
    after it): the first agent's clock, not each node's."""
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    start = time.monotonic()
    nodes = Nodes(two_hosts, _script_on_both(two_hosts, script, 29431), tmp_path, stagger_s=1.5)
    assert nodes.wait(150) == [0, 0], nodes.output(0) + nodes.output(1)
    took = time.monotonic() - start
    a, b = nodes.output(0), nodes.output(1)
    assert took < 80, f"{took:.0f} s: waited for a timeout?\n{a}\n{b}"
    assert "rank 0: attempt 2 (this node's 2)" in a and "rank 1: attempt 2 (this node's 2)" in b
    assert "rank 0: sum 2" in a and "rank 1: sum 2" in b
    assert "dptrain run: node 0: another node restarted the job (attempt 1); restarting this " \
        "node's workers to join it" in a, a
    assert "dptrain run: rank 1 failed (exit code 3); restarting every worker (3 restart(s) " \
        "left)" in b, b
    labels = {line.rsplit("label ", 1)[1] for line in (a + b).splitlines() if "label " in line}
    assert len(labels) == 1, labels


def test_an_expected_error_on_one_node_ends_the_other_node_at_once(
        two_hosts, tmp_path):  # noqa: F811
    """b's worker raises an expected error (not retried, restarts left or not); a's worker
    loses it and a's agent would restart and wait for b until the 90 s timeout. b's agent says
    in the store why it ended the job, and a ends too, with that line."""
    script = tmp_path / "expected.py"
    script.write_text(EXPECTED)
    start = time.monotonic()
    nodes = Nodes(two_hosts, _script_on_both(two_hosts, script, 29432), tmp_path)
    codes = nodes.wait(150)
    took = time.monotonic() - start
    a, b = nodes.output(0), nodes.output(1)
    assert codes == [1, 2], a + b
    assert "dptrain run: error: rank 1: --widget must be positive, got -1" in b, b
    assert "dptrain run: node 1 ended the job: rank 1: --widget must be positive, got -1" in a, a
    assert took < 60, f"{took:.0f} s\n{a}\n{b}"


def test_dptrain_run_across_two_hosts_with_the_rendezvous_in_etcd(
        two_hosts, tmp_path):  # noqa: F811
    """An etcd cluster of three members living on the hosts (two on a, one on b: the
    helper a test across more hosts reuses, tests/_etcd.py), and a dynamic rendezvous in it:
    torch numbers the nodes, each agent tells the others the address that reaches it, and
    no key is left once the job has ended."""
    from tests._etcd import EtcdCluster, Member, unavailable_reason

    if unavailable_reason():
        pytest.skip(f"etcd tests skipped: {unavailable_reason()}")
    a, b = two_hosts.hosts
    cluster = EtcdCluster([
        Member(f"m{i}", host.address, client, client + 1, tmp_path / "etcd" / f"m{i}",
               prefix=tuple(host.cmd()))
        for i, (host, client) in enumerate(((a, 2379), (b, 2379), (a, 22379)))])
    with cluster:
        nodes = Nodes(two_hosts, [
            [PYTHON, "-m", "dptrain", "run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id",
             "two-hosts", ALLREDUCE] for _ in range(2)], tmp_path)
        assert nodes.wait(60) == [0, 0], nodes.output(0) + nodes.output(1)
        leaves = subprocess.run(a.cmd(PYTHON, "-c", LEAVES, cluster.endpoint),
                                capture_output=True, text=True, timeout=30, env=node_env())
    both = nodes.output(0) + nodes.output(1)
    for rank in (0, 1):
        assert f"rank {rank}/2 (torchrun): all-reduce sum 3 ok" in both, both
    for i, host in enumerate((a, b)):
        out = nodes.output(i)
        assert f"network interface {host.ifname}: the route to the rendezvous host {a.address} " \
               f"({a.address}) leaves from {host.address}" in out, out
    assert leaves.returncode == 0 and leaves.stdout.split() == [], leaves


LEAVES = """
import sys
from dptrain.launcher.etcd_rendezvous import make_client
found = make_client(sys.argv[1], {}).read("/", recursive=True)
print(*[node.key for node in found.leaves if not node.dir])
"""
"""Every key holding a value on the cluster, printed from inside a host."""
