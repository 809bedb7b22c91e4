"""The built-in models of both learner kinds, each sized from the dataset it will train on.

    from dptrain.learners.models import ModelOptions, build_model, get_model

    spec = get_model("tagi-cnn")                      # kind "tagi", defaults, input check
    net = build_model("tagi-cnn", (1, 28, 28), 11)    # a dptrain.tagi.Sequential
    cnn = build_model("torch-resnet18", (3, 32, 32), 10, ModelOptions(width=8))  # nn.Module

`num_outputs` is the output width the learner needs: the hierarchical-softmax width for TAGI
classification (`HRCSoftmax(num_classes).num_outputs`, 11 for 10 classes), the number of classes
for torch classification, the number of targets for regression. Every builder accepts flat
`(N,)` inputs and images `(C, H, W)`; the image networks need images (or flat rows of a square
image, e.g. the 64 pixels of the 8x8 digits), and the CNNs pick their
kernel sizes and pooling so that 8x8, 28x28 and 32x32 inputs (and sizes in between) all work.
`check_input(name, input_shape)` says, in one line, why a model cannot take a shape, so the
command line can refuse a dataset before any worker starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from dptrain.errors import ConfigError
from dptrain.learners.gpt import GPT, GPTConfig
from dptrain.tagi import (
    AvgPool2d,
    BatchNorm2d,
    Conv2d,
    Embedding,
    EvenExp,
    HRCSoftmax,
    LSTM,
    LayerBlock,
    Linear,
    MixtureReLU,
    MultiheadAttention,
    Parallel,
    RMSNorm,
    ReLU,
    ResNetBlock,
    Sequential,
)

Kind = Literal["tagi", "torch"]


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """What a user may change about a built-in model without writing one."""

    hidden: int = 128
    """Width of the hidden layers of the MLPs."""
    dropout: float = 0.0
    """torch-mlp: dropout probability after each hidden layer (it draws from torch's global
    generator, per rank, while training)."""
    width: int = 64
    """ResNets: channels of the first stage (the stages have width, 2, 4 and 8 times width);
    64 is the usual ResNet18, smaller values make tiny networks for tests."""
    gain_weight: float | None = None
    """TAGI: scale of the initial weight standard deviations (None: the model's default)."""
    gain_bias: float | None = None
    """TAGI: the same for biases (None: as gain_weight)."""
    dtype: torch.dtype = torch.float32
    """TAGI: float32 or float64."""
    heteroscedastic: bool = False
    """TAGI regression (tagi-mlp, tagi-lstm): 2 outputs per target, (mean, noise) pairs through
    EvenExp."""
    series_embedding: int = 0
    """tagi-lstm: width of an Embedding of the series id, which then follows each window's
    values in the input (0: no id)."""
    num_series: int = 0
    """tagi-lstm with series_embedding: how many series (rows of the embedding table)."""
    num_features: int = 1
    """tagi-lstm on flat windows: values per time step (a series' value and its known
    covariates), so that a flat input of L · num_features values is L steps."""
    layers: int = 4
    """torch-gpt, tagi-gpt: transformer blocks."""
    heads: int = 4
    """torch-gpt, tagi-gpt: attention heads per block (width must be a multiple)."""
    vocab_size: int = 0
    """tagi-gpt: the tokens of the vocabulary (rows of its embedding; its output width is the
    hierarchical softmax's for that many classes)."""


@dataclass(frozen=True)
class ModelSpec:
    """One entry of the registry."""

    name: str
    kind: Kind
    build: Callable[[tuple[int, ...], int, ModelOptions], Any]
    summary: str
    needs_image: bool = False
    takes_windows: bool = False
    """The model reads its input as a sequence: (lookback,) or (lookback, features)."""
    takes_tokens: bool = False
    """A language model: its inputs are windows of token ids (text:, tokens:), its targets the
    next token at every position."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """Training defaults this model was tuned with (batch_size, sigma_v, gain, ...), used where
    the user gave no value."""


# ------------------------------------------------------------------------------ shape helpers
def image_shape(shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(C, H, W) of an image sample: the shape itself, or for flat rows of n values a square
    grey image (n = s²) or a square colour one (n = 3·s², channel-major); None otherwise."""
    if len(shape) == 3:
        c, h, w = shape
        return c, h, w
    if len(shape) != 1:
        return None
    n = shape[0]
    for c in (1, 3):
        side = math.isqrt(n // c)
        if n % c == 0 and side * side * c == n and side > 1:
            return c, side, side
    return None


def _image(shape: tuple[int, ...]) -> tuple[int, int, int]:
    image = image_shape(shape)
    if image is None:
        raise ConfigError(f"inputs of shape {shape} are not images")
    return image


def _flat_size(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _gains(options: ModelOptions, default: float = 1.0) -> tuple[float, float]:
    gw = options.gain_weight if options.gain_weight is not None else default
    gb = options.gain_bias if options.gain_bias is not None else gw
    return gw, gb


# ---------------------------------------------------------------------------- TAGI builders
def tagi_mlp(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions):
    """Two ReLU layers of width `hidden`; image inputs are flattened (C-major) by the first
    Linear layer."""
    gw, gb = _gains(options)
    width, layers = _flat_size(input_shape), []
    for _ in range(2):
        layers += [Linear(width, options.hidden, gain_weight=gw, gain_bias=gb), ReLU()]
        width = options.hidden
    if options.heteroscedastic:
        return Sequential(*layers, Linear(width, 2 * num_outputs, gain_weight=gw, gain_bias=gb),
                          EvenExp(), dtype=options.dtype)
    return Sequential(*layers, Linear(width, num_outputs, gain_weight=gw, gain_bias=gb),
                      dtype=options.dtype)


def tagi_lstm(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions):
    """pytagi's forecasting network: LSTM(1, hidden, L) - LSTM(hidden, hidden, L) -
    Linear(hidden·L, num_outputs), for windows of L values of one series (flat (L,) inputs,
    or (L, features) for several values per time step).

    With `series_embedding` E, the input is the L values then the series id, (L + 1,): a
    Parallel block sends the values through the LSTMs and the id through
    Embedding(num_series, E), and the head reads both, Linear(hidden·L + E, num_outputs)
    (docs/forecasting.md, Series embedding, says why there)."""
    if options.series_embedding:
        return _tagi_lstm_with_embedding(input_shape, num_outputs, options)
    seq_len, features = input_shape[0], (input_shape[1] if len(input_shape) == 2 else 1)
    if len(input_shape) == 1 and options.num_features > 1:
        seq_len, features = input_shape[0] // options.num_features, options.num_features
    return Sequential(*_lstm_pair(features, seq_len, options),
                      *_head(options.hidden * seq_len, num_outputs, options),
                      dtype=options.dtype)


def _head(width: int, num_outputs: int, options: ModelOptions) -> list:
    """The Linear head; heteroscedastic: a (mean, noise) pair per output through EvenExp,
    the noise variance learned per input by AGVI (docs/tagi.md)."""
    gw, gb = _gains(options)
    if options.heteroscedastic:
        return [Linear(width, 2 * num_outputs, gain_weight=gw, gain_bias=gb), EvenExp()]
    return [Linear(width, num_outputs, gain_weight=gw, gain_bias=gb)]


def _lstm_pair(features: int, seq_len: int, options: ModelOptions) -> list[LSTM]:
    gw, gb = _gains(options)
    return [LSTM(features, options.hidden, seq_len, gain_weight=gw, gain_bias=gb),
            LSTM(options.hidden, options.hidden, seq_len, gain_weight=gw, gain_bias=gb)]


def _tagi_lstm_with_embedding(input_shape: tuple[int, ...], num_outputs: int,
                              options: ModelOptions) -> Sequential:
    if len(input_shape) != 1 or input_shape[0] < 2 or options.num_series < 1:
        raise ConfigError(f"tagi-lstm with a series embedding takes windows of values followed "
                          f"by their series id, (lookback + 1,), of num_series >= 1 series; "
                          f"got inputs {tuple(input_shape)} and num_series "
                          f"{options.num_series}")
    features = options.num_features
    seq_len, width = (input_shape[0] - 1) // features, options.series_embedding
    # The Embedding's own scale, not the gains: its rows are the whole signal it passes on.
    ids = Embedding(options.num_series, width)
    return Sequential(Parallel(LayerBlock(*_lstm_pair(features, seq_len, options)), ids,
                               input_sizes=(seq_len * features, 1)),
                      *_head(options.hidden * seq_len + width, num_outputs, options),
                      dtype=options.dtype)


def _cnn_plan(h: int, w: int) -> list[tuple[int, int, int, int]]:
    """(conv kernel, conv padding, pool kernel, pool stride) of the two stages.

    pytagi's MNIST CNN (kernels 4 and 5, padding 1 then 0, 3x3 pools with stride 2) for inputs
    of 24 pixels and more; on smaller images it would shrink them to nothing, so there it is
    scaled down to 3x3 'same' convolutions and 2x2 pools (8x8 -> 4x4 -> 2x2)."""
    if min(h, w) >= 24:
        return [(4, 1, 3, 2), (5, 0, 3, 2)]
    if min(h, w) >= 4:
        return [(3, 1, 2, 2), (3, 1, 2, 2)]
    raise ConfigError(f"the CNNs need images of at least 4x4 pixels, got {h}x{w}")


def _stage_out(size: int, conv_k: int, conv_p: int, pool_k: int, pool_s: int) -> int:
    size = size + 2 * conv_p - conv_k + 1
    return (size - pool_k) // pool_s + 1


CNN_GAIN = 0.5
"""tagi-cnn's default gain of the initial standard deviations on images of 24 pixels and more
(pytagi's MNIST layout). At pytagi's gain of 1, 12 of 40 runs on 28x28 digits (seeds 0-19,
σ_v 0.05 and 0.2, 3 epochs) and 4 of 20 on 32x32 colour digits ended at chance: the first few
updates drive every unit of the second convolution's ReLU negative for every input, which no
later update can undo (docs/tagi.md, Collapsed runs). At 0.5: none, and a lower median test
error. The small-image layout (8x8 digits) never collapsed at gain 1 and learns faster with
it, so it keeps 1 (bench/tagi/tagi_stability.py)."""


def cnn_default_gain(input_shape: tuple[int, ...]) -> float:
    """tagi-cnn's gain when the options set none: `CNN_GAIN` from 24 pixels up, else 1."""
    _, h, w = _image(input_shape)
    return CNN_GAIN if min(h, w) >= 24 else 1.0


def tagi_cnn(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions,
             default_gain: float | None = None):
    """pytagi's classification CNN: Conv2d(C,16) - ReLU - AvgPool2d - Conv2d(16,32) - ReLU -
    AvgPool2d - Linear(., 100) - ReLU - Linear(100, num_outputs) (hidden 64 on small images),
    its initial standard deviations scaled by `CNN_GAIN` on images of 24 pixels and more unless
    the options (or `default_gain`) set a gain."""
    c, h, w = _image(input_shape)
    hidden = 100 if min(h, w) >= 24 else 64
    if default_gain is None:
        default_gain = cnn_default_gain(input_shape)
    gw, gb = _gains(options, default_gain)
    layers: list[Any] = []
    channels = c
    for out_c, (k, p, pk, ps) in zip((16, 32), _cnn_plan(h, w)):
        first = not layers
        layers += [Conv2d(channels, out_c, k, padding=p, gain_weight=gw, gain_bias=gb,
                          **({"in_width": w, "in_height": h} if first else {})),
                   ReLU(), AvgPool2d(pk, stride=ps)]
        channels = out_c
        h, w = _stage_out(h, k, p, pk, ps), _stage_out(w, k, p, pk, ps)
    return Sequential(*layers, Linear(channels * h * w, hidden, gain_weight=gw, gain_bias=gb),
                      ReLU(), Linear(hidden, num_outputs, gain_weight=gw, gain_bias=gb),
                      dtype=options.dtype)


def tagi_cnn_pytagi(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions):
    """tagi-cnn exactly as pytagi initialises it (gain 1), for comparisons with pytagi: 6 of 20
    runs collapse to chance on 28x28 digits (docs/tagi.md, Collapsed runs)."""
    return tagi_cnn(input_shape, num_outputs, options, default_gain=1.0)


IMAGENET_STEM_FROM = 128
"""The ResNets take ImageNet's stem (a strided conv and a pool: 4x smaller maps) for images of
at least this many pixels a side, CIFAR's (one 3x3 conv at full size) below."""


def tagi_resnet18(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions):
    """pytagi's ResNet18: every 3x3 conv (no bias) followed by MixtureReLU then BatchNorm2d;
    the first block of stages 2-4 has stride 2 with padding_type 2 and a projection shortcut
    Conv2d(k=2, stride=2) + MixtureReLU + BatchNorm2d; no activation after the sum; AvgPool2d
    over the last feature map, Linear(8·width, num_outputs). The stem is pytagi's CIFAR-10 one
    (3x3 conv; 4x4 last map on 32x32) below `IMAGENET_STEM_FROM` pixels, its ImageNet one
    above: Conv2d(k=6, stride 2, padding 2) + MixtureReLU + BatchNorm2d + AvgPool2d(3, stride 2,
    padding 1 right and bottom); 7x7 last map on 224x224."""
    c, h, w = _image(input_shape)
    gw, gb = _gains(options)

    def conv(cin: int, cout: int, k: int = 3, stride: int = 1, padding: int = 1,
             padding_type: int = 1, **extra: Any) -> list[Any]:
        return [Conv2d(cin, cout, k, bias=False, stride=stride, padding=padding,
                       padding_type=padding_type, gain_weight=gw, **extra),
                MixtureReLU(), BatchNorm2d(cout)]

    def block(cin: int, cout: int, stride: int) -> Any:
        pt = 2 if stride == 2 else 1
        main = LayerBlock(*conv(cin, cout, stride=stride, padding_type=pt), *conv(cout, cout))
        if stride == 1 and cin == cout:
            return ResNetBlock(main)
        return ResNetBlock(main, LayerBlock(*conv(cin, cout, k=2, stride=2, padding=0)))

    base = options.width
    if min(h, w) >= IMAGENET_STEM_FROM:
        layers: list[Any] = [*conv(c, base, k=6, stride=2, padding=2, in_width=w, in_height=h),
                             AvgPool2d(3, stride=2, padding=1, padding_type=2)]
        final_hw = h // 32
    else:
        layers = conv(c, base, in_width=w, in_height=h)
        final_hw = h // 8
    cin = base
    for stage, mult in enumerate((1, 2, 4, 8)):
        cout = base * mult
        stride = 1 if stage == 0 else 2
        layers += [block(cin, cout, stride), block(cout, cout, 1)]
        cin = cout
    return Sequential(*layers, AvgPool2d(final_hw),
                      Linear(cin, num_outputs, gain_weight=gw, gain_bias=gb),
                      dtype=options.dtype)


# --------------------------------------------------------------------------- torch builders
class Reshape(nn.Module):
    """(B, ...) -> (B, *shape): lets the image networks take flat rows too."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], *self.shape)

    def extra_repr(self) -> str:
        return f"shape={self.shape}"


def torch_mlp(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions):
    """Flatten -> hidden -> hidden -> num_outputs with ReLU (and Dropout if asked)."""
    hidden, dropout = options.hidden, options.dropout
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {dropout}")

    def hidden_block(n_in: int) -> list[nn.Module]:
        return [nn.Linear(n_in, hidden), nn.ReLU(), *([nn.Dropout(dropout)] if dropout else [])]

    return nn.Sequential(nn.Flatten(), *hidden_block(_flat_size(input_shape)),
                         *hidden_block(hidden), nn.Linear(hidden, num_outputs))


def torch_cnn(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions,
              channels: int = 16):
    """Two 3x3 conv + BatchNorm + ReLU blocks and a linear head. On images of 16 pixels and
    more a 2x2 max-pool follows the first block; the last pool brings the map to 4x4 (8x8
    digits: a 2x2 max-pool, the layout of the original digits recipe)."""
    c, h, w = _image(input_shape)
    if min(h, w) < 4:
        raise ConfigError(f"torch-cnn needs images of at least 4x4 pixels, got {h}x{w}")
    layers: list[nn.Module] = [Reshape((c, h, w)),
                               nn.Conv2d(c, channels, 3, padding=1), nn.BatchNorm2d(channels),
                               nn.ReLU()]
    if min(h, w) >= 16:
        layers.append(nn.MaxPool2d(2))
    layers += [nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels),
               nn.ReLU(), nn.AdaptiveMaxPool2d(4),
               nn.Flatten(), nn.Linear(2 * channels * 16, num_outputs)]
    return nn.Sequential(*layers)


class BasicBlock(nn.Module):
    """The ResNet18 block: two 3x3 conv + BatchNorm, ReLU after the first and after the sum;
    a 1x1 strided conv + BatchNorm shortcut where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout))
        self.short = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.main(x) + self.short(x))


