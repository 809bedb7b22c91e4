"""Rank-aware printing and logging: rank 0 speaks, the others stay quiet unless they fail."""

from __future__ import annotations

import logging
import sys
from typing import Any

from dptrain.runtime.collectives import get_rank


def rank_zero_print(*args: Any, **kwargs: Any) -> None:
    """`print` on rank 0 only (flushes, so output interleaves sensibly under launchers)."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


class RankZeroFilter(logging.Filter):
    """Drops records below WARNING on ranks other than 0."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.WARNING


def setup_logging(rank: int, *, level: int = logging.INFO, all_ranks: bool = False) -> None:
    """One stderr handler with a `[rank r]` prefix; only applications (the CLI) call this."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))
    if not all_ranks:
        handler.addFilter(RankZeroFilter(rank))
    root = logging.getLogger("dptrain")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
