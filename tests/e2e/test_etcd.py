"""`--rdzv-backend etcd` against a real three-member etcd cluster on the loopback
(tests/_etcd.py): a job trains as it does under c10d, two jobs on one cluster keep apart, a
finished job leaves no keys, the job goes on when the first member dies, and a cluster that
cannot serve is refused in one line."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from dptrain.launcher import etcd_rendezvous
from dptrain.cli.main import main
from tests._cli import REPO, base_env, dptrain_cmd, run, stop
from tests._etcd import (etcd_cluster, loopback_cluster, make_tls,  # noqa: F401 - fixture
                         unavailable_reason)

pytestmark = pytest.mark.e2e
# A small TAGI run on the built-in digits: 8 steps of 32 on 2 processes.
TRAIN = ["train", "--nproc", "2", "--hidden", "16", "--epochs", "1", "--max-steps", "8",
         "--no-progress"]
RUN_S = 90
"""Deadline of each run: killed (and the test failed) past it."""
NO_MEMBER = ("has no member that answers: start the cluster first (etcd >= 3.4 with "
             "--enable-v2; Debian: apt-get install etcd-server), or check its TLS settings "
             "(--rdzv-conf protocol=https,cacert=...,cert=...,key=...)")


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _leaves(client, key: str = "/") -> list[str]:
    """Every key holding a value under `key` (directories left out)."""
    import etcd

    try:
        found = client.read(key, recursive=True)
    except etcd.EtcdKeyNotFound:
        return []
    return [node.key for node in found.leaves if not node.dir]


def _store_key_names(leaves: list[str], job: str) -> set[str]:
    """The store keys of job `job`, decoded (the store writes them in URL-safe base64)."""
    prefix = f"{etcd_rendezvous.job_directory(job)}/store/"
    return {base64.urlsafe_b64decode(k[len(prefix):]).decode() for k in leaves
            if k.startswith(prefix)}


def _watching(procs: dict[str, subprocess.Popen], client) -> tuple[dict[str, str], set[str]]:
    """Each process's output once all have ended, and every key seen on the cluster while they
    ran (read every 50 ms); past RUN_S they are stopped and the test fails."""
    seen: set[str] = set()
    deadline = time.monotonic() + RUN_S
    try:
        while any(p.poll() is None for p in procs.values()):
            assert time.monotonic() < deadline, f"still running after {RUN_S}s"
            seen.update(_leaves(client))
            time.sleep(0.05)
        return {name: p.communicate()[0] for name, p in procs.items()}, seen
    finally:
        for p in procs.values():
            stop(p)


@pytest.mark.dist
def test_two_jobs_on_one_cluster_train_as_under_c10d_and_leave_no_keys(etcd_cluster, tmp_path):
    """Two 2-process jobs with their own run ids on one cluster at the same time: each trains
    on its own world of 2, with the parameters of the same run under c10d; while they run each
    job's keys are in its own directory and its store names only its own rendezvous; once they
    have finished, no key is left on the cluster."""
    jobs = {"job-a": tmp_path / "a", "job-b": tmp_path / "b", "c10d": tmp_path / "c10d"}

    def rendezvous(job: str) -> list[str]:
        # The reference runs beside them: its standalone rendezvous is a port of its own.
        return [] if job == "c10d" else ["--rdzv-backend", "etcd", "--rdzv-endpoint",
                                         etcd_cluster.endpoint, "--rdzv-id", job]

    procs = {job: subprocess.Popen(
        dptrain_cmd(*TRAIN, "--out", str(out), *rendezvous(job)), cwd=REPO, env=base_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for job, out in jobs.items()}
    client = etcd_cluster.client()
    outputs, seen = _watching(procs, client)
    for job, out in jobs.items():
        assert procs[job].returncode == 0, outputs[job]
        assert _summary(out)["world_size"] == 2, outputs[job]
        assert _summary(out)["params_sha256"] == _summary(jobs["c10d"])["params_sha256"]
    for job, other in (("job-a", "job-b"), ("job-b", "job-a")):  # apart from each other
        mine = _store_key_names(sorted(seen), job)
        assert any(k.startswith(f"torch.rendezvous.{job}.") for k in mine), (job, seen)
        assert not [k for k in mine if other in k], (job, mine)
        assert f"{etcd_rendezvous.job_directory(job)}/rendezvous" in seen, seen
    assert all(k.startswith(f"{etcd_rendezvous.JOBS}/job-") for k in seen), seen
    assert _leaves(client) == []


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
        while self.gated and i > 0 and os.path.exists(GATE):  # item 0: dptrain's check
            time.sleep(0.02)
        return self.x[i], self.y[i]


def load():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=g)
    y = x[:, :1] * 0.5
    return Split(name="gated", task="regression", num_classes=None,
                 train=Rows(x[:64], y[:64], True), validation=Rows(x[64:80], y[64:80], False),
                 test=Rows(x[80:], y[80:], False))
"""


