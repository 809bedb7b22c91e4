"""The end of an elastic job, recorded in its run directory.

torch's c10d rendezvous marks a finished job's rendezvous closed, in a store that lives in the
agent of the node the endpoint names; once that agent exits, a node that comes later (say, a
lost node brought back after the others finished) finds nothing at the endpoint, which looks
like a job whose first node is not up yet, and waits out its timeout. So the agents also write
the end into the run directory, which the nodes of an elastic job share, before torch closes
the rendezvous: a node that comes later reads it and exits at once, with the line below. A
rendezvous id names one job (torch keeps a closed rendezvous closed): a new job in the same
run directory takes another `--rdzv-id`.

    path = record_path("runs/exp1", "exp1")
    write(path, succeeded=True, reason="every worker finished")
    read(path).line(path)   # "the elastic job 'exp1' ... ended at ... (succeeded) ..."
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def record_path(out: Path | str, rdzv_id: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", rdzv_id).strip("-.") or "job"
    return Path(out) / f"ended-{safe}.json"


@dataclass(frozen=True)
class JobEnd:
    rdzv_id: str
    succeeded: bool
    reason: str
    """Why it ended: "every worker finished", or the failure's one line."""
    at: str
    """Local time of the end, `YYYY-mm-dd HH:MM:SS`."""

    def line(self, path: Path) -> str:
        """What a node that comes after the end says (`path`: where it read this)."""
        how = "succeeded" if self.succeeded else f"failed: {self.reason}"
        return (f"the elastic job {self.rdzv_id!r} ended at {self.at} ({how}; {path}); nothing "
                f"to join. A new job in this run directory needs another --rdzv-id")


def write(path: Path, *, rdzv_id: str, succeeded: bool, reason: str) -> None:
    """Atomically: a reader sees the whole record or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"rdzv_id": rdzv_id, "succeeded": succeeded, "reason": reason,
              "at": time.strftime("%Y-%m-%d %H:%M:%S")}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def read(path: Path) -> JobEnd | None:
    """The record at `path`, or None when there is none (or it does not read as one)."""
    try:
        record = json.loads(path.read_text())
        return JobEnd(str(record["rdzv_id"]), bool(record["succeeded"]), str(record["reason"]),
                      str(record["at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def report(command: str, path: Path | None) -> int | None:
    """If the job at `path` has ended: print its line for `dptrain COMMAND` and return the exit
    status of a node that came too late (0: the job succeeded, 1: it failed). Else None."""
    ended = read(path) if path is not None else None
    if ended is None:
        return None
    print(f"dptrain {command}: {ended.line(path)}", file=sys.stderr)
    return 0 if ended.succeeded else 1
