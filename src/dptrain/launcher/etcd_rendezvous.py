"""`--rdzv-backend etcd`: torch's dynamic rendezvous with its state and its store in an etcd
cluster (its v2 API, through the python-etcd client), so that no node of the job is the one
every other node needs: any member of the cluster may be down, and so may any node.

torch ships the parts as its "etcd-v2" backend (torch/distributed/elastic/rendezvous/
etcd_rendezvous_backend.py); dptrain builds its own handler from them, registered as
`ETCD_HANDLER`, because torch's

- gives its client one host: here the client gets every member, so a job starts while a
  member is down and its requests move to another member when the one they used fails;
- puts the store keys of every job in one directory, /torch/elastic/store, that nothing
  removes and that every wait reads whole: here each job has a directory of its own,
  `/dptrain/jobs/<run id>/`, holding torch's state (`rendezvous`), the agents' store
  (`store/`) and one key per running agent (`agents/`);
- leaves a finished job's keys behind: here the directory and each agent's key have a TTL
  that the agents renew while they run (`JobKeys`); the last agent to leave a finished job
  removes the directory, and the keys of a job whose agents were all killed expire.

torch's older "etcd" backend (etcd_rendezvous.py) runs a protocol of its own; the dynamic
handler used here is the one dptrain runs with c10d: the same rounds, heartbeats, wait list
and closing, only the state lives elsewhere.

    check_cluster("h1:2379,h2:2379,h3:2379", {})   # one line (ConfigError) if it cannot serve
    register()                                      # torchrun's --rdzv-backend=dptrain-etcd
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import socket
import sys
import threading
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from torch.distributed.elastic.rendezvous import (RendezvousConnectionError, RendezvousHandler,
                                                  RendezvousParameters,
                                                  rendezvous_handler_registry)
from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend
from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

from dptrain.errors import ConfigError
from dptrain.runtime.launch import etcd_members

ETCD_HANDLER = "dptrain-etcd"
"""The torchrun rendezvous backend `--rdzv-backend etcd` registers (`register`)."""

INSTALL_HINT = ("--rdzv-backend etcd needs the etcd client python-etcd: pip install "
                "'dptrain[etcd]' (and an etcd cluster with its v2 API: etcd >= 3.4 started "
                "with --enable-v2; Debian: apt-get install etcd-server)")
JOBS = "/dptrain/jobs"
"""The etcd directory under which each job has its own, named by its run id."""
KEYS_TTL_S = 600
"""How long a job's keys outlive its last agent when no agent removed them (all killed), and
how long the cluster may be out of reach of every agent before the job's keys go."""
RENEW_EVERY_S = 30.0
"""How often each agent renews the TTLs (well inside KEYS_TTL_S)."""
REQUEST_TIMEOUT_S = 5
"""How long one request to a member may take before the client moves to another member: one
that hangs rather than refuses, or one whose write waits on a leader that died (etcd's own
request timeout is 7 s or more). A write takes milliseconds otherwise; torch's read_timeout
(dptrain's --timeout) would leave the job waiting minutes on one member. The store's waits
have timeouts of their own."""


def import_client() -> Any:
    """python-etcd, or the one line that says what to install."""
    try:
        import etcd
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    if "LOGLEVEL" not in os.environ:
        # It logs every failed request at ERROR, several lines for each member that is down;
        # a failure that matters is dptrain's one line (as for torch's elastic loggers).
        logging.getLogger("etcd").setLevel(logging.CRITICAL)
    return etcd


def job_directory(run_id: str) -> str:
    """The job's etcd directory; the run id quoted whole, so that no id names a directory
    inside another's (`a/b`) and two ids never share one."""
    return f"{JOBS}/{quote(run_id, safe='')}"


def make_client(endpoint: str, settings: Mapping[str, Any],
                timeout_s: float = REQUEST_TIMEOUT_S) -> Any:
    """A python-etcd client of every member in `endpoint` (`HOST:PORT,...`); `settings`: the
    rendezvous settings, of which protocol, ca_cert, ssl_cert and ssl_cert_key (torch's
    etcd-v2 names) are the client's TLS. Certificates without a protocol mean https."""
    etcd = import_client()
    cert, key = settings.get("ssl_cert"), settings.get("ssl_cert_key")
    ca_cert = settings.get("ca_cert")
    protocol = settings.get("protocol") or ("https" if cert or ca_cert else "http")
    # A tuple of members: python-etcd talks to the first and moves on when a request fails
    # (allow_reconnect), learning the cluster's current members as it does.
    return etcd.Client(host=tuple(etcd_members(endpoint)), protocol=protocol,
                       cert=(cert, key) if cert and key else cert, ca_cert=ca_cert,
                       read_timeout=timeout_s, allow_reconnect=True)


