"""dptrain's elastic agent: torch's local agent, told about our workers (see `DptrainAgent`),
and installed in torch's launcher for one run (`using_agent`)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from dptrain.launcher import job_end
from dptrain.launcher.error_files import replace_unreadable_error_file
from dptrain.launcher.failures import (expected_error, failure_line, failure_summary,
                                       lost_a_peer, root_cause)
from dptrain.launcher.quiet import quiet_cpp_warnings, quiet_elastic_logs
from dptrain.launcher.round_watch import RoundWatch
from dptrain.runtime.job import ATTEMPT_ENV, RUN_LABEL_ENV, stamp

SURVIVOR_GRACE_S = 5.0
"""How long the agent lets its workers fail by themselves, recording the step at which they
lost a peer, before it stops them: after another of its workers failed, or after another node
restarted the job (a survivor that holds a roll call of the ranks reports within ROLL_CALL_S,
3 s, plus a second)."""

class JobStopped(Exception):
    """This node's agent ends the job on what it learnt from the other nodes (another node
    stopped it, or restarted it past --max-restarts); the message is the one line to print."""


ATTEMPT_KEY = "dptrain/attempt"
"""In a static rendezvous's store: the job's attempt number, the same for every node."""
STOP_KEY = "dptrain/stopped"
"""In a static rendezvous's store: why a node ended the job, for the others to end it too."""
LOOK_EVERY_S = 0.5
"""How often an agent of a static multi-node job looks at the other nodes' news."""


def _ask(call, timeout_s: float = 1.0):
    """`call()`'s result, or None when it raised or gave no answer within `timeout_s`: a store
    whose host vanished without closing its connection blocks a request forever, so the
    request runs in a daemon thread that is abandoned then."""
    answer: list = []

    def run() -> None:
        with contextlib.suppress(Exception):
            answer.append(call())

    thread = threading.Thread(target=run, daemon=True, name="dptrain-store-request")
    thread.start()
    thread.join(timeout_s)
    return answer[0] if answer else None


