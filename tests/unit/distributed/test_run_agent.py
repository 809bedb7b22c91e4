"""dptrain's elastic agent (`dptrain.launcher.agent.agent_class`) on torch's real classes and real
worker processes: a worker that ends while writing its error file is a failed, restartable
worker and not a crash of the agent (issue 21), and an expected error is not retried, which
rests on private torch hooks that this file checks are still called.

The workers are tiny `python -c` scripts (no torch import), so each test costs a second or so.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import DistNetworkError, TCPStore
from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousConnectionError
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

from dptrain.errors import ConfigError
from dptrain.launcher import job_end
from dptrain.launcher.agent import agent_class
from dptrain.launcher.c10d_rendezvous import rendezvous_failed, wait_for_host
from dptrain.launcher.error_files import replace_unreadable_error_file, unreadable_error_file
from dptrain.launcher.failures import EXPECTED_EXIT_CODES, expected_error, root_cause
from dptrain.launcher.quiet import quiet_cpp_warnings

# What torch's ErrorHandler had written of a RankFailure record when its writer was stopped.
TRUNCATED = '{"message": {"message": "RankFailure: rank 0 left the collective", "extraInfo"'

# Opens its error file, writes argv[1], flushes, says so (argv[2]) and waits there, mid-write,
# until the agent stops it: the surviving rank of issue 21, recording its RankFailure.
WRITER = """
import os, sys, time
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fp:
    fp.write(sys.argv[1])
    fp.flush()
    open(sys.argv[2], "w").close()
    time.sleep(120)
"""

# Waits for the writer to be mid-write (argv[1]), then SIGKILLs itself like fault injection.
KILLED = """
import os, signal, sys, time
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGKILL)
"""

# Writes argv[1] as its whole error file and leaves with status argv[2] (its own failure).
LEAVES_A_FILE = """
import os, sys
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fp:
    fp.write(sys.argv[1])
sys.exit(int(sys.argv[2]))
"""

SLEEPER = "import time; time.sleep(120)"


@pytest.fixture(autouse=True)
def _signal_handlers():
    """torch's process context installs its own SIGTERM/SIGINT/... handlers in this process:
    put pytest's back."""
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {name: signal.getsignal(getattr(signal, name)) for name in names}
    yield
    for name, handler in saved.items():
        signal.signal(getattr(signal, name), handler)


@pytest.fixture(autouse=True)
def _agent_environment(monkeypatch):
    """The agent hands DPTRAIN_ATTEMPT and DPTRAIN_RUN_LABEL to its workers through this
    process's environment: put it back as it was."""
    for name in ("DPTRAIN_ATTEMPT", "DPTRAIN_RUN_LABEL"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def _agent(tmp_path: Path, nproc: int, max_restarts: int = 3, port: int = 0,
           end_record: Path | None = None):
    spec = WorkerSpec(role="trainer", local_world_size=nproc, entrypoint=sys.executable,
                      rdzv_handler=StaticTCPRendezvous("localhost", port, 0, 1, "t", 30),
                      max_restarts=max_restarts, monitor_interval=0.05)
    agent = agent_class("run", end_record)
    return agent(spec, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))


def _monitor_until_done(agent, argv: dict[int, tuple[str, ...]]):
    """Start `argv`'s workers as the agent's own would be and run its monitor until they are
    done; the agent's process context stops any that are left."""
    group = agent._worker_group
    agent._pcontext = start_processes(
        name="trainer", entrypoint=sys.executable, args=argv,
        envs={rank: {} for rank in argv}, logs_specs=agent._logs_specs)
    try:
        for worker in group.workers:
            worker.id = agent._pcontext.pids()[worker.local_rank]
            worker.global_rank = worker.local_rank
        deadline = time.monotonic() + 60
        while (result := agent._monitor_workers(group)).state == WorkerState.HEALTHY:
            assert time.monotonic() < deadline, "the workers did not end within 60 s"
            time.sleep(0.02)
        return result
    finally:
        agent._pcontext.close(timeout=5)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("payload", ["", TRUNCATED], ids=["empty", "truncated"])
def test_a_rank_stopped_while_writing_its_error_file_is_a_restartable_failure(
        tmp_path, capsys, payload):
    """Issue 21's race, made certain: rank 1 is mid-write of its error file when rank 0 is
    SIGKILLed; the agent stops rank 1 (SIGTERM) and then reads its file, empty or truncated."""
    agent = _agent(tmp_path, nproc=2)
    mid_write = tmp_path / "mid-write"
    result = _monitor_until_done(agent, {0: ("-c", KILLED, str(mid_write)),
                                         1: ("-c", WRITER, payload, str(mid_write))})
    assert result.state == WorkerState.FAILED
    assert sorted(result.failures) == [0, 1]
    assert result.failures[0].exitcode == -signal.SIGKILL
    stopped = result.failures[1]
    assert stopped.exitcode == -signal.SIGTERM
    reason = "empty" if not payload else f"{len(payload)} bytes, JSONDecodeError"
    assert stopped.message["message"].startswith(
        f"UnreadableErrorFile: the worker ended (exit code -15) while writing its error file "
        f"{stopped.error_file} ({reason}"), stopped.message
    assert payload in stopped.message["extraInfo"]["py_callstack"]
    # Restartable: the killed rank is the root cause, no expected error, restarts untouched.
    assert root_cause(result.failures)[0] == 0
    assert expected_error(stopped) is None
    assert agent._remaining_restarts == 3
    assert f"dptrain run: rank 1 ended (exit code -15) while writing its error file " \
           f"{stopped.error_file} ({reason}" in capsys.readouterr().err


