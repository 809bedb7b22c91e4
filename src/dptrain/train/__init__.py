"""The Trainer: epochs, exact distributed metrics, atomic checkpoints, exact resume.

    from dptrain.train import Trainer, TrainConfig
    trainer = Trainer(learner, split, TrainConfig(out_dir=Path("runs/x"), num_epochs=5), runtime)
    summary = trainer.fit()        # every rank calls it; rank 0 writes the run directory
"""

from dptrain.train.early_stopping import EarlyStopping
from dptrain.train.faults import FailAt
from dptrain.train.trainer import TrainConfig, Trainer, params_sha256

__all__ = ["EarlyStopping", "FailAt", "TrainConfig", "Trainer", "params_sha256"]
