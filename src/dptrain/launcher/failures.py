"""A failed attempt of a job, summed up in one line: which rank failed first (`root_cause`),
how, and at which step the others lost it (`failure_summary`); an expected error is its own
line (`expected_error`). The failures are torch's `ProcessFailure`s, keyed by rank, read from
the error files the workers recorded (dptrain.launcher.worker)."""

from __future__ import annotations

import contextlib
import signal

from dptrain.errors import (AfterTrainingFailed, CheckpointError, ConfigError, DataError,
                            NonFiniteLoss, TrainingCollapsed)

EXPECTED_EXIT_CODES = {cls.exit_code: cls.__name__
                       for cls in (ConfigError, DataError, CheckpointError, NonFiniteLoss,
                                   TrainingCollapsed, AfterTrainingFailed)}
"""Exit statuses of workers that ended on an expected error (see dptrain.launcher.worker)."""


def _text(message: object) -> str:
    return str(message.get("message", "")) if isinstance(message, dict) else str(message or "")


def lost_a_peer(failure: object) -> bool:
    """True when the rank only saw a peer vanish from a collective (a `RankFailure`): its
    failure follows from another rank's."""
    return "RankFailure" in _text(getattr(failure, "message", None))


def root_cause(failures: dict) -> tuple[int, object]:
    """The failure that caused the others. Two kinds only follow from another rank's: a
    `RankFailure` (it saw a peer vanish from a collective) and a SIGTERM (the agent stopping the
    survivors), so prefer any other; then the earliest."""
    def key(item: tuple[int, object]) -> tuple[bool, float, int]:
        rank, failure = item
        secondary = failure.exitcode == -signal.SIGTERM or lost_a_peer(failure)
        return (secondary, failure.timestamp, rank)

    return min(failures.items(), key=key)


def _describe(message: object) -> str:
    """The failed rank's traceback when its worker recorded one, else the agent's summary. A
    lost peer (RankFailure) is its message's first line: its traceback says nothing more."""
    if isinstance(message, dict):
        text = str(message.get("message", ""))
        if text.startswith("RankFailure: "):
            return f"Its error: {text.splitlines()[0]}"
        stack = message.get("extraInfo", {}).get("py_callstack")
        return f"Its error:\n{stack or text}"
    return f"Its error: {message}" if message else "It died without a Python error (signal?)."


def _lost_peer(failure: object) -> dict:
    """What a rank that lost a peer recorded (dptrain.launcher.worker): step, missing ranks."""
    message = getattr(failure, "message", None)
    info = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    found = info.get("dptrain") if isinstance(info, dict) else None
    return found if isinstance(found, dict) else {}


def _at_step(failures: dict) -> str:
    """" at step N": the first step at which a rank recorded losing a peer, else ""."""
    steps = [r["step"] for r in map(_lost_peer, failures.values())
             if isinstance(r.get("step"), int)]
    return f" at step {min(steps)}" if steps else ""


def failure_summary(failures: dict) -> str:
    """One line's worth on a failed attempt: the rank that failed first, how, and the step at
    which the others lost it (from the survivors' records), e.g. `rank 1 failed (exit code -9,
    SIGKILL) at step 25`; for a node that only lost a peer on another node, `rank 1 lost rank(s)
    0 at step 25`."""
    rank, failure = root_cause(failures)
    at = _at_step(failures)
    code = failure.exitcode
    how = f"exit code {code}"
    if code < 0:
        with contextlib.suppress(ValueError):
            how += f", {signal.Signals(-code).name}"
    if lost_a_peer(failure):  # every failure here followed another's
        reports = [_lost_peer(f) for f in failures.values()]
        missing = sorted({m for r in reports for m in (r.get("missing") or [])})
        lost = f"rank(s) {', '.join(map(str, missing))}" if missing else "a peer"
        return f"rank {rank} lost {lost}{at} ({how})"
    return f"rank {rank} failed ({how}){at}"


def expected_error(failure: object) -> str | None:
    """The one-line text of a failure a worker recorded as an expected error (a bad option,
    dataset or checkpoint: see dptrain.launcher.worker), else None."""
    name = EXPECTED_EXIT_CODES.get(getattr(failure, "exitcode", None))
    text = _text(getattr(failure, "message", None))
    prefix = f"{name}: "
    return text[len(prefix):] if name and text.startswith(prefix) else None


def failure_line(failures: dict) -> str:
    """A failed attempt in one line: an expected error's own (`rank 1: ...`), else
    `failure_summary`'s."""
    rank, failure = root_cause(failures)
    text = expected_error(failure)
    return f"rank {rank}: {text}" if text is not None else failure_summary(failures)


def job_failure(failures: dict) -> tuple[str, int]:
    """What the launcher says when the job failed (no restart left), and its exit status: an
    expected error's own line and status; else the rank that failed first, the step, the ranks
    that failed after it and its error (its traceback, when it recorded one), status 1."""
    rank, failure = root_cause(failures)
    text = expected_error(failure)
    if text is not None:
        return f"error: rank {rank}: {text}", failure.exitcode
    others = sorted(set(failures) - {rank})
    also = f" (rank(s) {', '.join(map(str, others))} failed after it)" if others else ""
    return (f"rank {rank} failed first (exit code {failure.exitcode}){_at_step(failures)}{also} "
            f"and the job was stopped. {_describe(failure.message)}"), 1
