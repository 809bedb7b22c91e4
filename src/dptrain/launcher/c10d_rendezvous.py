"""A node and a dynamic rendezvous it does not serve: the c10d rendezvous lives in the agent of
the node the endpoint names, and the other nodes depend on it. Such a node waits for that host
to answer before torch's client dials it (`wait_for_host`: the C++ client would print a stack
trace at every retry), and a rendezvous that closed or failed under it (a c10d host lost, or
an etcd cluster's failure) is one line (`rendezvous_failed`), the job's end record first when
the job ended (dptrain.launcher.job_end)."""

from __future__ import annotations

import sys
from pathlib import Path

from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousConnectionError

from dptrain.launcher import job_end
from dptrain.launcher.c10d_store import StoreUnreachable
from dptrain.runtime.netif import wait_for_listener

STORE_TIMEOUT_S = 60
"""torch's default read_timeout of the c10d rendezvous store, its wait for the store's host."""


def wait_for_host(command: str, rdzv_endpoint: str, timeout_s: int,
                  end_record: Path | None) -> int | None:
    """A node that does not serve the dynamic rendezvous first waits, here, for the node that
    does: torch's C++ store client would print a stack trace at every retry. It stops waiting
    when the job's end record appears instead (the job ended before this node came). None when
    the endpoint answers; else the exit status, its one line printed."""
    host, _, port = rdzv_endpoint.rpartition(":")
    try:
        if wait_for_listener(host.strip("[]"), int(port), timeout_s, give_up=lambda: (
                end_record is not None and job_end.read(end_record) is not None)):
            return None
    except TimeoutError as err:
        print(f"dptrain {command}: {err} within {timeout_s} s: is the node it names up? It "
              f"serves the rendezvous", file=sys.stderr)
        return 1
    return job_end.report(command, end_record)


ETCD_DOCS = "docs/howto/multi_node.md, The rendezvous in etcd"
"""Where the docs say how to keep the rendezvous in etcd (named in the lost-host line)."""


def rendezvous_failed(err: Exception, command: str, rdzv_endpoint: str | None,
                      end_record: Path | None, backend: str = "c10d") -> int:
    """One line for a rendezvous that closed or failed under this node (torch's own is a
    traceback): the job's end record when there is one (the job ended: 0 if it succeeded);
    under c10d, a store that no longer answers as the loss of the host the endpoint names,
    with the backend that survives it, and one never reached (`StoreUnreachable`) as such;
    else what torch said. torch's agent has stopped any workers it had started."""
    status = job_end.report(command, end_record)
    if status is not None:
        return status
    if isinstance(err, RendezvousClosedError):
        print(f"dptrain {command}: the rendezvous at {rdzv_endpoint} is closed: its job has "
              f"ended; nothing to join", file=sys.stderr)
        return 1
    cause = err.__cause__  # torch wraps the store's own error, which says more
    because = f" ({type(cause).__name__}: {str(cause).splitlines()[0]})" \
        if cause is not None and str(cause) else ""
    if isinstance(err, StoreUnreachable):  # nothing was lost: it never answered
        print(f"dptrain {command}: {err}{because}", file=sys.stderr)
        return 1
    if backend == "c10d" and isinstance(err, RendezvousConnectionError):
        # The c10d store lives in the agent of the node the endpoint names: with no end
        # record, that node is gone, and every other node's job with it.
        print(f"dptrain {command}: lost the rendezvous host {rdzv_endpoint}{because}: it served "
              f"the job's c10d rendezvous, and the job cannot go on without it; to survive the "
              f"loss of any node, keep the rendezvous in an etcd cluster with --rdzv-backend "
              f"etcd ({ETCD_DOCS})", file=sys.stderr)
        return 1
    print(f"dptrain {command}: the rendezvous at {rdzv_endpoint} failed: "
          f"{type(err).__name__}: {err}{because}", file=sys.stderr)
    return 1
