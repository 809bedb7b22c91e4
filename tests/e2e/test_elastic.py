"""Elastic `dptrain train --nnodes 1:2` on two real hosts (network namespaces, tests/_netns.py).

One job, several membership changes: node b's whole agent is killed mid-epoch (a node lost),
a comes back alone from the newest checkpoint; b is started again and joins at once (a restart
that costs no --max-restarts); b is killed again and a finishes alone. TAGI's sum mode then ends
with the parameters of a run that was never interrupted, up to float summation order (float32,
<= 1e-5 relative). Last, b is started once more after the job ended: it exits at once, with the
line that says so, instead of waiting for a rendezvous that is gone with a's agent.

Both hosts see the run directory on the same filesystem, as elastic jobs require. The test
holds training while it kills or starts a node, through its own dataset: reading a training
sample waits while a gate file exists (and takes 1 ms while a pace file exists, so that only a
step or two pass between two looks at the checkpoints).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from dptrain.cli.main import main
from tests._cli import PYTHON, REPO
from tests._netns import Host, two_hosts  # noqa: F401 - fixture
from tests._runs import max_relative_difference
from tests.e2e.test_multinode import node_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GATED_DATA = """
import os, time
import torch
from dptrain.data import Split

GATE, PACE = {gate!r}, {pace!r}


class Rows(torch.utils.data.Dataset):
    def __init__(self, x, y, gated):
        self.x, self.y, self.gated = x, y, gated

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        # Item 0 is the one dptrain reads to check the dataset when it loads it.
        if self.gated and i > 0:
            while os.path.exists(GATE):
                time.sleep(0.02)
            if os.path.exists(PACE):
                time.sleep(0.001)
        return self.x[i], self.y[i]


def load():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(420, 8, generator=g)
    y = torch.sin(x[:, :1]) + 0.5 * x[:, 1:2] * x[:, 2:3] + 0.1 * torch.randn(420, 1, generator=g)
    # its own validation part, ungated: only training samples wait at the gate
    return Split(name="gated", task="regression", num_classes=None,
                 train=Rows(x[:340], y[:340], True),
                 validation=Rows(x[340:380], y[340:380], False),
                 test=Rows(x[380:], y[380:], False))
"""
# 340 samples, global batch 32: 11 steps an epoch, the last of 20 samples (10 a rank on 2).
EPOCHS = 4
COMMON = ["train", "--model", "tagi-mlp", "--hidden", "16", "--epochs", str(EPOCHS),
          "--batch-size", "32", "--checkpoint-every", "5", "--keep-last", "100", "--workers", "0",
          "--no-progress"]


class Node:
    """One `dptrain train` on one host, its output in a file (no pipe to fill)."""

    def __init__(self, host: Host, argv: list[str], log: Path):
        self.host, self.log = host, log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(host.cmd(*argv), cwd=REPO, env=node_env(), stdout=out,
                                         stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()

    def kill(self, spare: frozenset[int] = frozenset()) -> None:
        """The whole node: its agent and every worker, at once (SIGKILL, no goodbye); the
        processes `spare` names (another service on the host) go on."""
        pids = subprocess.run(["ip", "netns", "pids", self.host.ns], capture_output=True,
                              text=True, timeout=20).stdout.split()
        pids = [pid for pid in pids if int(pid) not in spare]
        subprocess.run(["kill", "-9", *pids], capture_output=True, timeout=20)
        self.proc.wait(timeout=20)


class Job:
    """The nodes of the job and the test's hold on its training."""

    def __init__(self, out: Path, gate: Path, logs: Path, argv: list[str]):
        self.out, self.gate, self.logs, self.argv = out, gate, logs, argv
        self.nodes: list[Node] = []
        self.deadline = time.monotonic() + 150

    def start(self, host: Host) -> Node:
        node = Node(host, self.argv, self.logs / f"{len(self.nodes)}-{host.name}.log")
        self.nodes.append(node)
        return node

    def text(self) -> str:
        return "\n".join(f"--- {n.log.name}\n{n.output()}" for n in self.nodes)

    def wait_for(self, what: str, ready) -> None:
        while not ready():
            assert time.monotonic() < self.deadline, f"waited too long for {what}\n{self.text()}"
            time.sleep(0.05)

    def steps(self) -> list[int]:
        """The steps of the published checkpoints (not those still in `step-N.tmp`)."""
        found = (re.fullmatch(r"step-(\d+)", p.name) for p in self.out.glob("checkpoints/*"))
        return sorted(int(m[1]) for m in found if m)

    def train_until_a_new_checkpoint(self) -> None:
        """Let the workers that run now train until they publish a checkpoint newer than any
        there is (so they resumed and trained), then hold them. Called while they are held:
        the attempts before them are over, their writes published or dead."""
        newest = max(self.steps(), default=0)
        self.gate.unlink(missing_ok=True)
        self.wait_for(f"a checkpoint after step {newest}",
                      lambda: max(self.steps(), default=0) > newest)
        self.gate.touch()

    def started_at(self, world_size: int) -> int:
        """How many attempts (on any node) started the job's workers on `world_size`."""
        return sum(n.output().count(f"{world_size} process(es) (torchrun") for n in self.nodes)


