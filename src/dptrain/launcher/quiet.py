"""torch's own logging kept quiet in the agent's process, which reports a job's failure once,
in one line: its elastic loggers (`quiet_elastic_logs`) and its C++ warnings
(`quiet_cpp_warnings`), unless the user asked for them (LOGLEVEL, TORCH_CPP_LOG_LEVEL). The
workers are processes of their own and keep theirs."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import logging
import os
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_elastic_logs() -> Iterator[None]:
    """torch's elastic loggers (its agent's failure lines among them) at CRITICAL, unless the
    user asked for LOGLEVEL; their levels are put back after."""
    quieted = []
    if "LOGLEVEL" not in os.environ:
        for name, logger in list(logging.root.manager.loggerDict.items()):
            if name.startswith("torch.distributed.elastic") and \
                    isinstance(logger, logging.Logger):
                quieted.append((logger, logger.level))
                logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in quieted:
            logger.setLevel(level)


CPP_ERROR_LEVEL = 2
"""c10's log level for errors (0 info, 1 warning, 2 error, 3 fatal)."""
CPP_FATAL_LEVEL = 3
"""c10's log level that leaves its errors out too."""


def _c10_log_level() -> ctypes.c_int | None:
    """c10's log level flag in the torch this process loaded, or None where it is not found
    (a torch built otherwise)."""
    import torch

    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*")):
        with contextlib.suppress(OSError, ValueError):
            return ctypes.c_int.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_log_level")
    return None


@contextlib.contextmanager
def quiet_cpp_warnings(level: int = CPP_ERROR_LEVEL) -> Iterator[None]:
    """torch's C++ warnings off in the agent's process, unless the user asked for logs
    (LOGLEVEL, TORCH_CPP_LOG_LEVEL). Its c10d store client logs each failed request with a
    C++ stack trace, several when the rendezvous host is lost, which the launcher reports in
    one line. torch reads TORCH_CPP_LOG_LEVEL once, when it loads: the flag it sets is
    changed in place. The workers are processes of their own and keep their warnings.
    `level`: the lowest level still logged; CPP_FATAL_LEVEL leaves the errors out too, for a
    request whose failure the launcher reports in one line (dptrain.launcher.c10d_store)."""
    flag = None if {"LOGLEVEL", "TORCH_CPP_LOG_LEVEL"} & os.environ.keys() else _c10_log_level()
    if flag is None or flag.value >= level:
        yield
        return
    before, flag.value = flag.value, level
    try:
        yield
    finally:
        flag.value = before
