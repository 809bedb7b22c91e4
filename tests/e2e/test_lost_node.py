"""A lost node is noticed in seconds, and a slow one is not taken for lost (two real hosts:
network namespaces, tests/_netns.py; one `dptrain train --nnodes 1:2 --nproc 1` on each).

A node cut off the network closes no socket: the survivor's collective would wait for the
process group's timeout (--timeout, 300 s here, the default). The survivor's agent sees the
node's rendezvous heartbeats stop instead and restarts its worker alone within seconds
(bench/distributed/node_loss.py times it: ~10 s on this machine). The heartbeats are the
agents', not the workers': a rank that stalls for 12 s (over twice dptrain's 5 s window) makes
the other wait in its collective, as a long checkpoint write would, and nothing is restarted.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from tests._cli import PYTHON
from tests._netns import two_hosts  # noqa: F401 - fixture
from tests.e2e.test_elastic import Node

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

# Training samples take PACE_S each to read; rank 1 sleeps STALL_S once, at its STALL_AT-th
# sample (once in the job: a marker file says it did).
PACED_DATA = """
import os, time
import torch
from dptrain.data import Split

PACE_S, STALL_S, STALL_AT, STALLED = {pace_s!r}, {stall_s!r}, {stall_at!r}, {stalled!r}


class Rows(torch.utils.data.Dataset):
    def __init__(self, x, y, paced):
        self.x, self.y, self.paced, self.read = x, y, paced, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.paced and i > 0:  # item 0: dptrain's check of the dataset
            time.sleep(PACE_S)
            self.read += 1
            if STALL_S and os.environ.get("RANK") == "1" and self.read == STALL_AT and \\
                    not os.path.exists(STALLED):
                open(STALLED, "w").close()
                time.sleep(STALL_S)
        return self.x[i], self.y[i]


def load():
    g = torch.Generator().manual_seed(0)
    x = torch.randn({n} + 32, 8, generator=g)
    y = torch.sin(x[:, :1]) + 0.1 * torch.randn({n} + 32, 1, generator=g)
    return Split(name="paced", task="regression", num_classes=None,
                 train=Rows(x[:{n}], y[:{n}], True), validation=Rows(x[{n}:{n} + 16],
                 y[{n}:{n} + 16], False), test=Rows(x[{n} + 16:], y[{n} + 16:], False))
"""
STEP = re.compile(r"^step \d+", re.M)


def _dataset(tmp_path: Path, n: int, stall_s: float = 0.0) -> str:
    path = tmp_path / "paced.py"
    path.write_text(PACED_DATA.format(pace_s=0.005, stall_s=stall_s, stall_at=80,
                                      stalled=str(tmp_path / "stalled"), n=n))
    return f"{path}:load"


def _train(a, dataset: str, out: Path, port: int, *extra: str) -> list[str]:
    return [PYTHON, "-m", "dptrain", "train", "--model", "tagi-mlp", "--hidden", "16",
            "--dataset", dataset, "--epochs", "1", "--batch-size", "32", "--workers", "0",
            "--no-progress", "--nproc", "1", "--nnodes", "1:2", "--rdzv-endpoint",
            f"{a.name}:{port}", "--rdzv-id", f"lost-node-{port}", "--max-restarts", "2",
            "--out", str(out), *extra]


def _wait(what: str, ready, nodes: list[Node], timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            text = "\n".join(f"--- {n.log.name}\n{n.output()}" for n in nodes)
            raise AssertionError(f"waited {timeout_s:g} s for {what}\n{text}")
        time.sleep(0.05)
    return time.monotonic()


def test_a_node_cut_off_the_network_is_left_behind_within_seconds(
        two_hosts, tmp_path):  # noqa: F811
    """b's link goes down mid-training; a trains on alone within SECONDS_BOUND (bench: ~10 s;
    a generous bound for a loaded 2-core machine), far from the 300 s --timeout its
    all-reduce waits for."""
    seconds_bound = 25
    a, b = two_hosts.hosts
    dataset = _dataset(tmp_path, n=32 * 2000)
    argv = _train(a, dataset, tmp_path / "run", 29481, "--val-every", "1", "--keep-last", "2")
    nodes = [Node(host, argv, tmp_path / f"{host.name}.log") for host in (a, b)]
    survivor = nodes[0]
    try:
        on_two = lambda: survivor.output().partition(" 2 process(es) (torchrun")[2]  # noqa
        _wait("3 steps on two nodes", lambda: len(STEP.findall(on_two())) >= 3, nodes, 90)
        subprocess.run(b.cmd("ip", "link", "set", b.ifname, "down"), check=True, timeout=20)
        cut = time.monotonic()
        after_cut = len(survivor.output())
        resumed = lambda: survivor.output()[after_cut:].partition("resumed from")[2]  # noqa
        stepped = _wait("a's next step alone", lambda: STEP.search(resumed()), nodes, 60)
    finally:
        subprocess.run(b.cmd("ip", "link", "set", b.ifname, "up"), timeout=20)
        for node in nodes:
            node.kill()
    text = survivor.output()
    took = stepped - cut
    assert re.search(r"dptrain train: node 0: node\(s\) \S+ gone from the rendezvous \(no "
                     r"heartbeat for 5 s, or restarting\); restarting every worker \(2 "
                     r"restart\(s\) left\)", text), text
    assert " 1 process(es) (torchrun" in text[after_cut:], text
    assert took < seconds_bound, f"{took:.1f} s from the cut to a's next step\n{text}"


def test_a_rank_that_stalls_longer_than_the_heartbeat_window_is_not_taken_for_lost(
        two_hosts, tmp_path):  # noqa: F811
    """Rank 1 stops for 12 s, over twice the heartbeat window, in the middle of the epoch
    (its data, here; a long checkpoint write stops a rank the same way): rank 0 waits for it
    in the step's all-reduce, the agents' heartbeats go on, and the job ends with no
    restart."""
    stall_s = 12.0
    a, b = two_hosts.hosts
    dataset = _dataset(tmp_path, n=32 * 20, stall_s=stall_s)
    argv = _train(a, dataset, tmp_path / "run", 29482)
    nodes = [Node(host, argv, tmp_path / f"{host.name}.log") for host in (a, b)]
    try:
        started = time.monotonic()
        codes = [node.proc.wait(timeout=120) for node in nodes]
        took = time.monotonic() - started
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.kill()
    text = "\n".join(f"--- {n.log.name}\n{n.output()}" for n in nodes)
    assert codes == [0, 0], text
    assert (tmp_path / "stalled").exists(), "rank 1 never stalled"
    assert took > stall_s, text
    assert "restarting" not in text and "gone from the rendezvous" not in text, text
    assert text.count(" 2 process(es) (torchrun") == 1, text
