"""A worker's error file that torch's agent cannot read, found and replaced.

A rank the agent stops (SIGTERM: another rank failed first) while it is writing its own error
file leaves an empty or truncated JSON file, and torch's reader would end the agent on it,
restarts left or not (issue 21). `replace_unreadable_error_file` turns it into a record in
torch's format that says so (dptrain.launcher.agent calls it on every failed worker's file).
"""

from __future__ import annotations

import json
import os

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure


def unreadable_error_file(path: str, exitcode: int) -> str | None:
    """Why torch's agent cannot read the error file a worker left at `path`, else None (also
    when there is none, which torch handles). Read with torch's own reader, `ProcessFailure`,
    so that "readable" means what the agent will find."""

    if not os.path.isfile(path):
        return None
    try:
        ProcessFailure(local_rank=0, pid=0, exitcode=exitcode, error_file=path)
    except Exception as err:  # whatever torch's reader raises: that is the reason
        size = os.path.getsize(path)
        return "empty" if size == 0 else f"{size} bytes, {type(err).__name__}: {err}"
    return None


def replace_unreadable_error_file(path: str, exitcode: int) -> str | None:
    """If the error file at `path` is unreadable (its worker ended while writing it: a rank
    stopped by the agent in the middle of recording its own error), replace it, atomically, by
    a record in torch's format that says so and keeps the start of what had been written.
    Returns the reason, or None when the file reads (or is absent) and was left alone."""
    reason = unreadable_error_file(path, exitcode)
    if reason is None:
        return None
    with open(path, "rb") as fp:
        partial = fp.read(2000).decode("utf-8", errors="replace")
    text = (f"UnreadableErrorFile: the worker ended (exit code {exitcode}) while writing its "
            f"error file {path} ({reason})")
    record = {"message": {"message": text, "extraInfo": {
        "py_callstack": f"{text}; it had written:\n{partial}" if partial else text,
        # Its last write is when the worker failed: keeps the order failures.root_cause reads.
        "timestamp": str(int(os.path.getmtime(path)))}}}
    tmp = f"{path}.dptrain-tmp"
    with open(tmp, "w") as fp:
        json.dump(record, fp)
    # The record keeps the failed write's time; so does the file (a second may have ticked).
    failed_at = os.stat(path)
    os.utime(tmp, ns=(failed_at.st_atime_ns, failed_at.st_mtime_ns))
    os.replace(tmp, path)
    return reason
