"""The c10d rendezvous store (`dptrain.launcher.c10d_store`): an agent told to serve it whose
port is already held by a store on this machine (another agent of the job) joins that store;
a port held by something else is one line naming it; a store never reached is not a lost host.
Real stores and sockets on the loopback; the store another agent serves runs in a process of
its own (in one process torch shares a multi-tenant store's server instead of binding again).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from dptrain.errors import ConfigError
from dptrain.launcher import c10d_store
from dptrain.launcher.c10d_rendezvous import rendezvous_failed
from dptrain.launcher.c10d_store import C10D_HANDLER, StoreUnreachable, open_store, with_handler
from tests._listeners import accepts_nothing, answers_http

STORE_SERVER = """
import time
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
store.set("served-by", "the first agent")
print(store.port, flush=True)
time.sleep(120)
"""


def _params(port: int, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(backend=C10D_HANDLER, endpoint=f"127.0.0.1:{port}",
                                run_id="job", min_nodes=1, max_nodes=2, **conf)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dynamic_c10d_rendezvous_runs_under_dptrain_s_handler():
    argv = ["--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=h:1", "--rdzv-id=x"]
    assert with_handler(argv) == ["--nnodes=1:2", f"--rdzv-backend={C10D_HANDLER}",
                                  "--rdzv-endpoint=h:1", "--rdzv-id=x"]
    assert with_handler(with_handler(argv)) == with_handler(argv)  # registered once
    for other in (["--standalone"], ["--rdzv-backend=static", "--node-rank=0"]):
        assert with_handler(other) == other


@pytest.mark.timeout(60)
def test_an_agent_told_to_serve_a_port_its_job_s_store_holds_joins_that_store():
    with subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdout=subprocess.PIPE,
                          text=True) as server:
        try:
            port = int(server.stdout.readline())
            store = open_store(_params(port, is_host="1", read_timeout="7"))
            assert store.get("served-by") == b"the first agent"
            assert store.timeout == timedelta(seconds=7)
            # torch's handler on it: the rendezvous runs under dptrain's backend name
            with_handler(["--rdzv-backend=c10d"])
            handler = rendezvous_handler_registry.create_handler(_params(port, is_host="1"))
            assert handler.get_backend() == C10D_HANDLER
        finally:
            server.kill()


def test_an_agent_told_to_serve_a_free_port_serves_it():
    port = _free_port()
    served = open_store(_params(port, is_host="1"))
    served.set("k", "v")
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    assert client.get("k") == b"v"


@pytest.mark.timeout(60)
def test_a_store_that_greets_otherwise_is_still_joined_through_torch_s_client(monkeypatch):
    """A store of a torch whose client greets it otherwise does not answer this greeting as
    one (it says nothing): torch's own client decides."""
    monkeypatch.setattr(c10d_store, "JOIN_TIMEOUT_S", 1.0)
    validate, magic, ping = c10d_store.STORE_GREETING
    monkeypatch.setattr(c10d_store, "STORE_GREETING", (validate, magic ^ 1, ping))
    with subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdout=subprocess.PIPE,
                          text=True) as server:
        try:
            port = int(server.stdout.readline())
            assert c10d_store._greet("127.0.0.1", port) in ("silent", "other")
            store = open_store(_params(port, is_host="1"))
            assert store.get("served-by") == b"the first agent"
        finally:
            server.kill()


def _bound_only(listener: socket.socket) -> None:
    """Holds the port without listening: connections are refused."""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("listener", "is_host"), [
    (accepts_nothing, "1"), (answers_http, "1"), (_bound_only, "1"),
    (accepts_nothing, "0"),  # on another machine (a port nothing listens on: not up yet)
], ids=["silent", "http", "bound-only", "silent-remote"])
def test_a_port_held_by_a_listener_that_is_no_store_is_a_config_error_naming_it(
        listener, is_host, monkeypatch):
    monkeypatch.setattr(c10d_store, "JOIN_TIMEOUT_S", 1.0)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        if listener is not _bound_only:
            held.listen()
        listener(held)
        port = held.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(ConfigError) as raised:
            open_store(_params(port, is_host=is_host))
        assert time.monotonic() - started < 10
    assert str(raised.value) == (
        f"--rdzv-endpoint 127.0.0.1:{port}: port {port} is held by something that is not a "
        f"c10d rendezvous store (it does not answer as one); free the port or give every node "
        f"another one")
    assert raised.value.exit_code == 2


@pytest.mark.timeout(60)
def test_a_store_never_reached_is_not_the_loss_of_its_host(monkeypatch, capsys):
    monkeypatch.setattr(c10d_store, "JOIN_TIMEOUT_S", 1.0)
    port = _free_port()  # nothing listens
    with pytest.raises(StoreUnreachable) as raised:
        open_store(_params(port, is_host="0", read_timeout="1"))
    assert rendezvous_failed(raised.value, "train", f"127.0.0.1:{port}", None) == 1
    line = capsys.readouterr().err
    assert line.startswith(f"dptrain train: could not reach the c10d rendezvous at "
                           f"127.0.0.1:{port} ("), line
    assert "lost the rendezvous host" not in line and line.count("\n") == 1, line
