"""Two agents of one elastic c10d job on one machine, as a new user tries an elastic job before
taking it to two: `dptrain train --nnodes 1:2 --nproc 1` started twice, the rendezvous endpoint
on the loopback.

The first agent serves the rendezvous store. The second, started once the first trains, finds
the store's port taken on the same machine and joins that store (torch's c10d handler, told to
serve it, failed there: "lost the rendezvous host ... EADDRINUSE"). The job grows to 2 nodes;
the second agent is killed with its worker, and the first goes on alone from the newest
checkpoint, its restart within the heartbeat window; started again, the second joins again, and
the two finish the job. A port held by something that is not a c10d store is one line naming
it, exit status 2.

The test holds training while it starts or kills an agent, through its own dataset: reading a
training sample waits while a gate file exists (tests/e2e/test_elastic.py does the same on two
network namespaces).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests._listeners import accepts_nothing, answers_http
from tests._cli import REPO, base_env, dptrain_cmd, run
from tests._world import free_port

pytestmark = [pytest.mark.e2e]

GATED_DATA = """
import os, time
import torch
from dptrain.data import Split

GATE = {gate!r}


class Rows(torch.utils.data.Dataset):
    def __init__(self, x, y, gated):
        self.x, self.y, self.gated = x, y, gated

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.gated and i > 0:  # item 0: dptrain's check of the dataset
            while os.path.exists(GATE):
                time.sleep(0.02)
            time.sleep(0.001)
        return self.x[i], self.y[i]


def load():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(420, 8, generator=g)
    y = torch.sin(x[:, :1]) + 0.1 * torch.randn(420, 1, generator=g)
    return Split(name="gated", task="regression", num_classes=None,
                 train=Rows(x[:340], y[:340], True),
                 validation=Rows(x[340:380], y[340:380], False),
                 test=Rows(x[380:], y[380:], False))
"""
# 340 samples, global batch 32: 11 steps an epoch; a checkpoint every 5 steps. The test needs
# four checkpoints (20 steps) before it lets the job run to its end.
TRAIN = ["train", "--model", "tagi-mlp", "--hidden", "16", "--epochs", "3", "--batch-size", "32",
         "--checkpoint-every", "5", "--keep-last", "100", "--workers", "0", "--no-progress",
         "--nproc", "1", "--nnodes", "1:2", "--max-restarts", "2", "--timeout", "60"]
HEARTBEAT_WINDOW_S = 5
"""dptrain's keep_alive_interval x keep_alive_max_attempt (dptrain.launcher.rendezvous)."""
NOTICE_SLACK_S = 7
"""On top of the window: the agent's next look at the round, on a loaded 2-core machine."""
TWO = "2 process(es) (torchrun"
ONE = "1 process(es) (torchrun"
RESUMED = re.compile(r"resumed from \S+/step-(\d+) \(epoch")
LOST = (r"(rank \d lost rank\(s\) \d at step \d+ \(exit code 5\)|node \d: node\(s\) \S+ gone "
        r"from the rendezvous \(no heartbeat for 5 s, or restarting\)); restarting every worker")


def _descendants(pid: int) -> list[int]:
    """Every process under `pid` (torch starts each worker in a session of its own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Agent:
    """One `dptrain train` of the job, its output in a file (no pipe to fill)."""

    def __init__(self, argv: list[str], log: Path):
        self.log, self.killed = log, False
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=base_env(), stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text()

    def kill(self) -> None:
        """The agent and its workers, at once (SIGKILL, no goodbye), as a node that is lost."""
        self.killed = True
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=20)


class Job:
    """The agents of the job and the test's hold on its training."""

    def __init__(self, tmp_path: Path, argv: list[str], deadline_s: float):
        self.tmp, self.argv = tmp_path, argv
        self.out, self.gate = tmp_path / "shared", tmp_path / "hold"
        self.agents: list[Agent] = []
        self.deadline = time.monotonic() + deadline_s

    def start(self) -> Agent:
        agent = Agent(self.argv, self.tmp / f"agent-{len(self.agents)}.log")
        self.agents.append(agent)
        return agent

    def text(self) -> str:
        return "\n".join(f"--- {a.log.name}\n{a.output()}" for a in self.agents)

    def count(self, what: str) -> int:
        return sum(a.output().count(what) for a in self.agents)

    def wait_for(self, what: str, ready) -> float:
        while not ready():
            assert time.monotonic() < self.deadline, f"waited too long for {what}\n{self.text()}"
            ended = [a.log.name for a in self.agents if not a.killed and a.proc.poll() is not None]
            assert not ended, f"{ended} ended while waiting for {what}\n{self.text()}"
            time.sleep(0.05)
        return time.monotonic()

    def steps(self) -> list[int]:
        """The steps of the published checkpoints (not those still in `step-N.tmp`)."""
        found = (re.fullmatch(r"step-(\d+)", p.name) for p in self.out.glob("checkpoints/*"))
        return sorted(int(m[1]) for m in found if m)

    def train_until_a_new_checkpoint(self) -> None:
        newest = max(self.steps(), default=0)
        self.gate.unlink(missing_ok=True)
        self.wait_for(f"a checkpoint after step {newest}",
                      lambda: max(self.steps(), default=0) > newest)
        self.gate.touch()


