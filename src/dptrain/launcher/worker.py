"""What `dptrain run` and `dptrain train` start on every process, under torch's `@record`.

`@record` writes a raising script's traceback to the file the elastic agent reads, so the job's
failure report names the rank *and* shows its error. An expected error (`DptrainError` other
than `RankFailure`: a bad option, dataset or checkpoint) is recorded without a traceback and
ends the process with the error's own exit status, so the launcher prints it once, as one line.
A `RankFailure` (this rank lost a peer: it follows from another rank's failure) is recorded
with the step and the missing ranks and nothing is printed: the launcher names the lost rank
and the step in one line for the whole job (dptrain.launcher.launch). Under other launchers
each of these is one line on stderr.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from dptrain.errors import DptrainError, RankFailure
from dptrain.launcher.worker_env import LAUNCHER_REPORTS


def exit_without_teardown(code: int = 0) -> NoReturn:
    """Run the atexit handlers, flush, and leave before C++ static destructors run.

    With torch 2.13 a finished 2-rank gloo job that used DistributedDataParallel aborts in
    interpreter teardown ("terminate called without an active exception", SIGABRT) in roughly
    one run in ten here, with plain torchrun too; the agent then reports a job whose work all
    succeeded as failed. Nothing is left to do at that point, so skip that teardown.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_expected(err: BaseException) -> bool:
    """An error dptrain raised on purpose about the user's input: one line, no traceback, not
    retried. `RankFailure` is not one: it follows from another rank's failure, and a restart
    may well succeed (it is recorded for the launcher's line instead: exit_with_rank_failure)."""
    return isinstance(err, DptrainError) and not isinstance(err, RankFailure)


def exit_with_expected_error(err: DptrainError, command: str) -> NoReturn:
    """Record `err` for the launcher (or print it, when no dptrain launcher reads the record)
    and leave with its exit status."""
    if os.environ.get(LAUNCHER_REPORTS) and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        ErrorHandler().record_exception(err)
    else:
        rank = os.environ.get("RANK", "?")
        print(f"dptrain {command}: error: rank {rank}: {err}", file=sys.stderr)
    exit_without_teardown(err.exit_code)


def rank_failure_record(err: RankFailure) -> dict:
    """`err` in the format of torch's error files, the traceback kept, plus what the
    launcher's one line needs (`extraInfo.dptrain`: the step, the missing ranks)."""
    return {"message": {"message": f"{type(err).__name__}: {err}", "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(err)),
        "timestamp": str(int(time.time())),
        "dptrain": {"step": err.step, "missing": err.missing}}}}


def exit_with_rank_failure(err: RankFailure, command: str) -> NoReturn:
    """Record a lost peer for the launcher without a word on stderr (each survivor would
    print the same traceback), or print one line where no dptrain launcher reads records;
    leave with RankFailure's status."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if os.environ.get(LAUNCHER_REPORTS) and path:
        # Atomically: a record half-written when the agent stops this rank is unreadable.
        with open(f"{path}.tmp", "w") as fp:
            json.dump(rank_failure_record(err), fp)
        os.replace(f"{path}.tmp", path)
    else:
        rank = os.environ.get("RANK", "?")
        at = "" if err.step is None else f" at step {err.step}"
        print(f"dptrain {command}: error: rank {rank}{at}: {str(err).splitlines()[0]}",
              file=sys.stderr)
    exit_without_teardown(err.exit_code)


def exit_interrupted() -> NoReturn:
    """Ctrl-C, or the agent passing on its SIGINT to stop the job: the launcher says so once,
    so leave without a traceback, with the shell's status for SIGINT."""
    exit_without_teardown(128 + signal.SIGINT)


def run_as_worker(body: Callable[[], object], command: str) -> NoReturn:
    """Run `body` as one launched process of `dptrain COMMAND`: a raising body's traceback is
    recorded for the agent (`@record`), an expected error is one line, Ctrl-C is quiet, and a
    finished process leaves without the teardown that can abort it."""
    record(_run_expecting)(body, command)
    exit_without_teardown(0)  # see there: torch can abort a finished worker in teardown


def _run_expecting(body: Callable[[], object], command: str) -> None:
    try:
        body()
    except RankFailure as err:
        exit_with_rank_failure(err, command)
    except DptrainError as err:
        if not is_expected(err):
            raise
        exit_with_expected_error(err, command)
    except KeyboardInterrupt:
        exit_interrupted()


def run_script(script: str) -> None:
    """The user's script as `__main__`, importing from its own folder; exit 0 is success."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    run_as_worker(lambda: run_script(script), "run")


if __name__ == "__main__":
    main()
