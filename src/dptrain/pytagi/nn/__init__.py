"""pytagi.nn on dptrain.tagi: the engine's layers (pytagi's arguments), and adapters for the
classes whose surface differs (`Sequential`, `OutputUpdater`, `DDPSequential`).

    from dptrain.pytagi.nn import Linear, OutputUpdater, ReLU, Sequential
    net = Sequential(Linear(1, 50), ReLU(), Linear(50, 1))
    m_pred, v_pred = net(x)                     # flat float32 numpy arrays, as pytagi
"""

from __future__ import annotations

from dptrain import tagi as _tagi
from dptrain.pytagi.nn.ddp import DDPConfig, DDPSequential
from dptrain.pytagi.nn.output_updater import OutputUpdater
from dptrain.pytagi.nn.sequential import Sequential
from dptrain.pytagi.tagi_utils import HRCSoftmax
from dptrain.tagi import (LSTM, SLSTM, AvgPool2d, BatchNorm2d, Conv2d, Embedding, EvenExp,
                          LayerBlock, LayerNorm, LeakyReLU, Linear, MaxPool2d, MixtureReLU,
                          MixtureSigmoid, MixtureTanh, ReLU, Remax, ResNetBlock, Sigmoid,
                          SLinear, Softplus, Tanh)
from dptrain.tagi.base import Layer as BaseLayer
from dptrain.tagi.states import DeltaStates as BaseDeltaStates
from dptrain.tagi.states import HiddenStates as BaseHiddenStates

PENDING_LAYERS = ("ConvTranspose2d", "Softmax", "ClosedFormSoftmax")
"""pytagi layers served from dptrain.tagi once the engine has them (each is re-exported below
when present, so this module works with or without them)."""
globals().update({name: getattr(_tagi, name) for name in PENDING_LAYERS
                  if hasattr(_tagi, name)})

__all__ = ["AvgPool2d", "BaseDeltaStates", "BaseHiddenStates", "BaseLayer", "BatchNorm2d",
           "Conv2d", "DDPConfig", "DDPSequential", "Embedding", "EvenExp", "HRCSoftmax", "LSTM",
           "LayerBlock", "LayerNorm", "LeakyReLU", "Linear", "MaxPool2d", "MixtureReLU",
           "MixtureSigmoid", "MixtureTanh", "OutputUpdater", "ReLU", "Remax", "ResNetBlock",
           "SLSTM", "SLinear", "Sequential", "Sigmoid", "Softplus", "Tanh",
           *(name for name in PENDING_LAYERS if hasattr(_tagi, name))]
