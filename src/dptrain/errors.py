"""Exception hierarchy: the CLI maps each class to an exit code and a one-line message."""

from __future__ import annotations


class DptrainError(Exception):
    """Base of every error dptrain raises on purpose."""

    exit_code = 1


class ConfigError(DptrainError, ValueError):
    """A bad option, config key, or launcher environment."""

    exit_code = 2


class DataError(DptrainError, ValueError):
    """A dataset file or array that cannot be used as it is."""

    exit_code = 3


class CheckpointError(DptrainError):
    """A checkpoint that is missing, corrupt, or does not fit the run."""

    exit_code = 4


class RankFailure(DptrainError, RuntimeError):
    """A collective failed because another rank died, raised, or never arrived."""

    exit_code = 5

    def __init__(self, message: str, *, missing: list[int] | None = None,
                 step: int | None = None) -> None:
        super().__init__(message)
        self.missing = missing
        """The ranks that did not report in after the failure, when the rendezvous store could
        tell (dptrain.runtime.collectives); None when unknown."""
        self.step = step
        """The global step at which the Trainer lost its peer (set by the Trainer), else None."""


class NonFiniteLoss(DptrainError, FloatingPointError):
    """The loss was NaN or infinite on some rank; every rank stops before stepping."""

    exit_code = 6


class TrainingCollapsed(DptrainError, RuntimeError):
    """A TAGI run collapsed (its predictions stopped depending on the input) and the run was
    asked to stop on it (`--stop-on-collapse`); every rank stops after the same evaluation."""

    exit_code = 7


class ExportError(DptrainError):
    """An export that cannot be made (a layer that does not trace), or whose check against the
    live model failed (dptrain export)."""

    exit_code = 8


class AfterTrainingFailed(DptrainError):
    """Training ended and its checkpoints and `best/` are whole, but something after the last
    step (the final report, a forecast, a plot, the summary's export) failed: summary.json
    names it under `failed_after_training`."""

    exit_code = 9
