"""Learners: what the Trainer drives, one step at a time, without knowing what is inside.

    from dptrain.learners import Learner   # the protocol TagiLearner and TorchLearner implement
"""

from dptrain.learners.protocol import Batch, Learner, Metrics

__all__ = ["Batch", "Learner", "Metrics"]