class Bottleneck(nn.Module):
    """The ResNet50 block: 1x1 (to `mid`), 3x3 (strided), 1x1 (to 4·mid) conv + BatchNorm, ReLU
    between and after the sum; a 1x1 strided conv + BatchNorm shortcut where the shape
    changes."""

    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = 4 * mid
        self.main = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(mid),
            nn.ReLU(), nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.short = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.main(x) + self.short(x))


def _torch_stem(c: int, h: int, w: int, base: int) -> list[nn.Module]:
    """ImageNet's stem (7x7 stride-2 conv, 3x3 stride-2 max-pool) from `IMAGENET_STEM_FROM`
    pixels up, CIFAR's (3x3 conv, no pool) below; BatchNorm and ReLU after the conv."""
    if min(h, w) >= IMAGENET_STEM_FROM:
        return [Reshape((c, h, w)), nn.Conv2d(c, base, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(base), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1)]
    return [Reshape((c, h, w)), nn.Conv2d(c, base, 3, padding=1, bias=False),
            nn.BatchNorm2d(base), nn.ReLU()]


def torch_resnet18(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions):
    """The usual ResNet18: the stem (`_torch_stem`: CIFAR's on small images, ImageNet's on
    large ones), stages of width 1, 2, 4, 8 x `width` with strides 1, 2, 2, 2, two blocks each,
    global average pool, linear head."""
    c, h, w = _image(input_shape)
    base = options.width
    layers = _torch_stem(c, h, w, base)
    cin = base
    for stage, mult in enumerate((1, 2, 4, 8)):
        cout = base * mult
        layers += [BasicBlock(cin, cout, 1 if stage == 0 else 2), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_outputs)]
    return nn.Sequential(*layers)


