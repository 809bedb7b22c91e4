"""Learners: what the Trainer drives, one step at a time, without knowing what is inside.

    from dptrain.learners import Learner   # the protocol TagiLearner and TorchLearner implement

    import functools, torch
    from dptrain.learners import TorchLearner
    learner = TorchLearner(torch.nn.Linear(10, 5), torch.nn.MSELoss(),
                           functools.partial(torch.optim.SGD, lr=0.1))
"""

from dptrain.learners.protocol import Batch, Learner, Metrics
from dptrain.learners.batchnorm import AllReduceBatchNorm
from dptrain.learners.torch_learner import TorchLearner, TorchLearnerConfig

__all__ = ["AllReduceBatchNorm", "Batch", "Learner", "Metrics", "TorchLearner",
           "TorchLearnerConfig"]
