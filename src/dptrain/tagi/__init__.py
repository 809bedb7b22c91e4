"""TAGI (Tractable Approximate Gaussian Inference) networks on torch tensors, pytagi's loop.

Every weight is a Gaussian; a step propagates means and variances forward, updates the output
with the observation, sends innovations back, and applies capped parameter increments. There is
no loss and no autograd. Equations: docs/tagi.md. Runs on CPU or CUDA tensors, float32 by
default (`Sequential(..., dtype=torch.float64)` or `net.to(torch.float64)` for float64).

Usage (classification with the hierarchical softmax)::

    import torch
    from dptrain.tagi import HRCSoftmax, Linear, OutputUpdater, ReLU, Sequential, manual_seed

    manual_seed(0)
    net = Sequential(Linear(64, 128), ReLU(), Linear(128, 128), ReLU(), Linear(128, 11))
    updater = OutputUpdater(net.device)
    hrc = HRCSoftmax(num_classes=10)                  # hrc.num_outputs == 11
    x, labels = torch.randn(32, 64), torch.randint(0, 10, (32,))
    mu, var = net(x)                                  # (32, 11) each
    y_obs, y_idx = hrc.encode(labels)                 # (32, 4) each
    updater.update_using_indices(net.output_z_buffer, y_obs, 0.05**2, y_idx,
                                 net.input_delta_z_buffer)
    net.backward()
    net.step()
    net.eval()
    pred = hrc.predict(*net(x))                       # (32,) class labels

Regression uses `updater.update(net.output_z_buffer, y, var_y, net.input_delta_z_buffer)`;
NaN targets are missing observations (zero innovation). A heteroscedastic head
(`EvenExp()` last, outputs in (mean, noise variance) pairs) learns the noise per input with
`updater.update_heteros(net.output_z_buffer, y, net.input_delta_z_buffer)`; `split_heteros`
splits its prediction into mean, epistemic and aleatoric variance. `net.state_dict()` holds
`"<layer>.mu_w"`, `".var_w"`, `".mu_b"`, `".var_b"`, and BatchNorm's running statistics
`"<layer>.mu_ra"`, `".var_ra"`, `".num_batches_tracked"` (state, not parameters; layers inside
blocks are `"<i>.<j>…"`, `"<i>.main.<j>…"`, `"<i>.short.<j>…"`); `net.save(path)` /
`net.load(path)` store plain tensors only. Data parallel: `DDPSequential` and `DDPConfig`
(`from dptrain.tagi import DDPSequential, DDPConfig`, pytagi's line; they live in
`dptrain.tagi.ddp`, the only part that needs a process group, which is imported on first use
of either name, not by `import dptrain.tagi`) wrap a network with pytagi's surface; here
`DDPSequential` sums the ranks' deltas by default (`average=True` for pytagi's mean). A wrapper
of your own uses `named_delta_tensors()` (or `flat_deltas`), `flat_state` and `cap_batch_size`
(see `Sequential`).

Image networks take NCHW states, e.g. pytagi's MNIST CNN::

    net = Sequential(Conv2d(1, 16, 4, padding=1, in_width=28, in_height=28), ReLU(),
                     AvgPool2d(3, 2), Conv2d(16, 32, 5), ReLU(), AvgPool2d(3, 2),
                     Linear(32 * 4 * 4, 100), ReLU(), Linear(100, 11))
    mu, var = net(torch.randn(32, 1, 28, 28))         # or pytagi's flat (32 * 784,) array

Sequence networks take windows (B, T, D), or pytagi's flat (B, T·D) arrays; an LSTM outputs
every step's hidden state (B, T, O), e.g. pytagi's time-series network::

    net = Sequential(LSTM(1, 8, 5), LSTM(8, 8, 5), Linear(8 * 5, 1))
    mu, var = net(torch.randn(16, 5, 1))              # (16, 1) each
    net.reset_lstm_states()                           # what LSTMs carry between calls

(as in pytagi 0.2.1, hidden and cell states carry from one call to the next only for a batch
of one sample and seq_len 1; docs/tagi.md, LSTM).

Categorical inputs go through `Embedding(num_embeddings, embedding_dim, input_size)` (ids as
float-coded values, N per sample). A time series seen one step per call runs through `SLSTM`
layers and an `SLinear` head; after a pass, `net.smoother()` returns the smoothed outputs
(docs/tagi.md, SLSTM and the smoother).

Transformers: `MultiheadAttention(embed_dim, num_heads, num_kv_heads)` (causal, RoPE, grouped
key/value heads) and `RMSNorm(embed_dim)` take sequences as `Embedding` outputs them, (B, T·E)
(docs/tagi.md, MultiheadAttention and RMSNorm).

Classification heads with one-hot observations (`updater.update`) end in `Remax`,
`ClosedFormSoftmax` or `Softmax` (per sample; docs/tagi.md, Softmax).

`ConvTranspose2d` (pytagi's arguments) upsamples, e.g. a decoder from a 16-unit code to
28x28, its first layer reading the Linear's flat output as 32 images of 7x7::

    decoder = Sequential(Linear(16, 32 * 7 * 7), MixtureReLU(),
                         ConvTranspose2d(32, 16, 3, stride=2, padding=1, padding_type=2,
                                         in_width=7, in_height=7), MixtureReLU(),
                         ConvTranspose2d(16, 1, 3, stride=2, padding=1, padding_type=2))
    mu, var = decoder(torch.randn(32, 16))            # (32, 1, 28, 28) each
"""