def torch_resnet50(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions):
    """The usual ResNet50: the stem as torch-resnet18's, bottleneck stages of 3, 4, 6, 3 blocks
    (widths 1, 2, 4, 8 x `width`, out 4x that), strides 1, 2, 2, 2, global average pool,
    linear head (25.6 M parameters on ImageNet)."""
    c, h, w = _image(input_shape)
    base = options.width
    layers = _torch_stem(c, h, w, base)
    cin = base
    for stage, (mult, blocks) in enumerate(zip((1, 2, 4, 8), (3, 4, 6, 3))):
        mid = base * mult
        for i in range(blocks):
            layers.append(Bottleneck(cin, mid, 2 if stage and not i else 1))
            cin = 4 * mid
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_outputs)]
    return nn.Sequential(*layers)


# ------------------------------------------------------------------------------ the registry
_RESNET_DEFAULTS = {"batch_size": 64, "sigma_v": 0.05, "gain": 0.083}
# heteroscedastic: the observation noise is learned per input (AGVI), so that forecast
# intervals are calibrated on data whose noise no one knows (docs/forecasting.md); sigma_v
# serves the --no-heteroscedastic network. time_features auto: the calendar features the
# time column gives (none without dates), as forecasters of the DeepAR line add them by
# default: a lookback cannot see the weekday that shapes hourly load (on `hourly` rolled
# daily, ND 6 % below the seasonal naive's without them, 19 % with them). lookback 48 (on a
# series only: model_defaults): two days; over the whole test part of `hourly` its ND is
# 36-37 % below the naive's for seeds 0-2, a day's 9-29 % (docs/forecasting.md)
_LSTM_DEFAULTS = {"hidden": 8, "batch_size": 16, "sigma_v": 0.1, "heteroscedastic": True,
                  "time_features": "auto", "lookback": 48}