@pytest.mark.timeout(90)
def test_a_rank_that_leaves_a_truncated_error_file_itself_is_a_restartable_failure(tmp_path):
    """The other read: rank 0 ends by itself with a truncated file (found by the agent's first
    look, rank 1 still running): a failed worker, and rank 1 is stopped and recorded too."""
    agent = _agent(tmp_path, nproc=2)
    result = _monitor_until_done(agent, {0: ("-c", LEAVES_A_FILE, TRUNCATED, "1"),
                                         1: ("-c", SLEEPER)})
    assert result.state == WorkerState.FAILED
    assert result.failures[0].exitcode == 1
    assert "UnreadableErrorFile" in result.failures[0].message["message"]
    assert result.failures[1].exitcode == -signal.SIGTERM
    assert root_cause(result.failures)[0] == 0 and agent._remaining_restarts == 3


def test_a_readable_or_absent_error_file_is_left_alone(tmp_path):
    record = {"message": {"message": "ValueError: x", "extraInfo": {
        "py_callstack": "Traceback ...", "timestamp": "1700000000"}}}
    good = tmp_path / "error.json"
    good.write_text(json.dumps(record))
    assert unreadable_error_file(str(good), 1) is None
    assert replace_unreadable_error_file(str(good), 1) is None
    assert json.loads(good.read_text()) == record
    assert replace_unreadable_error_file(str(tmp_path / "none.json"), 1) is None
    assert not (tmp_path / "none.json").exists()


