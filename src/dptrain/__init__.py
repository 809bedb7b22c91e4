"""dptrain: data-parallel training of gradient and TAGI learners on torch.distributed.

Importing dptrain starts no process group and reads no environment.
"""

from dptrain.dist import DistEnv, init_distributed

__version__ = "0.1.0"

__all__ = ["DistEnv", "__version__", "init_distributed"]
