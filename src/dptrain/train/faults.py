"""Fault injection for users: kill one rank at one step, in the first attempt only.

`--fail-at RANK:STEP` (or `DPTRAIN_FAIL_AT=RANK:STEP` for scripts) makes that rank SIGKILL itself
just before it runs global step STEP, unless torchrun has already restarted the job, so a run
with `--max-restarts 1` dies once and must resume exactly from its last checkpoint.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from dptrain.errors import ConfigError

ENV_VAR = "DPTRAIN_FAIL_AT"


@dataclass(frozen=True)
class FailAt:
    rank: int
    step: int

    @classmethod
    def parse(cls, spec: str) -> FailAt:
        rank, sep, step = spec.partition(":")
        if not sep or not rank.strip().isdigit() or not step.strip().isdigit():
            raise ConfigError(f"fail-at must be RANK:STEP with non-negative integers, got {spec!r}")
        return cls(int(rank), int(step))

    @classmethod
    def from_env(cls) -> FailAt | None:
        spec = os.environ.get(ENV_VAR)
        return cls.parse(spec) if spec else None

    def maybe_kill(self, rank: int, step: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and rank == self.rank and step == self.step:
            print(f"[rank {rank}] fault injection: SIGKILL at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
