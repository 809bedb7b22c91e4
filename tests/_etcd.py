"""A real etcd cluster for the tests: one `etcd` process per member, v2 API on, data in a
temporary directory, stopped (SIGKILL: it keeps nothing) whatever the test did.

`loopback_cluster` puts three members on 127.0.0.1-3 with free ports; a test across hosts
builds its `Member`s itself, one per host, each with the command prefix that runs it there
(`tests/_netns.py`'s `Host.cmd`), and the same `EtcdCluster` starts and stops them. The
`etcd_cluster` fixture skips, saying why, where etcd or its Python client is missing (`make
test` installs both: the etcd-server package and the `etcd` extra).

    cluster = loopback_cluster(tmp_path)
    with cluster:                         # started, healthy; stopped on the way out
        cluster.endpoint                  # "127.0.0.1:40011,127.0.0.2:40013,127.0.0.3:40015"
        cluster.kill(0)                   # SIGKILL the first member
        cluster.restart(0)                # and start it again: it rejoins
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

START_S = 30.0
"""How long a cluster may take to elect a leader."""


@dataclass(frozen=True)
class Tls:
    """A test CA and one certificate it signed, for the members (server) and the clients."""

    ca: Path
    cert: Path
    key: Path

    def rdzv_conf(self) -> str:
        """dptrain's --rdzv-conf for it, in etcdctl's spelling."""
        return f"protocol=https,cacert={self.ca},cert={self.cert},key={self.key}"

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.cert), str(self.key))
        return context


def make_tls(root: Path, addresses: list[str]) -> Tls:
    """A CA and a certificate for `addresses` (IP SANs), good as server and as client, made
    with openssl (EC keys: milliseconds)."""
    root.mkdir(parents=True, exist_ok=True)
    ca, cert, key = root / "ca.pem", root / "me.pem", root / "me.key"
    ext = root / "ext.cnf"
    ext.write_text(f"subjectAltName={','.join(f'IP:{a}' for a in addresses)}\n"
                   f"extendedKeyUsage=serverAuth,clientAuth\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for argv in (
        ["req", "-x509", *ec, "-keyout", root / "ca.key", "-out", ca, "-days", "1",
         "-subj", "/CN=dptrain-test-ca"],
        ["req", *ec, "-keyout", key, "-out", root / "me.csr", "-subj", "/CN=dptrain-test"],
        ["x509", "-req", "-in", root / "me.csr", "-CA", ca, "-CAkey", root / "ca.key",
         "-CAcreateserial", "-out", cert, "-days", "1", "-extfile", ext],
    ):
        subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True,
                       timeout=30)
    return Tls(ca, cert, key)


@dataclass
class Member:
    name: str
    address: str
    """Where clients and the other members reach it (it listens there only)."""
    client_port: int
    peer_port: int
    data_dir: Path
    prefix: tuple[str, ...] = ()
    """What runs its command where it lives (`ip netns exec NS`), or nothing: here."""
    tls: Tls | None = None
    """Clients must come over https with a certificate of this CA (peers talk http)."""
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.address}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.address}:{self.peer_port}"

    def argv(self, initial_cluster: str, token: str, v2: bool) -> list[str]:
        return [*self.prefix, shutil.which("etcd") or "etcd", "--name", self.name,
                "--data-dir", str(self.data_dir), "--logger", "zap", "--log-level", "warn",
                "--listen-client-urls", self.client_url,
                "--advertise-client-urls", self.client_url,
                "--listen-peer-urls", self.peer_url,
                "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", initial_cluster, "--initial-cluster-token", token,
                "--initial-cluster-state", "new", *(["--enable-v2"] if v2 else []),
                *(["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key),
                   "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]
                  if self.tls else [])]


class EtcdCluster:
    """The members, started together (`start`, or `with`) and stopped together (`stop`)."""

    def __init__(self, members: list[Member], *, v2: bool = True) -> None:
        self.members, self.v2 = members, v2

    @property
    def endpoint(self) -> str:
        """dptrain's --rdzv-endpoint: every member, the first first."""
        return ",".join(f"{m.address}:{m.client_port}" for m in self.members)

    def start(self, timeout_s: float = START_S) -> None:
        self._initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        self._token = f"dptrain-test-{uuid.uuid4().hex[:8]}"  # a cluster never meets another's
        for m in self.members:
            m.data_dir.mkdir(parents=True, exist_ok=True)
            self._launch(m, "w")
        self._wait_until_healthy(self.members, timeout_s)

    def _launch(self, m: Member, log_mode: str) -> None:
        with open(m.data_dir.parent / f"{m.name}.log", log_mode) as log:
            m.proc = subprocess.Popen(m.argv(self._initial, self._token, self.v2), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_until_healthy(self, members: list[Member], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(self._healthy(m) for m in members):
            dead = [m.name for m in members if m.proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                why = f"{', '.join(dead)} exited" if dead else f"no leader after {timeout_s}s"
                raise RuntimeError(f"etcd cluster did not start: {why}\n{self.logs()}")
            time.sleep(0.1)

    def restart(self, index: int, timeout_s: float = START_S) -> None:
        """Start a member that was killed again, on its data directory: it rejoins the
        cluster as the member it was (etcd finds its membership there and ignores the
        initial-cluster flags), and catches up from the leader."""
        m = self.members[index]
        assert m.proc is not None and m.proc.poll() is not None, f"{m.name} still runs"
        self._launch(m, "a")
        self._wait_until_healthy([m], timeout_s)

    @staticmethod
    def _healthy(m: Member) -> bool:
        if m.prefix:  # where it lives (another network namespace): ask from there
            probe = subprocess.run([*m.prefix, sys.executable, "-c", HEALTH, m.client_url],
                                   capture_output=True, text=True, timeout=10)
            return probe.returncode == 0
        return _health(m.client_url, m.tls.context() if m.tls else None)

    def kill(self, index: int) -> None:
        """SIGKILL one member (no goodbye to the others)."""
        proc = self.members[index].proc
        proc.kill()
        proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGKILL: a test cluster keeps nothing, and a leader that gets SIGTERM first tries
        to hand its leadership to members that are stopping too, which takes seconds."""
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(m.proc.pid, signal.SIGKILL)
        for m in self.members:
            if m.proc is not None:
                m.proc.wait(timeout=10)

    def client(self) -> Any:
        """A python-etcd client of every member still running."""
        import etcd

        live = tuple((m.address, m.client_port) for m in self.members
                     if m.proc is not None and m.proc.poll() is None)
        tls = self.members[0].tls
        if tls is None:
            return etcd.Client(host=live, allow_reconnect=True, read_timeout=5)
        return etcd.Client(host=live, allow_reconnect=True, read_timeout=5, protocol="https",
                           ca_cert=str(tls.ca), cert=(str(tls.cert), str(tls.key)))

    def logs(self) -> str:
        logs = [(m.name, m.data_dir.parent / f"{m.name}.log") for m in self.members]
        return "\n".join(f"--- {name}\n{log.read_text()[-2000:]}" for name, log in logs
                         if log.exists())

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _health(url: str, context: ssl.SSLContext | None = None) -> bool:
    """Whether the member at `url` says the cluster is healthy (it has a leader)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1, context=context) as answer:
            return json.loads(answer.read()).get("health") == "true"
    except (OSError, ValueError):
        return False


HEALTH = ("import json, sys, urllib.request\n"
          "answer = urllib.request.urlopen(sys.argv[1] + '/health', timeout=1)\n"
          "sys.exit(0 if json.loads(answer.read()).get('health') == 'true' else 1)\n")
"""`_health` as a program, for a member in another namespace."""


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def loopback_cluster(root: Path, size: int = 3, *, v2: bool = True,
                     tls: Tls | None = None) -> EtcdCluster:
    """`size` members on 127.0.0.1, 127.0.0.2, ... (all the loopback's), on free ports."""
    members = []
    for i in range(size):
        address = f"127.0.0.{i + 1}"
        members.append(Member(f"m{i}", address, _free_port(address), _free_port(address),
                              root / f"m{i}", tls=tls))
    return EtcdCluster(members, v2=v2)


def unavailable_reason() -> str | None:
    if shutil.which("etcd") is None:
        return "etcd not installed (`make system-deps` installs it: Debian's etcd-server)"
    try:
        import etcd  # noqa: F401
    except ImportError:
        return "python-etcd not installed (`make setup` installs the etcd extra)"
    return None


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """Three members on the loopback, started; stopped after the test."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"etcd tests skipped: {reason}")
    # A port taken between choosing it and etcd binding it fails the start: choose again.
    for attempt in range(3):
        cluster = loopback_cluster(tmp_path / f"etcd-{attempt}")
        try:
            cluster.start()
            break
        except RuntimeError:
            if attempt == 2:
                raise
    try:
        yield cluster
    finally:
        cluster.stop()