def _world_sizes_of_the_checkpoints(out: Path) -> list[tuple[int, int]]:
    found = []
    for meta in sorted((out / "checkpoints").glob("step-*[0-9]/meta.json")):
        record = json.loads(meta.read_text())
        found.append((record["step"], record["world_size"]))
    return found


def test_a_lost_node_leaves_the_others_going_and_a_node_that_comes_back_joins(
        two_hosts, tmp_path):  # noqa: F811
    a, b = two_hosts.hosts
    gate, pace = tmp_path / "hold", tmp_path / "pace"
    data = tmp_path / "gated.py"
    data.write_text(GATED_DATA.format(gate=str(gate), pace=str(pace)))
    dataset = f"{data}:load"
    assert main([*COMMON, "--dataset", dataset, "--nproc", "1",
                 "--out", str(tmp_path / "clean")]) == 0
    pace.touch()

    out = tmp_path / "shared"
    logs = tmp_path / "logs"
    logs.mkdir()
    job = Job(out, gate, logs, [
        PYTHON, "-m", "dptrain", *COMMON, "--dataset", dataset, "--nproc", "1",
        "--nnodes", "1:2", "--rdzv-endpoint", f"{a.name}:29441", "--rdzv-id", "elastic-test",
        "--max-restarts", "2", "--timeout", "60", "--out", str(out)])
    gate.touch()
    try:
        node_a, node_b = job.start(a), job.start(b)
        job.wait_for("the workers on 2 nodes", lambda: job.started_at(2) == 1)
        job.train_until_a_new_checkpoint()

        node_b.kill()  # mid-epoch: b's worker waits for its sample, a's too
        alone = job.started_at(1)
        gate.unlink()  # a's worker goes on to the step's all-reduce and finds b gone
        job.wait_for("a's agent to restart its worker",
                     lambda: "restarting every worker (2 restart(s) left)" in node_a.output())
        gate.touch()
        job.wait_for("a alone", lambda: job.started_at(1) > alone)
        job.train_until_a_new_checkpoint()

        node_b = job.start(b)  # comes back: joins at once, restarting a's workers
        job.wait_for("the workers on 2 nodes again", lambda: job.started_at(2) == 2)
        job.train_until_a_new_checkpoint()

        node_b.kill()
        gate.unlink()
        assert node_a.proc.wait(timeout=max(1, job.deadline - time.monotonic())) == 0, \
            job.text()

        # A node that comes after the end exits at once, saying so.
        started = time.monotonic()
        late = job.start(b)
        assert late.proc.wait(timeout=60) == 0, job.text()
        took = time.monotonic() - started
    finally:
        gate.unlink(missing_ok=True)
        for node in job.nodes:
            if node.proc.poll() is None:
                node.kill()

    text_a = node_a.output()
    # Each lost node costs a restart; the node that joined costs none. The survivor's worker
    # (its all-reduce fails) or its agent (b's heartbeats stop) notices first, whichever.
    lost = (r"(rank \d lost rank\(s\) \d at step \d+ \(exit code 5\)|node \d: node\(s\) \S+ "
            r"gone from the rendezvous \(no heartbeat for 5 s, or restarting\)); restarting "
            r"every worker")
    assert re.search(lost + r" \(2 restart\(s\) left\)", text_a), text_a
    assert "node(s) waiting to join the job; restarting every worker to take them in (not " \
        "counted as a restart)" in text_a, text_a
    assert re.search(lost + r" \(1 restart\(s\) left\)", text_a), text_a
    assert job.text().count("resumed from") == 3, job.text()
    assert "Traceback" not in job.text(), job.text()

    worlds = [w for _, w in _world_sizes_of_the_checkpoints(out)]
    assert [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]] == [2, 1, 2, 1], \
        _world_sizes_of_the_checkpoints(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["final_epoch"] == EPOCHS
    gap = max_relative_difference(out, tmp_path / "clean")
    print(f"elastic 2 -> 1 -> 2 -> 1 nodes: max relative difference {gap:.3g}")
    assert gap <= 1e-5

    late_text = late.output()
    assert "dptrain train: the elastic job 'elastic-test' ended at " in late_text, late_text
    assert f"(succeeded; {out / 'ended-elastic-test.json'}); nothing to join" in late_text
    assert took < 30, f"the late node took {took:.1f} s\n{late_text}"


def test_with_the_rendezvous_in_etcd_the_job_goes_on_without_the_node_named_first(
        two_hosts, tmp_path):  # noqa: F811
    """Under c10d the node the endpoint names serves the rendezvous, and the job cannot
    outlive it. With the rendezvous in an etcd cluster whose members live on both hosts, node
    a's agent and worker are killed mid-epoch (its etcd members go on) and node b goes on
    alone from the newest checkpoint to the end."""
    from tests._etcd import EtcdCluster, Member, unavailable_reason

    if unavailable_reason():
        pytest.skip(f"etcd tests skipped: {unavailable_reason()}")
    a, b = two_hosts.hosts
    gate, pace = tmp_path / "hold", tmp_path / "pace"
    data = tmp_path / "gated.py"
    data.write_text(GATED_DATA.format(gate=str(gate), pace=str(pace)))
    pace.touch()
    out, logs = tmp_path / "shared", tmp_path / "logs"
    logs.mkdir()
    cluster = EtcdCluster([
        Member(f"m{i}", host.address, client, client + 1, tmp_path / "etcd" / f"m{i}",
               prefix=tuple(host.cmd()))
        for i, (host, client) in enumerate(((a, 2379), (b, 2379), (a, 22379)))])
    job = Job(out, gate, logs, [
        PYTHON, "-m", "dptrain", *COMMON, "--dataset", f"{data}:load", "--nproc", "1",
        "--nnodes", "1:2", "--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoint,
        "--rdzv-id", "etcd-elastic",
        # Quick to notice a lost node, as under c10d (etcd keeps torch's 15 s by default).
        "--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=5",
        "--max-restarts", "2", "--timeout", "60", "--out", str(out)])
    gate.touch()
    with cluster:
        try:
            node_a, node_b = job.start(a), job.start(b)
            job.wait_for("the workers on 2 nodes", lambda: job.started_at(2) == 1)
            job.train_until_a_new_checkpoint()
            node_a.kill(spare=frozenset(m.proc.pid for m in cluster.members))
            gate.unlink()  # b's worker goes on to the step's all-reduce and finds a gone
            assert node_b.proc.wait(timeout=max(1, job.deadline - time.monotonic())) == 0, \
                job.text()
        finally:
            gate.unlink(missing_ok=True)
            for node in job.nodes:
                if node.proc.poll() is None:
                    node.kill(spare=frozenset(m.proc.pid for m in cluster.members))
    text_b = node_b.output()
    assert "restarting every worker" in text_b and "resumed from" in text_b, job.text()
    assert "Traceback" not in job.text(), job.text()
    worlds = [w for _, w in _world_sizes_of_the_checkpoints(out)]
    assert worlds[0] == 2 and worlds[-1] == 1, _world_sizes_of_the_checkpoints(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["final_epoch"] == EPOCHS
