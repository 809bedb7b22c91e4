"""Fault injection for users: kill a rank at a chosen step, one kill per attempt of the job.

`--fail-at SPEC` (or `DPTRAIN_FAIL_AT=SPEC` for scripts) takes comma-separated points, one per
attempt of the job: the first point applies to the first attempt, the second to the attempt
torchrun starts after that failure (`TORCHELASTIC_RESTART_COUNT` 1), and so on; an attempt past
the last point runs undisturbed. A point is

    RANK:STEP        that rank SIGKILLs itself just before it runs global step STEP
    RANK:ckpt:STEP   that rank SIGKILLs itself in the middle of writing the checkpoint of step
                     STEP (rank 0: its state written, and a sharded learner's shards on every
                     rank, not yet published)

so `--fail-at 1:37,0:ckpt:90 --max-restarts 2` dies twice and must resume exactly each time.
Checkpoints are written in the background (dptrain.train.writer): before a RANK:STEP kill the job
lets the write in flight finish, so the attempt after it resumes from the newest checkpoint
before STEP, as a crash at a quiet moment would; RANK:ckpt:STEP kills rank 0 inside that
background write.
Points should not go backwards: an attempt resumes at its last checkpoint, at or before the
previous point's step, and a point before that is never reached.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from dptrain.runtime.job import attempt as job_attempt
from dptrain.errors import ConfigError

ENV_VAR = "DPTRAIN_FAIL_AT"
AFTER_TRAINING_VAR = "DPTRAIN_FAIL_AFTER_TRAINING"
"""`DPTRAIN_FAIL_AFTER_TRAINING=report` (or `plots`) makes that part of what runs after the
last training step raise, as a forecast that overflows or a plot that cannot be drawn would:
the run must stay whole (docs/design.md, contract 14)."""


class InjectedFailure(RuntimeError):
    """The failure `DPTRAIN_FAIL_AFTER_TRAINING` asked for."""


def fail_after_training(what: str) -> None:
    """Raise InjectedFailure when `DPTRAIN_FAIL_AFTER_TRAINING` names `what`."""
    if what in os.environ.get(AFTER_TRAINING_VAR, "").split(","):
        raise InjectedFailure(f"{AFTER_TRAINING_VAR}={what}")
_FORMAT = "fail-at must be RANK:STEP or RANK:ckpt:STEP with non-negative integers, comma-separated"


@dataclass(frozen=True)
class FaultPoint:
    rank: int
    step: int
    in_checkpoint: bool = False

    def __str__(self) -> str:
        return f"{self.rank}:ckpt:{self.step}" if self.in_checkpoint else f"{self.rank}:{self.step}"


def _point(text: str, spec: str) -> FaultPoint:
    parts = [p.strip() for p in text.split(":")]
    in_checkpoint = len(parts) == 3 and parts[1] == "ckpt"
    if in_checkpoint:
        parts = [parts[0], parts[2]]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"{_FORMAT}, got {spec!r}")
    return FaultPoint(int(parts[0]), int(parts[1]), in_checkpoint)


def attempt() -> int:
    """Which attempt of the job this is: 0, then 1 after torchrun's first restart, ...; the
    job's, agreed by every node, under dptrain's agents (dptrain.runtime.job.attempt)."""
    return job_attempt()


@dataclass(frozen=True)
class FailAt:
    points: tuple[FaultPoint, ...]

    @classmethod
    def parse(cls, spec: str) -> FailAt:
        if not spec.strip():
            raise ConfigError(f"{_FORMAT}, got {spec!r}")
        return cls(tuple(_point(text, spec) for text in spec.split(",")))

    @classmethod
    def from_env(cls) -> FailAt | None:
        spec = os.environ.get(ENV_VAR)
        return cls.parse(spec) if spec else None

    def __str__(self) -> str:
        return ",".join(map(str, self.points))

    def _current(self) -> FaultPoint | None:
        n = attempt()
        return self.points[n] if n < len(self.points) else None

    def kill_due(self, step: int) -> bool:
        """Whether some rank dies before global step `step` in this attempt (every rank can
        tell, as every rank holds the same points)."""
        point = self._current()
        return point is not None and not point.in_checkpoint and point.step == step

    def maybe_kill(self, rank: int, step: int) -> None:
        """Before global step `step`: die if this attempt's point is (rank, step)."""
        point = self._current()
        if point and not point.in_checkpoint and (point.rank, point.step) == (rank, step):
            _kill(rank, f"at step {step}")

    def maybe_kill_in_checkpoint(self, rank: int, step: int) -> None:
        """Midway through writing the checkpoint of `step`."""
        point = self._current()
        if point and point.in_checkpoint and (point.rank, point.step) == (rank, step):
            _kill(rank, f"while writing the checkpoint of step {step}")


def _kill(rank: int, where: str) -> None:
    print(f"[rank {rank}] fault injection (attempt {attempt()}): SIGKILL {where}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
