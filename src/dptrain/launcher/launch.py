"""`launch`: torch's elastic agent (torchrun's launcher, `torch.distributed.run`) run in this
process with dptrain's agent class, and its outcome as an exit status with one line: the job's
success, an expected error of a worker, the rank that failed first, a rendezvous that closed or
failed, a node that ended the job, or a signal. `dptrain run` and `dptrain train` both start
their workers through it."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.run import get_args_parser, run

from dptrain.launcher import c10d_store, etcd_rendezvous
from dptrain.launcher.agent import JobStopped, using_agent
from dptrain.launcher.c10d_rendezvous import STORE_TIMEOUT_S, rendezvous_failed, wait_for_host
from dptrain.launcher.failures import job_failure
from dptrain.launcher.rendezvous import network_options
from dptrain.launcher.worker_env import worker_environment


def launch(argv: list[str], nproc: int, command: str = "run", *,
           rdzv_endpoint: str | None = None, max_nodes: int = 1,
           rdzv_conf: dict[str, str] | None = None, end_record: Path | None = None,
           rdzv_backend: str = "c10d") -> int:
    """Run torchrun's agent with `argv` in this process. Returns 0; an expected error's own
    status with its one line; 1 naming the failed rank; or 128 + N after signal N (SIGTERM,
    Ctrl-C), the agent having stopped the workers. `end_record`: where an elastic job's agents
    record its end (`dptrain.launcher.job_end`) and where a node that finds the rendezvous
    closed or gone reads why. With `rdzv_backend` etcd, an etcd cluster that cannot serve the
    job (no client installed, no member answering, no v2 API) is a ConfigError before anything
    starts."""
    if rdzv_backend == "etcd":
        etcd_rendezvous.check_cluster(rdzv_endpoint or "", rdzv_conf or {})
        etcd_rendezvous.register()
    worker_environment(nproc, max_nodes)
    argv, conf = _with_node_options(argv, rdzv_endpoint, max_nodes, rdzv_conf, rdzv_backend)
    if conf.get("is_host") == "0" and "--rdzv-backend=c10d" in argv:
        status = wait_for_host(command, rdzv_endpoint or "",
                               int(conf.get("read_timeout", STORE_TIMEOUT_S)), end_record)
        if status is not None:
            return status
    # A c10d store whose port is taken on this machine is joined (another agent of the job
    # there serves it), not the end of this node (dptrain.launcher.c10d_store).
    return _run_agent(c10d_store.with_handler(argv), command, end_record, rdzv_endpoint,
                      rdzv_backend)


def _with_node_options(argv: list[str], rdzv_endpoint: str | None, max_nodes: int,
                       rdzv_conf: dict[str, str] | None, backend: str
                       ) -> tuple[list[str], dict[str, str]]:
    """`argv` behind this node's torchrun options (its address, the rendezvous settings: this
    node's own, then `rdzv_conf`), and those settings."""
    extra, conf = network_options(rdzv_endpoint, max_nodes, backend)
    conf.update(rdzv_conf or {})
    if conf:
        extra.append(f"--rdzv-conf={','.join(f'{k}={v}' for k, v in conf.items())}")
    return [*extra, *argv], conf


def _run_agent(argv: list[str], command: str, end_record: Path | None,
               rdzv_endpoint: str | None, rdzv_backend: str) -> int:
    """torchrun's launcher on `argv` with dptrain's agent; its outcome as `launch` says."""
    try:
        with using_agent(command, end_record):
            run(get_args_parser().parse_args(argv))
    except RendezvousError as err:
        return rendezvous_failed(err, command, rdzv_endpoint, end_record, rdzv_backend)
    except ChildFailedError as err:
        line, status = job_failure(err.failures)
        print(f"dptrain {command}: {line}", file=sys.stderr)
        return status
    except JobStopped as err:
        print(f"dptrain {command}: {err}", file=sys.stderr)
        return 1
    except SignalException as err:
        signum = int(err.sigval)
        print(f"dptrain {command}: stopped by {signal.Signals(signum).name}; the workers were "
              f"stopped too", file=sys.stderr)
        return 128 + signum
    return 0