def check_cluster(endpoint: str, settings: Mapping[str, Any]) -> None:
    """Raise ConfigError, one line, when the cluster at `endpoint` cannot hold a rendezvous:
    no client installed, no member answering, or no v2 API."""
    etcd = import_client()
    try:
        client = make_client(endpoint, settings)
        client.read(JOBS)
    except etcd.EtcdKeyNotFound:
        return  # answers, v2 API and all: no job has used it yet
    except etcd.EtcdException as err:
        raise ConfigError(f"--rdzv-backend etcd: the etcd cluster at {endpoint} "
                          f"{_why_not(str(err))}") from None


def _why_not(text: str) -> str:
    """What python-etcd's error `text` says about the cluster, for `check_cluster`'s line. A
    member that is not etcd's v2 API answers plain text, which python-etcd reports as a "Bad
    response" with the text as its cause."""
    if "Bad response" in text and "404" in text:
        return "answers, but not on etcd's v2 API: start etcd (>= 3.4) with --enable-v2"
    if "Bad response" in text:
        return f"answers, but not as etcd's v2 API does ({text.strip()})"
    # A member that takes TLS only closes a plain connection without a word: it reads as
    # one that is down.
    return ("has no member that answers: start the cluster first (etcd >= 3.4 with "
            "--enable-v2; Debian: apt-get install etcd-server), or check its TLS settings "
            "(--rdzv-conf protocol=https,cacert=...,cert=...,key=...)")


