"""The Trainer's report: progress lines, TensorBoard, the rows of epochs.csv, steps.csv and
ranks.csv, summary.json and the run's last files.

    report = Reporter(config, extras, rank=0, world_size=2, steps_per_epoch=41)
    report.open()                                   # rank 0: the run directory, tb/
    report.write_epoch(history, row, epoch=0)       # epochs.csv, TensorBoard, the epoch's line
    report.finish(report.summary(...), history)     # learning_curves.png, summary.json

Every rank builds the rows and the summary (the collectives they need are the Trainer's); rank
0 alone writes and prints. What a model family adds (figures per predicted position, its own
summary entries) comes from its `MetricExtras`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dptrain import runtime as dd
from dptrain.learners.protocol import Learner
from dptrain.train import faults, flops, loggers
from dptrain.train.config import TrainConfig
from dptrain.train.early_stopping import EarlyStopping
from dptrain.train.extras import MetricExtras
from dptrain.train.progress import Progress

POSITIONS = "tokens"
"""steps.csv's column of the predicted positions seen (`MetricExtras.positions_per_sample`):
the name runs have always written."""


@dataclass(frozen=True)
class Totals:
    """What the Trainer measured over the run, for summary.json."""

    wall_s: float
    """The whole fit, setup and evaluations included."""
    samples: int
    """Training samples of this run (a resumed run's own), over every rank."""
    train_s: float
    """Seconds spent training (waits for batches included; evaluations and checkpoints not)."""
    data_wait_s: float
    """Seconds the training steps waited for their batches."""
    checkpoint_pauses: list[float]
    """Seconds each checkpoint held this rank's training up."""
    slow_ranks: Any
    """The ranks found slow (`dptrain.train.stragglers.StepTimes.slow_ranks`)."""


def pause_stats(pauses: list[float]) -> dict[str, float | int]:
    """How long checkpoints held training up on this rank: count, mean and longest, seconds."""
    if not pauses:
        return {"count": 0, "mean": 0.0, "max": 0.0}
    return {"count": len(pauses), "mean": sum(pauses) / len(pauses), "max": max(pauses)}


def after_training(what: str, part: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """What `part` adds to the summary, or, when it fails, `failed_after_training` naming
    it: nothing after the last step may lose a run whose checkpoints are written (the
    job ends non-zero on it once summary.json is out: dptrain.train.job)."""
    try:
        faults.fail_after_training(what)
        return part()
    except Exception as err:  # noqa: BLE001 - anything: the run is whole, say what failed
        return {"failed_after_training": f"{what}: {type(err).__name__}: {err}"}


def epoch_row(*, epoch: int, step: int, scalars: dict[str, float],
              train_means: dict[str, float],
              evaluated: dict[str, dict[str, float]]) -> dict[str, Any]:
    """A row of epochs.csv: the epoch (1-based), its last step, the learner's per-step values
    of that step, the train metrics and each evaluated part's."""
    return {"epoch": epoch, "step": step, **scalars, **train_means,
            **{k: v for means in evaluated.values() for k, v in means.items()}}


class Reporter:
    """The run's report as it goes and at its end, for the Trainer."""

    def __init__(self, config: TrainConfig, extras: MetricExtras, *, rank: int,
                 world_size: int, steps_per_epoch: int) -> None:
        self.config, self.extras = config, extras
        self.rank, self.world_size, self.steps_per_epoch = rank, world_size, steps_per_epoch
        self.out = Path(config.out_dir)
        self.tb: loggers.TensorBoardLogger | None = None
        """Rank 0's TensorBoard log, from `open`."""
        self.throughput: dict[str, Any] = {}
        """The model's FLOPs per position and the devices' peak (summary.json), from
        `measure`."""
        self.mfu_per_position: float | None = None
        """MFU per predicted position per second (over every rank's devices), from `measure`."""

    # ----------------------------------------------------------------------- as the run goes
    def open(self) -> None:
        """Rank 0: the run directory and its TensorBoard log (once a resume chose its
        checkpoint: a refused one leaves no directory behind)."""
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            self.tb = loggers.TensorBoardLogger(self.out / "tb")

    def measure(self, learner: Learner, device: torch.device) -> None:
        """Collective: the model's training FLOPs per position and one device's peak (rank
        0's, the same in every rank's summary), for the MFU; nothing for a model that declares
        no FLOPs, or data without positions per sample."""
        declared = learner.flops_per_token()
        if declared is None or self.extras.positions_per_sample is None:
            return
        per_position, dtype = declared
        peak = dd.broadcast_object(flops.peak_flops(device, dtype, self.config.peak_flops))
        self.throughput = {"flops_per_token": per_position, "peak_flops": peak.rate,
                           "peak_flops_source": peak.source}
        if peak.rate:
            self.mfu_per_position = per_position / (peak.rate * self.world_size)

    def progress(self, *, total: int, done: int, epoch: int, step: int) -> Progress:
        """Rank 0's progress bar over the epoch's steps (`TrainConfig.progress`)."""
        if self.config.max_steps is not None:
            label = f"epoch {epoch + 1}, step {step}/{self.config.max_steps}"
        else:
            label = f"epoch {epoch + 1}/{self.config.epochs}"
        return Progress(total=total, done=done, desc=label,
                        enabled=self.config.progress and self.rank == 0,
                        positions_per_sample=self.extras.positions_per_sample,
                        mfu_per_position=self.mfu_per_position)

    def log_step(self, scalars: dict[str, float], step: int) -> None:
        """The learner's per-step values (learning rate) to TensorBoard."""
        if self.tb is not None and scalars:
            self.tb.log_step(scalars, step)

    def flush(self) -> None:
        """TensorBoard's steps so far to disk (before a checkpoint: a resume will not log
        them again)."""
        if self.tb is not None:
            self.tb.flush()

    def point_row(self, *, step: int, samples_seen: int, scalars: dict[str, float],
                  since: dict[str, float], evaluated: dict[str, float]) -> dict[str, Any]:
        """A row of steps.csv: the step, its epoch as a fraction, the samples (and positions)
        seen, the learner's per-step values, the train metrics since the last point and the
        validation's."""
        row: dict[str, Any] = {"step": step, "epoch": round(step / self.steps_per_epoch, 6),
                               "samples": samples_seen}
        if self.extras.positions_per_sample is not None:
            row[POSITIONS] = samples_seen * self.extras.positions_per_sample
        row.update({**scalars, **since, **evaluated})
        return row

    def write_point(self, step_history: list[dict[str, Any]]) -> None:
        """Rank 0: steps.csv, the last row to TensorBoard and, with `val_every`, its line."""
        if self.rank != 0:
            return
        row = step_history[-1]
        loggers.write_csv(self.out / "steps.csv", step_history)
        if self.tb is not None:  # against the step, beside the learning rate
            self.tb.log_step({k: v for k, v in row.items()
                              if k.startswith(("train_", "val_"))}, row["step"])
        if self.config.val_every:
            shown = "  ".join(f"{k} {v:.4g}" for k, v in row.items()
                              if k not in ("step", "epoch", "samples", POSITIONS))
            end = f"/{self.config.max_steps}" if self.config.max_steps else ""
            dd.rank_zero_print(f"step {row['step']}{end} (epoch {row['epoch']:.4g})  {shown}")

    def write_epoch(self, history: list[dict[str, Any]], record: dict[str, Any]) -> None:
        """Rank 0: epochs.csv, the epoch's row (`record`) to TensorBoard and its line."""
        if self.rank != 0:
            return
        loggers.write_csv(self.out / "epochs.csv", history)
        if self.tb is not None:
            self.tb.log(record)
        shown = "  ".join(f"{k} {v:.4g}" for k, v in record.items() if k != "epoch")
        of = "" if self.config.max_steps is not None else f"/{self.config.epochs}"
        dd.rank_zero_print(f"epoch {record['epoch']}{of}  {shown}")

    def write_rank_times(self, rows: list[dict[str, Any]], *, epoch: int, step: int) -> None:
        """Rank 0: every rank's mean step times of the epoch (1-based) to ranks.csv and
        TensorBoard (not epochs.csv, which must not change from run to run:
        dptrain.train.stragglers)."""
        if self.rank != 0:
            return
        loggers.write_rank_times(self.out / "ranks.csv", rows)
        if self.tb is not None:
            self.tb.log({"epoch": epoch, "step": step,
                         **{f"ranks_{part}_s_rank{row['rank']}": row[f"{part}_s"]
                            for row in rows for part in ("compute", "wait", "data")}})

    # ------------------------------------------------------------------------------ the end
    def rates(self, totals: Totals) -> dict[str, Any]:
        """With positions per sample: the positions seen per second of training (evaluations
        left out), the FLOPs and peak behind the MFU, and the MFU."""
        per_sample = self.extras.positions_per_sample
        if per_sample is None:
            return {}
        per_s = totals.samples * per_sample / totals.train_s if totals.train_s else 0.0
        # summary.json's names for them, as runs have always written them
        out: dict[str, Any] = {"tokens_per_s": per_s, **self.throughput}
        if self.mfu_per_position is not None:
            out["mfu"] = self.mfu_per_position * per_s
        return out

    def step_report(self, *, step: int, samples_seen: int, best_step: int | None
                    ) -> dict[str, Any]:
        """Where the run is in steps: epochs as their view, samples (and positions) seen, the
        step of the best validation point."""
        out: dict[str, Any] = {"epochs_done": step / self.steps_per_epoch,
                               "samples_seen": samples_seen, "best_step": best_step}
        if self.extras.positions_per_sample is not None:
            out["tokens_seen"] = samples_seen * self.extras.positions_per_sample  # its name
        return out

    def summary(self, *, history: list[dict[str, Any]], early: EarlyStopping, monitor: str,
                step: int, epoch: int, samples_seen: int, best_step: int | None,
                totals: Totals, skipped: dict[str, Any], params_sha256: str,
                resumed_from: str | None, learner_report: dict[str, Any]) -> dict[str, Any]:
        """summary.json: the last epoch's validation and test metrics, where the run ended
        and what chose, the rates and waits, the samples left out (`skipped`), the pauses,
        the parameters' hash, the config and what the learner reports at the end."""
        final = history[-1] if history else {}
        chosen = {"monitor": monitor, f"best_{monitor}": early.best} \
            if monitor else {"monitor": None}
        ended_early = early.should_stop and (
            step < self.config.max_steps if self.config.max_steps is not None
            else epoch < self.config.epochs)
        train_s, data_wait_s = totals.train_s, totals.data_wait_s
        return {
            **{k: v for k, v in final.items() if k.startswith("test_")},
            **{k: v for k, v in final.items() if k.startswith("val_")},
            "final_epoch": final.get("epoch"), "steps": step,
            **self.step_report(step=step, samples_seen=samples_seen, best_step=best_step),
            "best_epoch": early.best_epoch, **chosen,
            "stopped_early": ended_early,
            "world_size": self.world_size, "batch_size": self.config.batch_size,
            "wall_time_s": totals.wall_s,
            "samples_per_s": totals.samples / totals.wall_s if totals.wall_s > 0 else 0.0,
            **self.rates(totals), **self.extras.summary,
            "data_wait_s": data_wait_s, "train_time_s": train_s,
            "data_wait_share": data_wait_s / train_s if train_s > 0 else 0.0,
            **skipped,
            "checkpoint_pause_s": pause_stats(totals.checkpoint_pauses),
            "slow_ranks": totals.slow_ranks,
            "params_sha256": params_sha256,
            "resumed_from": resumed_from, "run_dir": str(self.config.out_dir),
            "config": self.config.to_json(),
            **learner_report,
        }

    def finish(self, summary: dict[str, Any], history: list[dict[str, Any]]) -> None:
        """Rank 0: TensorBoard closed, learning_curves.png, summary.json (atomically)."""
        if self.rank != 0:
            return
        if self.tb is not None:
            self.tb.close()
        failed = after_training("plots", lambda: (loggers.plot_learning_curves(
            self.out / "learning_curves.png", history), {})[1])
        if failed and "failed_after_training" not in summary:
            summary.update(failed)
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1, default=str))
        tmp.replace(self.out / "summary.json")