def torch_gpt(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions
              ) -> nn.Module:
    """A GPT over a vocabulary of `num_outputs` tokens whose context is the data's window."""
    return GPT(GPTConfig(vocab_size=num_outputs, block_size=input_shape[0],
                         layers=options.layers, heads=options.heads, width=options.width,
                         dropout=options.dropout))


def tagi_gpt(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions
             ) -> Sequential:
    """A decoder-only TAGI transformer (docs/tagi.md, A TAGI GPT): Embedding, then per block
    RMSNorm → causal MultiheadAttention (RoPE, softmax weights) and RMSNorm → MLP (4x wide,
    ReLU), each in a residual block, a final RMSNorm and a per-position head of the
    hierarchical softmax's `num_outputs` for `options.vocab_size` tokens. No position embedding: RoPE places tokens.
    Widths, heads and blocks are torch-gpt's flags (`--width`, `--heads`, `--layers`)."""
    if options.vocab_size < 2:
        raise ConfigError(f"tagi-gpt needs the vocabulary's size (>= 2 tokens), got "
                          f"{options.vocab_size}")
    e, heads, context = options.width, options.heads, input_shape[0]
    if e % heads or (e // heads) % 2:
        raise ConfigError(f"tagi-gpt: --width {e} must be a multiple of --heads {heads} with an "
                          f"even head size (RoPE rotates pairs of features)")
    gw, gb = _gains(options)

    def linear(inputs: int, outputs: int) -> Linear:
        return Linear(inputs, outputs, gain_weight=gw, gain_bias=gb, per_position=True)

    layers: list[Any] = [Embedding(options.vocab_size, e)]
    for _ in range(options.layers):
        # scores scaled by 1/sqrt(head size), as a torch transformer's: cuTAGI's unscaled
        # scores have variances in the hundreds at 16 features a head, and the network
        # learned less on tiny Shakespeare; weights by the softmax's moments, not Remax's,
        # whose ReLU floors every negative score: with Remax the validation loss rose as it
        # trained (docs/results.md, A TAGI GPT)
        layers.append(ResNetBlock(LayerBlock(
            RMSNorm(e), MultiheadAttention(e, heads, use_rope=True, max_seq_len=context,
                                           gain_weight=gw, gain_bias=gb,
                                           score_scale=1 / math.sqrt(e // heads),
                                           weights="softmax"))))
        layers.append(ResNetBlock(LayerBlock(RMSNorm(e), linear(e, 4 * e), ReLU(),
                                             linear(4 * e, e))))
    return Sequential(*layers, RMSNorm(e), linear(e, num_outputs), dtype=options.dtype)


# nanoGPT's recipe for its small character-level Shakespeare model (karpathy/nanoGPT,
# config/train_shakespeare_char.py, at the sizes of its CPU run): AdamW with beta2 0.99 (few
# tokens per step), decay on matrices only, 100 warm-up steps, cosine to lr / 10, clipping 1.
_GPT_DEFAULTS = {"width": 128, "batch_size": 12, "optimizer": "adamw", "lr": 1e-3,
                 "betas": "0.9,0.99", "weight_decay": 0.1, "schedule": "cosine",
                 "schedule_unit": "steps", "warmup": 100, "min_lr": 1e-4, "clip_grad_norm": 1.0}
# torch-gpt's sizes and batch; TAGI has no learning rate or optimizer to set. sigma_v: each
# next token is one noisy draw, so the ±1 observations of the hierarchical softmax are noisy;
# of 1, 2, 4, 8 and 12, 4 gave the lowest validation loss on tiny Shakespeare.
_TAGI_GPT_DEFAULTS = {"width": 128, "batch_size": 12, "sigma_v": 4.0}
MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    ModelSpec("tagi-mlp", "tagi", tagi_mlp, "TAGI MLP, 2 ReLU layers of --hidden units"),
    ModelSpec("tagi-lstm", "tagi", tagi_lstm, "TAGI LSTM for time series (pytagi's "
              "forecasting network: 2 LSTM layers of --hidden units, a Linear head)",
              takes_windows=True, defaults=_LSTM_DEFAULTS),
    ModelSpec("tagi-cnn", "tagi", tagi_cnn, "TAGI CNN (pytagi's classification CNN, initial "
              "standard deviations x0.5 on 24 pixels and more)", needs_image=True),
    ModelSpec("tagi-cnn-pytagi", "tagi", tagi_cnn_pytagi, "TAGI CNN exactly as pytagi "
              "initialises it (6 of 20 runs collapse on 28x28 digits)", needs_image=True),
    ModelSpec("tagi-resnet18", "tagi", tagi_resnet18, "TAGI ResNet18 (pytagi's CIFAR-10 one)",
              needs_image=True, defaults=_RESNET_DEFAULTS),
    ModelSpec("torch-mlp", "torch", torch_mlp, "torch MLP, 2 ReLU layers of --hidden units"),
    ModelSpec("torch-cnn", "torch", torch_cnn, "torch CNN, 2 conv + BatchNorm blocks",
              needs_image=True),
    ModelSpec("torch-resnet18", "torch", torch_resnet18, "torch ResNet18 (CIFAR or ImageNet "
              "stem by image size)", needs_image=True),
    ModelSpec("torch-resnet50", "torch", torch_resnet50, "torch ResNet50 (CIFAR or ImageNet "
              "stem by image size)", needs_image=True),
    ModelSpec("torch-gpt", "torch", torch_gpt, "torch GPT language model (GPT-2's decoder: "
              "--layers blocks of --heads causal attention heads, --width wide, context "
              "--block-size)", takes_tokens=True, defaults=_GPT_DEFAULTS),
    ModelSpec("tagi-gpt", "tagi", tagi_gpt, "TAGI GPT language model (--layers blocks of "
              "RMSNorm, causal attention with RoPE over --heads heads and a ReLU MLP, --width "
              "wide, context --block-size; a hierarchical softmax over the vocabulary)",
              takes_tokens=True, defaults=_TAGI_GPT_DEFAULTS),
)}
TAGI_MODELS = tuple(n for n, s in MODELS.items() if s.kind == "tagi")
TORCH_MODELS = tuple(n for n, s in MODELS.items() if s.kind == "torch")