@pytest.mark.parametrize("content, reason", [
    ("", "empty"),
    (TRUNCATED, f"{len(TRUNCATED)} bytes, JSONDecodeError"),
    ('{"no message": 1}', "17 bytes, KeyError"),
])
def test_an_unreadable_error_file_becomes_a_record_torch_reads(tmp_path, content, reason):
    path = tmp_path / "error.json"
    path.write_text(content)
    with pytest.raises(Exception):  # torch's reader, as the agent would call it
        ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(path))
    assert replace_unreadable_error_file(str(path), -15).startswith(reason)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(path))
    assert failure.message["message"].startswith("UnreadableErrorFile: ")
    assert failure.timestamp == int(path.stat().st_mtime)
    assert not list(tmp_path.glob("*tmp*"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(90)
def test_an_expected_error_is_not_retried_by_torchs_own_run_loop(tmp_path):
    """The rule rests on torch private names: `LocalElasticAgent._monitor_workers`, which
    torch's run loop calls, and `_remaining_restarts`, which it reads. Run that loop for real
    (agent.run(), a real rendezvous, restarts allowed) with a worker that records an expected
    error: one attempt only. A torch that moves or renames either name fails here."""
    assert "_monitor_workers" in vars(LocalElasticAgent), \
        "torch.distributed.elastic: LocalElasticAgent._monitor_workers moved; " \
        "dptrain.launcher.agent.agent_class hooks it"
    assert agent_class("run") is not LocalElasticAgent
    attempts = tmp_path / "attempts"
    record = json.dumps({"message": "ConfigError: --widget must be positive", "timestamp": 1})
    script = f"open({str(attempts)!r}, 'a').write('x')\n" + LEAVES_A_FILE
    agent = _agent(tmp_path, nproc=1, max_restarts=2, port=_free_port())
    agent._worker_group.spec.args = ("-c", script, record, str(ConfigError.exit_code))
    result = agent.run()
    assert result.state == WorkerState.FAILED
    assert EXPECTED_EXIT_CODES[result.failures[0].exitcode] == "ConfigError"
    assert attempts.read_text() == "x", "an expected error was retried"


@pytest.mark.timeout(90)
def test_the_agent_records_the_end_of_its_job(tmp_path):
    """An elastic job's agents write its end into the run directory (dptrain.launcher.job_end)
    when torch's run loop returns, before the launcher closes the rendezvous: succeeded, or
    the failure's one line. torch's real run loop and rendezvous; rendezvous id "t"."""
    for name, code, expected in [("ok", "0", "every worker finished"),
                                 ("failed", "3", "rank 0 failed (exit code 3)")]:
        record = tmp_path / name / "ended-t.json"
        agent = _agent(tmp_path, nproc=1, max_restarts=0, port=_free_port(), end_record=record)
        agent._worker_group.spec.args = ("-c", f"import sys; sys.exit({code})")
        agent.run()
        ended = job_end.read(record)
        assert (ended.rdzv_id, ended.succeeded, ended.reason) == ("t", code == "0", expected)
    assert "_restart_workers" in dir(LocalElasticAgent), \
        "torch.distributed.elastic: SimpleElasticAgent._restart_workers moved; " \
        "dptrain.launcher.agent.DptrainAgent announces a node's join there"


def test_a_node_that_finds_the_rendezvous_closed_says_why_in_one_line(tmp_path, capsys):
    """A node waiting to join when the job ends finds torch's rendezvous closed: one line,
    the job's end record when it is there (0: the job succeeded), else torch's reason."""
    record = job_end.record_path(tmp_path, "exp 1")
    assert record == tmp_path / "ended-exp-1.json"
    closed = RendezvousClosedError()
    assert rendezvous_failed(closed, "train", "head:29400", record) == 1
    assert capsys.readouterr().err == "dptrain train: the rendezvous at head:29400 is closed: " \
        "its job has ended; nothing to join\n"
    job_end.write(record, rdzv_id="exp 1", succeeded=True, reason="every worker finished")
    assert rendezvous_failed(closed, "train", "head:29400", record) == 0
    line = capsys.readouterr().err
    assert re.fullmatch(r"dptrain train: the elastic job 'exp 1' ended at \d{4}-\d\d-\d\d "
                        r"\d\d:\d\d:\d\d \(succeeded; .*ended-exp-1.json\); nothing to join. A "
                        r"new job in this run directory needs another --rdzv-id\n", line), line
    job_end.write(record, rdzv_id="exp 1", succeeded=False, reason="rank 1 failed (exit code 3)")
    lost = RendezvousConnectionError("The connection to the C10d store has failed.")
    assert rendezvous_failed(lost, "train", "head:29400", record) == 1
    assert "(failed: rank 1 failed (exit code 3); " in capsys.readouterr().err
    record.write_text("{")  # not a record: under c10d its host is lost, and the job with it
    try:
        raise lost from DistNetworkError("Failed to recv, got 0 bytes.\nException raised...")
    except RendezvousConnectionError as raised:
        assert rendezvous_failed(raised, "train", "head:29400", record) == 1
    assert capsys.readouterr().err == (
        "dptrain train: lost the rendezvous host head:29400 (DistNetworkError: Failed to recv, "
        "got 0 bytes.): it served the job's c10d rendezvous, and the job cannot go on without "
        "it; to survive the loss of any node, keep the rendezvous in an etcd cluster with "
        "--rdzv-backend etcd (docs/howto/multi_node.md, The rendezvous in etcd)\n")
    # etcd: what torch said (no member of the cluster answers)
    assert rendezvous_failed(lost, "train", "h1:2379,h2:2379", record, "etcd") == 1
    assert capsys.readouterr().err.startswith(
        "dptrain train: the rendezvous at h1:2379,h2:2379 failed: RendezvousConnectionError: "
        "The connection to the C10d store has failed.")


STORE_SERVER = """
import sys, time
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_the_agent_keeps_quiet_the_store_client_s_cpp_traces(capfd, monkeypatch):
    """A c10d store whose host died: each request the agent's client makes logs a C++ warning
    with its stack trace (several lines a request, several requests when the rendezvous host
    is lost), which the launcher reports in one line instead. The agent runs without them,
    the Python error unchanged; outside it, they are back."""
    for asked_for_logs in ("LOGLEVEL", "TORCH_CPP_LOG_LEVEL"):
        monkeypatch.delenv(asked_for_logs, raising=False)
    with subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdout=subprocess.PIPE,
                          text=True) as server:
        try:
            port = int(server.stdout.readline())
            client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
            client.set("k", "v")
        finally:
            server.kill()
    capfd.readouterr()
    for quiet in (True, False):
        with quiet_cpp_warnings() if quiet else contextlib.nullcontext():
            with pytest.raises(DistNetworkError):
                client.compare_set("k", "v", "w")
        err = capfd.readouterr().err
        assert ("TCPStore.cpp" in err) != quiet, err


@pytest.mark.timeout(60)
def test_a_node_waiting_for_the_rendezvous_host_stops_when_the_job_has_ended(tmp_path, capsys):
    """A node that does not serve the rendezvous waits for the node that does (in Python: no
    C++ retry traces) until it answers, or the job's end record appears (the job ended before
    this node came: it exits at once, 0 as the job succeeded), or the timeout (one line)."""
    record = job_end.record_path(tmp_path, "j")
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        endpoint = f"127.0.0.1:{unused.getsockname()[1]}"
        started = time.monotonic()
        assert wait_for_host("train", endpoint, 1, record) == 1
        assert 1 <= time.monotonic() - started < 10
        assert capsys.readouterr().err.startswith(
            f"dptrain train: nothing answered at {endpoint} ([Errno 111] Connection refused) "
            f"within 1 s: is the node it names up?")
        writer = threading.Timer(0.5, job_end.write, args=(record,), kwargs=dict(
            rdzv_id="j", succeeded=True, reason="every worker finished"))
        writer.start()
        started = time.monotonic()
        assert wait_for_host("train", endpoint, 30, record) == 0
        assert time.monotonic() - started < 5
        writer.join()
        assert "the elastic job 'j' ended at " in capsys.readouterr().err
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        endpoint = f"127.0.0.1:{server.getsockname()[1]}"
        assert wait_for_host("train", endpoint, 30, record) is None
