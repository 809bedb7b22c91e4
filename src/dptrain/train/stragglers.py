"""Per-rank step times, and a warning that names a rank the others keep waiting for.

In data-parallel training every step ends in a collective, so every rank's step takes as long
as the slowest rank's: the wall time of a step says nothing about who is slow. What differs is
how a step splits:

- **compute**: the step minus the time spent in collectives (`dist.collective_seconds`, which
  counts dptrain's collectives and DDP's gradient all-reduce);
- **wait**: the time in collectives, waiting for the other ranks plus the transfer itself;
- **data**: the time the step waited for its batch (the data loader).

A slow rank (a slower device, a throttled core, a noisy neighbour, a slow disk for its data)
shows as more compute + data than the others, and the others show as more wait. Every WINDOW
steps the ranks exchange their window's means (one all-reduce of 3 numbers per rank); a rank
whose compute + data per step is at least SLOW_RATIO times the median of the other ranks', in
SUSTAIN windows in a row, is named in one warning by rank 0 (again only after it has recovered
and slowed down again). The median of the *other* ranks, not of all: with two ranks the
median of both would be their mean, and a rank would have to be 3x slower to reach 1.5x it.

Per epoch the means of every rank go to `ranks.csv` and TensorBoard (`Trainer`); they are
measurements, different in every run, so they stay out of `epochs.csv`, the run's deterministic
record (a resumed run's epochs.csv equals an uninterrupted run's, byte for byte), and out of
checkpoints (whose states the tests compare with an uninterrupted run's).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

import torch

from dptrain import runtime as dd

log = logging.getLogger(__name__)

WINDOW = 10
"""Steps per comparison of the ranks."""
SUSTAIN = 3
"""Windows in a row a rank must be slow in before it is named."""
SLOW_RATIO = 1.5
"""How many times the other ranks' median (compute + data per step) makes a rank slow."""
MIN_GAP_S = 1e-3
"""And by at least this much per step: sub-millisecond steps differ by noise alone."""

PARTS = ("compute", "wait", "data")


@dataclass
class _Sums:
    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    def add(self, compute: float, wait: float, data: float) -> None:
        self.steps += 1
        for name, value in zip(PARTS, (compute, wait, data)):
            self.seconds[name] += value

    def means(self) -> list[float]:
        return [self.seconds[p] / self.steps if self.steps else 0.0 for p in PARTS]


def slower_than_the_others(busy: list[float]) -> list[bool]:
    """For each rank's seconds per step (compute + data), whether it is SLOW_RATIO times the
    median of the other ranks' and MIN_GAP_S above it."""
    out = []
    for rank, mine in enumerate(busy):
        others = statistics.median(busy[:rank] + busy[rank + 1:])
        out.append(mine >= SLOW_RATIO * others and mine - others >= MIN_GAP_S)
    return out


class StepTimes:
    """Collects this rank's step times; `end_step` and `epoch_rows` are collective (every rank
    calls them at the same steps)."""

    def __init__(self, rank: int, world_size: int, device: torch.device | str = "cpu") -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self._epoch, self._window = _Sums(), _Sums()
        self._streak = [0] * world_size
        self._named: set[int] = set()
        self.slow_ranks: list[int] = []
        """Every rank named so far, in the order it was named."""
        self._begun = (0.0, 0.0)

    def begin_step(self) -> None:
        self._begun = (time.perf_counter(), dd.collective_seconds())

    def end_step(self, step: int, data_s: float) -> None:
        """After the step (global step `step` done) that waited `data_s` for its batch."""
        started, collectives = self._begun
        wall = time.perf_counter() - started
        wait = dd.collective_seconds() - collectives
        compute = max(0.0, wall - wait)
        self._epoch.add(compute, wait, data_s)
        self._window.add(compute, wait, data_s)
        if self._window.steps == WINDOW:
            self._compare(step)
            self._window = _Sums()

    def _gather(self, sums: _Sums) -> list[list[float]]:
        """Every rank's means (compute, wait, data) and step count, in rank order."""
        row = [*sums.means(), float(sums.steps)]
        table = torch.zeros(self.world_size, len(row), dtype=torch.float64, device=self.device)
        table[self.rank] = torch.tensor(row, dtype=torch.float64)
        dd.all_reduce_flat([table])
        return table.cpu().tolist()

    def _compare(self, step: int) -> None:
        if self.world_size < 2:
            return
        table = self._gather(self._window)
        busy = [compute + data for compute, _, data, _ in table]
        for rank, slow in enumerate(slower_than_the_others(busy)):
            mine, others = busy[rank], statistics.median(busy[:rank] + busy[rank + 1:])
            self._streak[rank] = self._streak[rank] + 1 if slow else 0
            if not slow:
                self._named.discard(rank)
            elif self._streak[rank] >= SUSTAIN and rank not in self._named:
                self._named.add(rank)
                self.slow_ranks.append(rank)
                if self.rank == 0:
                    compute, wait, data, _ = table[rank]
                    log.warning(
                        "rank %d is slow: %.1fx the median of the other ranks over the %d steps "
                        "to step %d (compute %.1f ms + data %.1f ms per step, against %.1f ms); "
                        "every rank waits for it at each step (see ranks.csv)", rank,
                        mine / others if others > 0 else float("inf"), SUSTAIN * WINDOW, step,
                        compute * 1e3, data * 1e3, others * 1e3)

    def epoch_rows(self, epoch: int) -> list[dict[str, float | int]]:
        """Collective: each rank's mean seconds per step over this epoch's steps (those this
        process ran: a resumed epoch's since the resume), one row per rank; then starts over."""
        table = self._gather(self._epoch)
        self._epoch = _Sums()
        return [{"epoch": epoch, "rank": rank, "steps": int(steps), "compute_s": compute,
                 "wait_s": wait, "data_s": data}
                for rank, (compute, wait, data, steps) in enumerate(table)]