def get_model(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; built-in: {', '.join(MODELS)}, or "
                          f"PATH.py:FUNCTION for your own")
    return MODELS[name]


def check_input(name: str, input_shape: tuple[int, ...]) -> None:
    """Raise a one-line ConfigError if model `name` cannot take samples of `input_shape`."""
    spec = get_model(name)
    if spec.takes_tokens and len(input_shape) != 1:
        raise ConfigError(f"model {name} takes windows of token ids, (block-size,); the "
                          f"dataset's inputs have shape {tuple(input_shape)} (use text:PATH or "
                          f"tokens:DIR)")
    if spec.takes_windows and len(input_shape) > 2:
        raise ConfigError(f"model {name} takes windows of a time series, (lookback,) or "
                          f"(lookback, features); the dataset's inputs have shape "
                          f"{tuple(input_shape)} (use a time series: sine, seasonal, "
                          f"series:PATH.csv)")
    if not spec.needs_image:
        return
    image = image_shape(tuple(input_shape))
    if image is None:
        raise ConfigError(f"model {name} takes images (channels, height, width, or flat rows "
                          f"of a square image); the dataset's inputs have shape "
                          f"{tuple(input_shape)} (use a tagi-mlp or torch-mlp model)")
    h, w = image[1:]
    smallest = 8 if "resnet" in name else 4
    step = 32 if min(h, w) >= IMAGENET_STEM_FROM else 8
    if min(h, w) < smallest or ("resnet" in name and (h % step or w % step)):
        need = (f"a multiple of {step} pixels on each side (three stride-2 stages"
                f"{' after a 4x smaller stem' if step == 32 else ''})"
                if "resnet" in name else f"at least {smallest}x{smallest} pixels")
        raise ConfigError(f"model {name} needs images of {need}; the dataset's are {h}x{w}")


def num_outputs(kind: Kind, task: str, num_classes: int | None, num_targets: int | None
                ) -> int:
    """The output width a learner of `kind` needs: the hierarchical-softmax width for TAGI
    classification (11 for 10 classes), the number of classes for torch classification, the
    number of targets for regression."""
    if task != "classification":
        return int(num_targets)
    if kind == "tagi":
        return HRCSoftmax(num_classes).num_outputs
    return int(num_classes)


def build_model(name: str, input_shape: tuple[int, ...], num_outputs: int,
                options: ModelOptions | None = None) -> Any:
    """A fresh model `name` for samples of `input_shape` with `num_outputs` outputs; seed
    torch (and `dptrain.tagi.manual_seed` for TAGI models) first for a reproducible init."""
    check_input(name, tuple(input_shape))
    return get_model(name).build(tuple(input_shape), num_outputs, options or ModelOptions())