class JobStore(EtcdStore):
    """torch's etcd store under the job's directory, with the compare_set the agents agree on
    the run label by (dptrain.launcher.agent; torch's store has none), and its keys in URL-safe
    base64."""

    # A key is one etcd path component. Standard base64 writes "/" for a "?" at every third
    # place of a key (a run id may hold one), which would split the key into directories that
    # the store's one-level reads never see, and its waits would run into their timeout.
    def _encode(self, value: str | bytes) -> str:
        return base64.urlsafe_b64encode(_as_bytes(value)).decode()

    def _decode(self, value: str | bytes) -> bytes:
        return base64.urlsafe_b64decode(_as_bytes(value))

    def compare_set(self, key: str | bytes, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        """c10d's semantics: set `desired_value` when the key holds `expected_value`, or is
        absent and `expected_value` empty; return what the key holds then (`expected_value`
        for an absent key and a non-empty one)."""
        import etcd

        path = self.prefix + self._encode(key)
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        while True:
            try:
                node = self.client.read(path)
            except etcd.EtcdKeyNotFound:
                if expected:
                    return expected
                try:
                    self.client.write(path, self._encode(desired), prevExist=False)
                    return desired
                except etcd.EtcdAlreadyExist:
                    continue  # another agent set it first: read what it set
            held = self._decode(node.value)
            if held != expected:
                return held
            try:
                self.client.test_and_set(path, self._encode(desired), node.value)
                return desired
            except etcd.EtcdCompareFailed:
                continue


def _as_bytes(value: str | bytes) -> bytes:
    if not isinstance(value, (str, bytes)):
        raise ValueError(f"a store key or value must be str or bytes, got {type(value)}")
    return value if isinstance(value, bytes) else value.encode()


class JobBackend(EtcdRendezvousBackend):
    """torch's etcd-v2 state, kept at `<job directory>/rendezvous`."""

    def __init__(self, client: Any, job_dir: str) -> None:
        # torch keeps the state at KEY_PREFIX/RUN_ID: the job's directory, and a fixed leaf.
        super().__init__(client, "rendezvous", key_prefix=job_dir, ttl=KEYS_TTL_S)

    @property
    def name(self) -> str:
        return ETCD_HANDLER


class JobKeys:
    """This agent's hold on the job's directory: its own key under `agents/` and the
    directory's TTL, renewed every RENEW_EVERY_S by a daemon thread (which dies with the
    agent: a killed job's keys then expire). `release` removes this agent's key, and the
    directory when no other agent's is left."""

    def __init__(self, client: Any, job_dir: str, ttl_s: int = KEYS_TTL_S,
                 renew_every_s: float = RENEW_EVERY_S) -> None:
        self.client, self.job_dir, self.ttl_s = client, job_dir, ttl_s
        self.renew_every_s = renew_every_s
        self.agent_key = (f"{job_dir}/agents/{socket.gethostname()}-{os.getpid()}-"
                          f"{uuid.uuid4().hex[:8]}")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.renew()
        self._thread = threading.Thread(target=self._keep, daemon=True,
                                        name="dptrain-etcd-keys")
        self._thread.start()

    def renew(self) -> None:
        """The directory's TTL first: a key written under a directory etcd does not have
        creates it without one, which nothing would remove."""
        import etcd

        try:
            self.client.write(self.job_dir, None, dir=True, ttl=self.ttl_s, prevExist=True)
        except etcd.EtcdKeyNotFound:
            with contextlib.suppress(etcd.EtcdAlreadyExist):  # another agent made it
                self.client.write(self.job_dir, None, dir=True, ttl=self.ttl_s,
                                  prevExist=False)
        self.client.write(self.agent_key, "running", ttl=self.ttl_s)

    def _keep(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            with contextlib.suppress(Exception):  # out of reach now: the next turn retries
                self.renew()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def release(self) -> None:
        """Stop renewing and remove this agent's key; the last agent removes the directory.
        Best effort: keys it cannot remove expire."""
        import etcd

        self.stop()
        with contextlib.suppress(etcd.EtcdException):  # expired already, or out of reach
            self.client.delete(self.agent_key)
        with contextlib.suppress(etcd.EtcdException):  # gone already, or out of reach
            agents = self.client.read(f"{self.job_dir}/agents")
            # An empty directory reads as itself (python-etcd): only other keys count.
            if not [node for node in agents.children if node.key != agents.key]:
                self.client.delete(self.job_dir, recursive=True)


class JobHandler(RendezvousHandler):
    """torch's dynamic handler of the job, which also holds the job's keys (`JobKeys`) while
    this agent runs and releases them when torch's launcher shuts the rendezvous down, after
    the agent's exit barrier: the directory goes with the last agent's release, once no other
    agent can still be reading the store. An agent stopped by a signal never gets there: it
    leaves the rendezvous open to a node that restarts, as torch does, and its key expires."""

    def __init__(self, inner: RendezvousHandler, keys: JobKeys, endpoint: str) -> None:
        self._inner, self._keys, self._endpoint = inner, keys, endpoint
        self._out_of_reach = False

    def get_backend(self) -> str:
        return ETCD_HANDLER

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> Any:
        return self._inner.next_rendezvous()

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        """torch's answer; 0 while the cluster is out of reach, said once. torch's agent asks
        it between its looks at the workers and would end the job on the error, though they
        train on without etcd: an outage of the cluster would end every job on it. A node
        waiting to join is seen at the first look that gets through."""
        try:
            waiting = self._inner.num_nodes_waiting()
        except RendezvousConnectionError as err:
            if not self._out_of_reach:
                cause = err.__cause__ or err
                print(f"dptrain: the etcd cluster at {self._endpoint} does not answer "
                      f"({str(cause).splitlines()[0] if str(cause) else type(cause).__name__})"
                      f"; the workers train on", file=sys.stderr, flush=True)
            self._out_of_reach = True
            return 0
        if self._out_of_reach:
            print(f"dptrain: the etcd cluster at {self._endpoint} answers again",
                  file=sys.stderr, flush=True)
        self._out_of_reach = False
        return waiting

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        try:
            return self._inner.shutdown()
        finally:
            self._keys.release()


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler torch's launcher asks the registry for (`--rdzv-backend=ETCD_HANDLER`).
    A cluster out of reach is torch's RendezvousConnectionError, which the launcher reports in
    one line like any rendezvous that failed (`dptrain.launcher.c10d_rendezvous`)."""
    import etcd
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        create_handler as dynamic_handler)

    job_dir = job_directory(params.run_id)
    try:
        client = make_client(params.endpoint, params.config)
        keys = JobKeys(client, job_dir)
        keys.start()
    except etcd.EtcdException as err:
        raise RendezvousConnectionError(f"no member of the etcd cluster answers ({err})"
                                        ) from err
    store = JobStore(client, f"{job_dir}/store")
    return JobHandler(dynamic_handler(store, JobBackend(client, job_dir), params), keys,
                      params.endpoint)


def register() -> None:
    """Make `ETCD_HANDLER` a backend of torch's launcher in this process (again: no-op)."""
    rendezvous_handler_registry.register(ETCD_HANDLER, create_handler)