def _world_sizes_of_the_checkpoints(out: Path) -> list[int]:
    metas = sorted((out / "checkpoints").glob("step-*[0-9]/meta.json"))
    return [json.loads(meta.read_text())["world_size"] for meta in metas]


@pytest.mark.timeout(170)
def test_a_second_agent_on_the_rendezvous_host_joins_the_job_and_rejoins_after_a_loss(tmp_path):
    data = tmp_path / "gated.py"
    data.write_text(GATED_DATA.format(gate=str(tmp_path / "hold")))
    job = Job(tmp_path, dptrain_cmd(
        *TRAIN, "--dataset", f"{data}:load", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "--rdzv-id", "two-agents", "--out", str(tmp_path / "shared")), deadline_s=130)
    job.gate.touch()
    try:
        first = job.start()
        job.wait_for("the first agent's worker", lambda: job.count(ONE) == 1)
        job.train_until_a_new_checkpoint()  # it trains alone

        second = job.start()  # the store's port is taken on this machine: it joins
        job.wait_for("the workers on 2 nodes", lambda: job.count(TWO) == 1)
        job.train_until_a_new_checkpoint()

        before = len(first.output())
        second.kill()  # the first agent's heartbeats notice, or its worker's next collective
        killed = time.monotonic()
        after = lambda: first.output()[before:]  # noqa
        noticed = job.wait_for("the first agent to restart its worker alone",
                               lambda: "restarting every worker (" in after())
        job.wait_for("the first agent's worker alone again", lambda: job.count(ONE) == 2)
        job.wait_for("its worker to resume", lambda: RESUMED.search(after()))
        # Held at the gate: the checkpoints are those the two workers published.
        assert int(RESUMED.search(after())[1]) == max(job.steps()), (job.steps(), job.text())
        job.train_until_a_new_checkpoint()

        job.start()  # started again: joins again
        job.wait_for("the workers on 2 nodes again", lambda: job.count(TWO) == 2)
        job.train_until_a_new_checkpoint()

        job.gate.unlink()
        for agent in (first, job.agents[2]):
            assert agent.proc.wait(timeout=max(1, job.deadline - time.monotonic())) == 0, \
                job.text()
    finally:
        job.gate.unlink(missing_ok=True)
        for agent in job.agents:
            if agent.proc.poll() is None:
                agent.kill()

    text = job.text()
    assert "lost the rendezvous host" not in text and "EADDRINUSE" not in text, text
    assert "Traceback" not in text, text
    assert first.output().count("node(s) waiting to join the job; restarting every worker to "
                                "take them in (not counted as a restart)") == 2, text
    assert re.search(LOST + r" \(2 restart\(s\) left\)", first.output()), text
    took = noticed - killed
    print(f"second agent lost: the first restarted its worker alone {took:.1f} s after: "
          f"{re.search(LOST + r'.*', first.output())[0]}")
    assert took < HEARTBEAT_WINDOW_S + NOTICE_SLACK_S, \
        f"{took:.1f} s from the kill to the first agent's restart\n{text}"
    worlds = _world_sizes_of_the_checkpoints(job.out)
    assert [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]] == [1, 2, 1, 2], \
        worlds
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final_epoch"] == 3, summary


@pytest.mark.timeout(90)
@pytest.mark.parametrize("listener", [accepts_nothing, answers_http], ids=["silent", "http"])
def test_a_rendezvous_port_held_by_another_listener_is_one_line_naming_it(listener, tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        listener(held)
        port = held.getsockname()[1]
        started = time.monotonic()
        result = run(dptrain_cmd(*TRAIN, "--dataset", "toy1d", "--rdzv-endpoint",
                                 f"127.0.0.1:{port}", "--out", str(tmp_path / "run")),
                     timeout_s=60)
        took = time.monotonic() - started
    lines = [line for line in result.stderr.splitlines() if f"port {port} " in line]
    assert result.returncode == 2, result.output
    assert lines == [(f"dptrain train: error: --rdzv-endpoint 127.0.0.1:{port}: port {port} is "
                      f"held by something that is not a c10d rendezvous store (it does not "
                      f"answer as one); free the port or give every node another one")], \
        result.output
    assert "Traceback" not in result.output and "lost the rendezvous" not in result.output
    assert took < 40, f"{took:.1f} s\n{result.output}"