def _held_job(cluster, tmp_path: Path, rdzv_id: str) -> tuple[subprocess.Popen, Path, Path]:
    """A 2-process etcd job (heartbeats every second) whose workers are held at a gate once
    they train: (its process, its log, the gate, to be removed to let it go)."""
    gate = tmp_path / "hold"
    gate.touch()
    data = tmp_path / "gated.py"
    data.write_text(GATED_DATA.format(gate=str(gate)))
    log = tmp_path / "train.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            dptrain_cmd("train", "--dataset", f"{data}:load", "--model", "tagi-mlp",
                        "--hidden", "8", "--batch-size", "16", "--epochs", "1", "--workers",
                        "0", "--no-progress", "--out", str(tmp_path / "run"), "--rdzv-backend",
                        "etcd", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", rdzv_id,
                        "--rdzv-conf", "keep_alive_interval=1"),
            cwd=REPO, env=base_env(), stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True)
    deadline = time.monotonic() + RUN_S
    while "process(es) (torchrun" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            pytest.fail(f"the job never trained\n{log.read_text()}")
        time.sleep(0.1)
    return proc, log, gate


@pytest.mark.dist
def test_the_job_goes_on_when_the_first_member_dies(etcd_cluster, tmp_path):
    """The member every agent talks to first is killed while the workers train (held at a
    gate): the agent's heartbeats, the exit barrier and the removal of the job's keys go
    through the other members, and the job ends as it would have."""
    proc, log, gate = _held_job(etcd_cluster, tmp_path, "survivor")
    try:
        etcd_cluster.kill(0)
        state = f"{etcd_rendezvous.job_directory('survivor')}/rendezvous"
        client = etcd_cluster.client()  # of the members left
        beat = client.read(state).modifiedIndex
        # The agent's heartbeats (each a write of the state) go on through another member,
        # after a pause when the member killed led the cluster: a write forwarded to it is
        # lost, and its sender waits out its request timeout (REQUEST_TIMEOUT_S).
        waited = time.monotonic() + etcd_rendezvous.REQUEST_TIMEOUT_S + 10
        while client.read(state).modifiedIndex <= beat:
            assert time.monotonic() < waited, "no heartbeat after the first member died"
            time.sleep(0.2)
        assert proc.poll() is None, log.read_text()
        gate.unlink()
        assert proc.wait(timeout=RUN_S) == 0, log.read_text()
    finally:
        gate.unlink(missing_ok=True)
        stop(proc)
    assert _summary(tmp_path / "run")["world_size"] == 2
    assert "Traceback" not in log.read_text(), log.read_text()
    assert _leaves(etcd_cluster.client()) == []


@pytest.mark.dist
def test_the_workers_train_on_while_the_whole_cluster_is_down(etcd_cluster, tmp_path):
    """Every member killed while the workers train: they never talk to etcd, so they end
    the run; the agent says once that the cluster does not answer (torch's would have ended
    the job at its next look for nodes waiting to join)."""
    proc, log, gate = _held_job(etcd_cluster, tmp_path, "alone")
    try:
        for member in range(3):
            etcd_cluster.kill(member)
        time.sleep(2)  # a few of the agent's looks
        assert proc.poll() is None, log.read_text()
        gate.unlink()
        assert proc.wait(timeout=RUN_S) == 0, log.read_text()
    finally:
        gate.unlink(missing_ok=True)
        stop(proc)
    assert _summary(tmp_path / "run")["world_size"] == 2
    text = log.read_text()
    assert text.count(f"dptrain: the etcd cluster at {etcd_cluster.endpoint} does not answer "
                      f"(No more machines in the cluster); the workers train on") == 1, text
    assert "Traceback" not in text, text


def test_the_agents_store_and_the_keys_of_a_job(etcd_cluster):
    """In one process, on the real cluster: the store's compare_set has c10d's semantics (the
    agents agree on the run label with it); a job's keys expire once no agent renews them (all
    killed), and the last agent to release removes them."""
    client = etcd_rendezvous.make_client(etcd_cluster.endpoint, {})
    store = etcd_rendezvous.JobStore(client, "/t/store", timedelta(seconds=5))
    assert store.compare_set("label", "", "first") == b"first"
    assert store.compare_set("label", "", "second") == b"first"  # taken: the holder's value
    assert store.compare_set("label", "first", "third") == b"third"
    assert store.compare_set("absent", "x", "y") == b"x"  # as c10d's TCPStore answers
    assert not store.check(["absent"])
    store.set("ab?", "v")  # standard base64 "YWI/": a directory "YWI" and a key in it
    assert store.get("ab?") == b"v" and store.check(["ab?"])

    killed = etcd_rendezvous.JobKeys(client, etcd_rendezvous.job_directory("killed"), ttl_s=2)
    killed.renew()  # and never again: its agent was killed
    two = [etcd_rendezvous.JobKeys(client, etcd_rendezvous.job_directory("ended"), ttl_s=60)
           for _ in range(2)]
    for keys in two:
        keys.start()
    two[0].release()
    assert any("/ended/agents/" in k for k in _leaves(client)), "the other agent's key went"
    two[1].release()
    time.sleep(3)
    assert [k for k in _leaves(client) if k.startswith(etcd_rendezvous.JOBS)] == []


