"""What `dptrain run` starts on every process: the user's script under torch's `@record`.

`@record` writes a raising script's traceback to the file the elastic agent reads, so the job's
failure report names the rank *and* shows its error.
"""

from __future__ import annotations

import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