class DptrainAgent(LocalElasticAgent):
    """torch's local agent, told about our workers: an expected error is not worth a restart (it
    would fail the same way), each restart is announced in one line that names the lost rank and
    the step, an error file a worker left half-written is a failed worker, not a crash of the
    agent; and, with a static rendezvous (--node-rank), that the nodes restart together.

    torch's static rendezvous keeps one store for the whole job and no round numbers: an agent
    restarts its own workers without the other nodes hearing of it, and a node whose workers
    failed once more than another's waited under another attempt's keys until the timeout
    (issue 21). Here every restart moves one attempt number in the store, the same for every
    node (`ATTEMPT_KEY`): a node that restarts adopts it, and a node whose workers still run
    under an older one restarts them to join (it counts as one of its restarts, the job's
    restarts being the attempt number). A node that ends the job (no restart left, or an
    expected error) says why under `STOP_KEY`, and the other nodes end too, with that line,
    instead of waiting for a timeout. Every agent also agrees on one run label (the first
    agent's clock) for the run directory of a job without --out (`RUN_LABEL_ENV`).

    With a dynamic rendezvous (c10d, etcd) the agent also restarts its workers when a node of
    its round is dropped from the rendezvous for missing heartbeats (`_lost_node`): a node cut
    off the network is noticed in seconds, not after the collectives' --timeout."""

    command = "run"
    """The dptrain command whose workers this agent runs (named in its lines)."""
    end_record: str | None = None
    """An elastic job's end record in its run directory (`dptrain.launcher.job_end`), else None."""
    started = 0.0
    """When the launcher started (the run label a node offers)."""
    _first_failure_at: float | None = None
    _attempt: int | None = None
    """The job's attempt (static rendezvous only; None otherwise)."""
    _label: str | None = None
    _next_look = 0.0
    _newer: tuple[int, float] | None = None
    """(attempt, when seen) of another node's restart, while this node's workers run."""
    _round: RoundWatch | None = None
    """The nodes of this agent's round of a dynamic rendezvous (see `_lost_node`)."""

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """torch's run; for an elastic job its end is recorded before torch's launcher closes
        the rendezvous, so that a node that finds it closed (or gone) finds why."""
        try:
            result = super().run(role)
        except JobStopped as err:
            self._record_end(succeeded=False, reason=str(err))
            raise
        if result is not None:  # None: torch's graceful exit, this node was never needed
            self._record_end(succeeded=not result.is_failed(), reason=(
                failure_line(result.failures) if result.is_failed() else
                "every worker finished"))
        return result

    def _record_end(self, *, succeeded: bool, reason: str) -> None:
        if self.end_record:
            rdzv_id = self._worker_group.spec.rdzv_handler.get_run_id()
            job_end.write(Path(self.end_record), rdzv_id=rdzv_id, succeeded=succeeded,
                          reason=reason)

    def _restart_workers(self, worker_group) -> None:
        if worker_group.state == WorkerState.HEALTHY:  # torch restarts healthy workers only
            # when nodes wait to join (its run loop; not counted against --max-restarts)
            print(f"dptrain {self.command}: node(s) waiting to join the job; restarting every "
                  f"worker to take them in (not counted as a restart)", file=sys.stderr,
                  flush=True)
        super()._restart_workers(worker_group)

    def _monitor_workers(self, worker_group):
        if self._survivors_reporting():
            return RunResult(state=WorkerState.HEALTHY)
        result = self._monitor_despite_unreadable_error_files(worker_group)
        if self._peers_left_to_take_a_node_in(result):
            return RunResult(state=WorkerState.HEALTHY)  # torch's run loop takes them in
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
            rank, failure = root_cause(result.failures)
            if expected_error(failure) is not None:
                self._remaining_restarts = 0
                self._tell_the_other_nodes(f"rank {rank}: {expected_error(failure)}")
            elif self._remaining_restarts > 0:
                print(f"dptrain {self.command}: {failure_summary(result.failures)}; restarting "
                      f"every worker ({self._remaining_restarts} restart(s) left)",
                      file=sys.stderr, flush=True)
            else:
                self._tell_the_other_nodes(f"{failure_summary(result.failures)} with no "
                                           f"restart left")
        elif result.state == WorkerState.HEALTHY and (self._join_newer_attempt() or
                                                      self._lost_node()):
            return RunResult(state=WorkerState.UNHEALTHY)
        return result

    def _peers_left_to_take_a_node_in(self, result: RunResult) -> bool:
        """True when every failed worker of this node only lost a peer while a node that was
        not in this round waits to join: another node's agent saw the newcomer first and
        restarted its workers to take it in, which is no failure and costs no restart
        (torch's own path, taken here a moment later). A worker that failed by itself, or a
        peer lost while only nodes of this round wait (they left to restart: a real loss),
        still counts."""
        if result.state != WorkerState.FAILED or not result.failures or self._round is None:
            return False
        if not all(map(lost_a_peer, result.failures.values())):
            return False
        try:
            return bool(self._round.newcomers())
        except Exception:  # noqa: BLE001 - a store that no longer answers: a real failure
            return False

    def _lost_node(self) -> bool:
        """Dynamic rendezvous, workers running: True when a node of this round is gone from
        it (`RoundWatch`: dropped after its agent's heartbeats stopped), said in one line; the
        workers are restarted on the nodes left, as after a failed worker, and it counts as a
        restart. Without a restart left the job stops (JobStopped). A node cut off the network
        is noticed here, within seconds; its peers' collectives would wait for --timeout."""
        gone = self._round.gone() if self._round is not None else []
        if not gone:
            return False
        group, nodes = self._worker_group.group_rank, ", ".join(gone)
        why = f"node(s) {nodes} gone from the rendezvous (no heartbeat for " \
              f"{self._round.silence_s:g} s, or restarting)"
        if self._remaining_restarts <= 0:
            raise JobStopped(f"node {group}: {why} and this node has no restart left; stopping")
        print(f"dptrain {self.command}: node {group}: {why}; restarting every worker "
              f"({self._remaining_restarts} restart(s) left)", file=sys.stderr, flush=True)
        return True

    # -- the other nodes of a static rendezvous ---------------------------------------
    def _rendezvous(self, worker_group):
        restarting, self._newer = self._attempt is not None, None
        try:
            super()._rendezvous(worker_group)
            if worker_group.spec.rdzv_handler.get_backend() == "static":
                self._agree_on_the_attempt(worker_group)
            self._agree_on_the_label()
            self._round = RoundWatch(worker_group.spec.rdzv_handler)
        except RuntimeError as err:  # torch's store errors (DistError) among them
            if not restarting:
                raise
            raise JobStopped(f"node {worker_group.group_rank}: cannot restart, the "
                             f"rendezvous store does not answer ({str(err).splitlines()[0]})"
                             f"; the node that served it has probably ended") from err

    def _agree_on_the_attempt(self, worker_group) -> None:
        store, spec = self._store, worker_group.spec
        if self._attempt is None:
            self._attempt = int(store.add(ATTEMPT_KEY, 0))  # 0, unless another node moved
        else:
            self._attempt = int(store.compare_set(ATTEMPT_KEY, str(self._attempt),
                                                  str(self._attempt + 1)))
        if store.check([STOP_KEY]):
            raise JobStopped(store.get(STOP_KEY).decode())
        if self._attempt > spec.max_restarts:
            raise JobStopped(f"node {worker_group.group_rank}: the other nodes restarted "
                             f"the job to attempt {self._attempt}, past --max-restarts "
                             f"{spec.max_restarts}; stopping")
        self._remaining_restarts = spec.max_restarts - self._attempt
        os.environ[ATTEMPT_ENV] = str(self._attempt)

    def _agree_on_the_label(self) -> None:
        """The first agent's start time wins; each offers the label it holds."""
        offered = self._label or stamp(self.started)
        # A dynamic rendezvous hands out a store under the round's prefix: the label goes in
        # the job's store, or a node that joins a later round could win with its own clock.
        store = getattr(self._store, "underlying_store", self._store)
        self._label = store.compare_set("dptrain/run-label", "", offered).decode()
        os.environ[RUN_LABEL_ENV] = self._label

    def _join_newer_attempt(self) -> bool:
        """Static rendezvous, workers running: True when another node restarted the job
        (this node's workers then wait under the old attempt's keys, or are about to
        fail) and, SURVIVOR_GRACE_S later, they still run; raises JobStopped when another
        node stopped the job."""
        if self._attempt is None:
            return False
        if self._newer is None and time.monotonic() >= self._next_look:
            self._next_look = time.monotonic() + LOOK_EVERY_S
            store = self._store
            news = _ask(lambda: (store.get(STOP_KEY).decode() if store.check([STOP_KEY])
                                 else int(store.get(ATTEMPT_KEY))))
            if isinstance(news, str):
                raise JobStopped(news)
            if news is not None and news > self._attempt:  # None: no answer; workers tell
                self._newer = (news, time.monotonic())
        if self._newer is None or time.monotonic() - self._newer[1] < SURVIVOR_GRACE_S:
            return False  # workers that lost a peer fail by themselves, saying where
        group, newer = self._worker_group.group_rank, self._newer[0]
        if self._remaining_restarts <= 0:
            raise JobStopped(f"node {group}: another node restarted the job (attempt "
                             f"{newer}) and this node has no restart left; stopping")
        print(f"dptrain {self.command}: node {group}: another node restarted the job (attempt "
              f"{newer}); restarting this node's workers to join it", file=sys.stderr,
              flush=True)
        return True

    def _tell_the_other_nodes(self, reason: str) -> None:
        if self._attempt is None:
            return
        line = f"node {self._worker_group.group_rank} ended the job: {reason}"
        store = self._store
        _ask(lambda: store.set(STOP_KEY, line))

    def _survivors_reporting(self) -> bool:
        """A worker failed and others still run: give them SURVIVOR_GRACE_S to fail on
        their own, recording the step at which they lost it, before torch's monitor
        stops them (SIGTERM, which records nothing)."""
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        codes = [handler.proc.poll() for handler in handlers.values()]
        if not any(code not in (None, 0) for code in codes) or None not in codes:
            self._first_failure_at = None
            return False
        if self._first_failure_at is None:
            self._first_failure_at = time.monotonic()
        return time.monotonic() - self._first_failure_at < SURVIVOR_GRACE_S

    def _monitor_despite_unreadable_error_files(self, worker_group):
        """torch's monitor reads the error file of every worker that ended. One stopped
        (SIGTERM from the agent: another rank failed first) while writing its own error
        leaves an empty or truncated JSON file, and the reader's JSONDecodeError would
        end the agent, restarts left or not (issue 21). Replace such files and ask again:
        torch's process context keeps the ranks it has not recorded yet, so the repeat
        records them all. Each pass repairs at least one file, or the error is re-raised."""
        while True:
            try:
                return super()._monitor_workers(worker_group)
            except (OSError, ValueError, LookupError, TypeError):  # what reading may raise
                if not self._replace_unreadable_error_files(worker_group):
                    raise

    def _replace_unreadable_error_files(self, worker_group) -> int:
        """Repair the unreadable error files of the workers that ended with a failure (only
        those: a live worker may be writing its file right now). Returns how many."""
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        repaired = 0
        for local_rank, handler in handlers.items():
            exitcode = handler.proc.returncode
            if exitcode in (None, 0):
                continue
            path = self._pcontext.error_files[local_rank]
            reason = replace_unreadable_error_file(path, exitcode)
            if reason is not None:
                repaired += 1
                rank = worker_group.workers[local_rank].global_rank
                print(f"dptrain {self.command}: rank {rank} ended (exit code {exitcode}) while "
                      f"writing its error file {path} ({reason}); counted as a failed "
                      f"worker", file=sys.stderr, flush=True)
        return repaired


def agent_class(command: str, end_record: Path | None = None) -> type:
    """The agent class `launch` hands torch's launcher for `dptrain COMMAND`: `DptrainAgent`,
    or torch's own where torch moved the private hook it overrides (a test fails then)."""
    if not hasattr(LocalElasticAgent, "_monitor_workers"):
        return LocalElasticAgent
    return type("DptrainAgent", (DptrainAgent,), {
        "command": command, "started": time.time(),
        "end_record": str(end_record) if end_record else None})


@contextlib.contextmanager
def using_agent(command: str, end_record: Path | None = None) -> Iterator[None]:
    """Within: torch's launcher (`torch.distributed.run`) runs `agent_class`, and torch's
    elastic loggers and C++ warnings are quiet (the launcher reports a failure once), unless the
    user asked for them (dptrain.launcher.quiet)."""
    import torch.distributed.launcher.api as launcher_api

    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = agent_class(command, end_record)
    try:
        with quiet_elastic_logs(), quiet_cpp_warnings():
            yield
    finally:
        launcher_api.LocalElasticAgent = original