def test_a_cluster_that_cannot_serve_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """Without the client, with no member answering, and with etcd's v2 API off: one line
    that says what to install or start, before any worker starts (exit status 2)."""
    if unavailable_reason():
        pytest.skip(f"etcd tests skipped: {unavailable_reason()}")
    script = tmp_path / "s.py"
    script.write_text("")
    argv = ["run", "--rdzv-backend", "etcd", "--rdzv-id", "refused", str(script)]
    # Nothing listens at a port just released; the v2-less member listens on another.
    v2_off = loopback_cluster(tmp_path / "v2-off", size=1, v2=False)
    nothing = f"127.0.0.9:{v2_off.members[0].peer_port}"
    with monkeypatch.context() as hidden:
        hidden.setitem(sys.modules, "etcd", None)  # import etcd fails: as if not installed
        assert main([*argv[:-1], "--rdzv-endpoint", nothing, str(script)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dptrain run: error: {etcd_rendezvous.INSTALL_HINT}"]
    assert main([*argv[:-1], "--rdzv-endpoint", nothing, str(script)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dptrain run: error: --rdzv-backend etcd: the etcd cluster at {nothing} {NO_MEMBER}"]
    with v2_off:
        assert main([*argv[:-1], "--rdzv-endpoint", v2_off.endpoint, str(script)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dptrain run: error: --rdzv-backend etcd: the etcd cluster at {v2_off.endpoint} "
        f"answers, but not on etcd's v2 API: start etcd (>= 3.4) with --enable-v2"]


@pytest.mark.dist
def test_a_cluster_that_takes_only_tls_is_reached_with_the_certificates(tmp_path):
    """Members that take https only, from a client holding a certificate of their CA: the
    TLS settings in --rdzv-conf, spelled as for etcdctl, carry a 2-process job through;
    without them, one line that names them (such a member closes a plain connection without
    a word, as if it were down)."""
    if unavailable_reason():
        pytest.skip(f"etcd tests skipped: {unavailable_reason()}")
    tls = make_tls(tmp_path / "tls", [f"127.0.0.{i}" for i in (1, 2, 3)])
    argv = ["run", "-n", "2", "--rdzv-backend", "etcd", "--rdzv-id", "tls-job"]
    allreduce = str(REPO / "examples" / "allreduce.py")
    with loopback_cluster(tmp_path / "etcd", tls=tls) as cluster:
        job = run(dptrain_cmd(*argv, "--rdzv-endpoint", cluster.endpoint, "--rdzv-conf",
                              tls.rdzv_conf(), allreduce), timeout_s=RUN_S)
        refused = run(dptrain_cmd(*argv, "--rdzv-endpoint", cluster.endpoint, allreduce),
                      timeout_s=RUN_S)
        left = _leaves(cluster.client())
    assert job.returncode == 0, job.output
    for rank in (0, 1):
        assert f"rank {rank}/2 (torchrun): all-reduce sum 3 ok" in job.stdout, job.output
    assert left == []
    assert refused.returncode == 2 and refused.stderr.splitlines() == [
        f"dptrain run: error: --rdzv-backend etcd: the etcd cluster at {cluster.endpoint} "
        f"{NO_MEMBER}"], refused.output


@pytest.mark.dist
def test_a_search_runs_its_trials_in_rendezvous_of_their_own(etcd_cluster, tmp_path):
    """`dptrain tune` with the runs' rendezvous in etcd: a 2-process trial meets under an id
    of its own (no --rdzv-id given) and leaves no key."""
    pytest.importorskip("optuna")
    study = tmp_path / "study"
    search = subprocess.Popen(
        dptrain_cmd("tune", "--model", "tagi-mlp", "--dataset", "toy1d", "--nproc", "2",
                    "--monitor", "train_rmse", "--hidden", "16", "--epochs", "2", "--out",
                    str(study), "--space", "sigma_v=float:0.1:0.5", "--max-trials", "1",
                    "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_cluster.endpoint),
        cwd=REPO, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    client = etcd_cluster.client()
    outputs, seen = _watching({"tune": search}, client)
    log = (study / "trial-0000" / "train.log").read_text()
    assert search.returncode == 0, outputs["tune"] + log
    assert "1 of 1 trials done" in outputs["tune"], outputs["tune"]
    assert "2 process(es) (torchrun" in log, log
    jobs = {k.split("/")[3] for k in seen}
    assert len(jobs) == 1 and jobs.pop().startswith("tune-study-trial-0000-"), seen
    assert _leaves(client) == []
