"""pytagi.nn on dptrain.tagi: the engine's layers (pytagi's arguments), and adapters for the
classes whose surface differs (`Sequential`, `OutputUpdater`, `DDPSequential`).

    from dptrain.pytagi.nn import Linear, OutputUpdater, ReLU, Sequential
    net = Sequential(Linear(1, 50), ReLU(), Linear(50, 1))
    m_pred, v_pred = net(x)                     # flat float32 numpy arrays, as pytagi
"""

from __future__ import annotations

from dptrain.pytagi.nn.ddp import DDPConfig, DDPSequential
from dptrain.pytagi.nn.output_updater import OutputUpdater
from dptrain.pytagi.nn.sequential import Sequential
from dptrain.pytagi.tagi_utils import HRCSoftmax
from dptrain.tagi import (LSTM, SLSTM, AvgPool2d, BatchNorm2d, ClosedFormSoftmax, Conv2d,
                          ConvTranspose2d, Embedding, EvenExp, LayerBlock, LayerNorm, LeakyReLU,
                          Linear, MaxPool2d, MixtureReLU, MixtureSigmoid, MixtureTanh,
                          MultiheadAttention, ReLU, Remax, ResNetBlock, RMSNorm, Sigmoid,
                          SLinear, Softmax, Softplus, Tanh)
from dptrain.tagi.base import Layer as BaseLayer
from dptrain.tagi.states import DeltaStates as BaseDeltaStates
from dptrain.tagi.states import HiddenStates as BaseHiddenStates

__all__ = ["AvgPool2d", "BaseDeltaStates", "BaseHiddenStates", "BaseLayer", "BatchNorm2d",
           "ClosedFormSoftmax", "Conv2d", "ConvTranspose2d", "DDPConfig", "DDPSequential",
           "Embedding", "EvenExp", "HRCSoftmax", "LSTM", "LayerBlock", "LayerNorm", "LeakyReLU",
           "Linear", "MaxPool2d", "MixtureReLU", "MixtureSigmoid", "MixtureTanh",
           "MultiheadAttention", "OutputUpdater", "RMSNorm", "ReLU", "Remax",
           "ResNetBlock", "SLSTM", "SLinear", "Sequential", "Sigmoid", "Softmax", "Softplus", "Tanh"]
