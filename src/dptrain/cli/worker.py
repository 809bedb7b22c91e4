"""What `dptrain run` starts on every process: the user's script under torch's `@record`.

`@record` writes a raising script's traceback to the file the elastic agent reads, so the job's
failure report names the rank *and* shows its error.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record


def exit_without_teardown(code: int = 0) -> None:
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


@record
def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