from __future__ import annotations

import importlib

from dptrain.tagi._rng import manual_seed
from dptrain.tagi.attention import MultiheadAttention
from dptrain.tagi.activations import EvenExp, LeakyReLU, ReLU, Sigmoid, Softplus, Tanh
from dptrain.tagi.base import Layer, ParamLayer, cap_factor
from dptrain.tagi.blocks import LayerBlock, Parallel, ResNetBlock
from dptrain.tagi.conv2d import Conv2d
from dptrain.tagi.convtranspose2d import ConvTranspose2d
from dptrain.tagi.embedding import Embedding
from dptrain.tagi.hrc_softmax import HRCSoftmax
from dptrain.tagi.linear import Linear
from dptrain.tagi.lstm import LSTM
from dptrain.tagi.norm import BatchNorm2d, LayerNorm
from dptrain.tagi.mixture import MixtureReLU, MixtureSigmoid, MixtureTanh
from dptrain.tagi.output_updater import OutputUpdater
from dptrain.tagi.pooling import AvgPool2d, MaxPool2d
from dptrain.tagi.predictive import HeteroscedasticPrediction, split_heteros
from dptrain.tagi.remax import Remax
from dptrain.tagi.rmsnorm import RMSNorm
from dptrain.tagi.sequential import Sequential
from dptrain.tagi.slstm import SLSTM, SLinear
from dptrain.tagi.softmax import ClosedFormSoftmax, Softmax
from dptrain.tagi.states import DeltaStates, HiddenStates

_LAZY = {"DDPSequential": "dptrain.tagi.ddp", "DDPConfig": "dptrain.tagi.ddp"}
"""Names served on first use (PEP 562): importing their module starts the process-group code
(`dptrain.runtime`), which layers and single-process users never need."""


def __getattr__(name: str) -> object:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AvgPool2d",
    "BatchNorm2d",
    "ClosedFormSoftmax",
    "Conv2d",
    "ConvTranspose2d",
    "DDPConfig",
    "DDPSequential",
    "DeltaStates",
    "Embedding",
    "EvenExp",
    "HRCSoftmax",
    "HeteroscedasticPrediction",
    "HiddenStates",
    "Layer",
    "LayerBlock",
    "LSTM",
    "LayerNorm",
    "LeakyReLU",
    "Linear",
    "MaxPool2d",
    "MixtureReLU",
    "MixtureSigmoid",
    "MixtureTanh",
    "MultiheadAttention",
    "OutputUpdater",
    "Parallel",
    "ParamLayer",
    "RMSNorm",
    "ReLU",
    "Remax",
    "ResNetBlock",
    "SLSTM",
    "SLinear",
    "Sequential",
    "Sigmoid",
    "Softmax",
    "Softplus",
    "Tanh",
    "cap_factor",
    "manual_seed",
    "split_heteros",
]
