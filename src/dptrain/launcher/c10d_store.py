"""The store of a c10d rendezvous: served by the agent the endpoint's machine starts first, and
joined by every other agent, another agent on that same machine included. torchrun runs it as
`--rdzv-backend=dptrain-c10d` (`with_handler`): torch's dynamic rendezvous on that store.

dptrain tells the agents on the endpoint's machine to serve (`is_host=1`,
dptrain.launcher.rendezvous): torch's own guess misses that machine when its host name resolves
to the loopback. Told so, torch's handler fails where the port is taken, a second agent of the
job on that machine among them, where its guess would have made that agent a client of the
store already there. Here an agent told to serve whose port is in use joins the store that
holds it, as torch's guess does (`open_store`); a port held by something that is not a c10d
store is one line naming it (ConfigError), and a store never reached is `StoreUnreachable`,
never the loss of a host that served it.

    with_handler(["--nnodes=1:2", "--rdzv-backend=c10d", ...])  # registers dptrain-c10d
"""

from __future__ import annotations

import math
import os
import socket
import struct
import subprocess
import sys
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (RendezvousConnectionError,
                                                  RendezvousParameters,
                                                  rendezvous_handler_registry)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (DEFAULT_PORT,
                                                                          C10dRendezvousBackend)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler, create_handler as dynamic_handler)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from dptrain.errors import ConfigError
from dptrain.launcher.quiet import CPP_FATAL_LEVEL, quiet_cpp_warnings
from dptrain.runtime.netif import is_this_machine

C10D_HANDLER = "dptrain-c10d"
"""The torchrun rendezvous backend `with_handler` registers for `--rdzv-backend=c10d`."""

JOIN_TIMEOUT_S = 5.0
"""How long a c10d store has to answer a client's greeting (it answers in milliseconds):
whatever holds the port and has said nothing by then is something else."""

READ_TIMEOUT_S = 60
"""torch's default read_timeout, the store's timeout for its operations."""


class StoreUnreachable(RendezvousConnectionError):
    """The store of a c10d rendezvous could be neither served here nor reached: nothing that
    was there is lost (dptrain.launcher.c10d_rendezvous says so in one line)."""


class _Backend(C10dRendezvousBackend):
    """torch's c10d rendezvous state, under `C10D_HANDLER`'s name (torch's registry checks that
    a handler's backend is the one asked for)."""

    @property
    def name(self) -> str:
        return C10D_HANDLER


def create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """torch's dynamic rendezvous handler on the store `open_store` serves or joins."""
    store = open_store(params)
    return dynamic_handler(store, _Backend(store, params.run_id), params)


def with_handler(argv: list[str]) -> list[str]:
    """torchrun's `argv` with a dynamic c10d rendezvous run by `create_handler`, registered as
    a backend of torch's launcher in this process (again: no-op)."""
    if "--rdzv-backend=c10d" not in argv:
        return argv
    rendezvous_handler_registry.register(C10D_HANDLER, create_handler)
    return [f"--rdzv-backend={C10D_HANDLER}" if arg == "--rdzv-backend=c10d" else arg
            for arg in argv]


def open_store(params: RendezvousParameters) -> TCPStore:
    """The rendezvous store at the endpoint: served here when `is_host` says so (when not given,
    when the endpoint names this machine) and its port is free; else a client of the one that
    holds the port, which another agent of the job on this machine serves (`join_store`)."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    read_timeout = params.get_as_int("read_timeout", READ_TIMEOUT_S)
    if read_timeout <= 0:
        raise ConfigError(f"rdzv-conf: read_timeout must be >= 1, got {read_timeout}")
    is_host = params.get_as_bool("is_host")
    if is_host is None:
        is_host = is_this_machine(host)
    if is_host:
        try:
            return TCPStore(host, port, is_master=True, multi_tenant=True,
                            timeout=timedelta(seconds=read_timeout))
        except (ValueError, RuntimeError, TimeoutError) as err:
            if "EADDRINUSE" not in str(err) and "address already in use" not in str(err):
                raise StoreUnreachable(f"could not serve the c10d rendezvous at "
                                       f"{host}:{port}") from err
        # The port is in use on this machine: another agent of the job serves the store.
    return join_store(host, port, read_timeout, taken=is_host)


def join_store(host: str, port: int, read_timeout: int, *, taken: bool) -> TCPStore:
    """A client of the c10d store at host:port, its operations' timeout `read_timeout`.

    Whatever holds the port and does not answer as a c10d store is a ConfigError naming the
    port: a listener that does not answer a store client's greeting as one (`_greet`) and
    that torch's own client cannot join either (`_torch_joins`: it would wait for a silent
    listener's answer forever), or (`taken`: the port is in use on this machine) nothing that
    listens. A store that never answers, on another machine, is `StoreUnreachable`."""
    answer = _greet(host, port)
    if (answer == "unreachable" and taken) or (answer in ("silent", "other") and
                                               not _torch_joins(host, port)):
        raise ConfigError(
            f"--rdzv-endpoint {host}:{port}: port {port} is held by something that is not a "
            f"c10d rendezvous store (it does not answer as one); free the port or give every "
            f"node another one")
    try:
        with quiet_cpp_warnings(CPP_FATAL_LEVEL):  # its failure is the one line below
            return TCPStore(host, port, is_master=False, multi_tenant=True,
                            timeout=timedelta(seconds=read_timeout))
    except (ValueError, RuntimeError, TimeoutError) as err:
        raise StoreUnreachable(f"could not reach the c10d rendezvous at {host}:{port}") from err


STORE_GREETING = (0, 0x3C85F7CE, 13)
"""What torch's store client says first (torch/csrc/distributed/c10d/TCPStoreBackend.hpp): its
query VALIDATE with the magic number, then PING with a number the store sends back."""


def _greet(host: str, port: int) -> str:
    """How the listener at host:port answers a store client's greeting: "store" (as a c10d
    store), "other" (otherwise, or it closed the connection), "silent" (it said nothing within
    JOIN_TIMEOUT_S) or "unreachable" (no connection)."""
    validate, magic, ping = STORE_GREETING
    nonce = os.getpid() & 0xFFFFFFFF
    try:
        conn = socket.create_connection((host, port), timeout=JOIN_TIMEOUT_S)
    except OSError:
        return "unreachable"
    reply = b""
    with conn:
        try:
            conn.sendall(struct.pack("=BIBI", validate, magic, ping, nonce))
            while len(reply) < 4:
                chunk = conn.recv(4 - len(reply))
                if not chunk:
                    break
                reply += chunk
        except TimeoutError:
            return "silent" if not reply else "other"
        except OSError:
            return "other"
    return "store" if reply == struct.pack("=I", nonce) else "other"


JOINS = """
import signal, sys
from datetime import timedelta
from torch.distributed import TCPStore
host, port, timeout_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
signal.alarm(timeout_s + 2)  # a listener that never answers: torch's client would wait on
TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
"""
"""`_torch_joins`'s process: exits 0 when torch's client joins the store at argv[1]:argv[2]."""


def _torch_joins(host: str, port: int) -> bool:
    """Whether torch's own client joins the listener at host:port, which did not answer the
    greeting as a store (a store of a torch whose client greets otherwise would): in a process
    of its own, which cannot hold this agent when the listener never answers, and whose C++
    errors stay there."""
    try:
        return subprocess.run(
            [sys.executable, "-c", JOINS, host, str(port), str(math.ceil(JOIN_TIMEOUT_S))],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            timeout=JOIN_TIMEOUT_S + 60, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False
