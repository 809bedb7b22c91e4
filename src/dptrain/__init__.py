"""dptrain: data-parallel training of gradient and TAGI learners on torch.distributed.

    from dptrain import Trainer, TrainConfig, TagiLearner, TorchLearner, init_distributed
    from dptrain import load_run     # a trained run's model, ready to predict

Importing dptrain starts no process group and reads no environment.
"""

from dptrain import tagi
from dptrain._version import __version__
from dptrain.data import ShardedSampler
from dptrain.runtime import DistEnv, init_distributed
from dptrain.inference import load_run
from dptrain.learners import TorchLearner
from dptrain.learners.tagi_learner import TagiLearner
from dptrain.train import TrainConfig, Trainer


__all__ = ["DistEnv", "ShardedSampler", "TagiLearner", "TorchLearner", "TrainConfig", "Trainer",
           "__version__", "init_distributed", "load_run", "tagi"]
