"""The Trainer: epochs, exact distributed metrics, atomic checkpoints, exact resume.

    from dptrain.train import Trainer, TrainConfig
    trainer = Trainer(learner, split, TrainConfig(out_dir=Path("runs/x"), epochs=5), runtime)
    summary = trainer.fit()        # every rank calls it; rank 0 writes the run directory

A model family's additions to the report (figures per predicted position, summary entries, its
default monitor) come as `Trainer(..., extras=MetricExtras(...))`.
"""

from dptrain.train.config import TrainConfig
from dptrain.train.early_stopping import EarlyStopping
from dptrain.train.extras import MetricExtras
from dptrain.train.faults import FailAt
from dptrain.train.trainer import Trainer, params_sha256

__all__ = ["EarlyStopping", "FailAt", "MetricExtras", "TrainConfig", "Trainer", "params_sha256"]
