"""The MLPs: tagi-mlp and torch-mlp, two ReLU layers of `--hidden` units on flat inputs (an
image is flattened channel-major by the first layer)."""

from __future__ import annotations

from torch import nn

from dptrain.errors import ConfigError
from dptrain.models.shapes import flat_size, gains
from dptrain.models.spec import Family, ModelOptions, ModelSpec
from dptrain.tagi import EvenExp, Linear, ReLU, Sequential


def tagi_mlp(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions):
    """Two ReLU layers of width `hidden`; image inputs are flattened (C-major) by the first
    Linear layer."""
    gw, gb = gains(options)
    width, layers = flat_size(input_shape), []
    for _ in range(2):
        layers += [Linear(width, options.hidden, gain_weight=gw, gain_bias=gb), ReLU()]
        width = options.hidden
    if options.heteroscedastic:
        return Sequential(*layers, Linear(width, 2 * num_outputs, gain_weight=gw, gain_bias=gb),
                          EvenExp(), dtype=options.dtype)
    return Sequential(*layers, Linear(width, num_outputs, gain_weight=gw, gain_bias=gb),
                      dtype=options.dtype)



def torch_mlp(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions):
    """Flatten -> hidden -> hidden -> num_outputs with ReLU (and Dropout if asked)."""
    hidden, dropout = options.hidden, options.dropout
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {dropout}")

    def hidden_block(n_in: int) -> list[nn.Module]:
        return [nn.Linear(n_in, hidden), nn.ReLU(), *([nn.Dropout(dropout)] if dropout else [])]

    return nn.Sequential(nn.Flatten(), *hidden_block(flat_size(input_shape)),
                         *hidden_block(hidden), nn.Linear(hidden, num_outputs))



FAMILY = Family(
    name="mlp",
    models=(ModelSpec("tagi-mlp", "tagi", tagi_mlp, "TAGI MLP, 2 ReLU layers of --hidden units",
                      options=("hidden", "gain_weight", "gain_bias", "heteroscedastic")),
            ModelSpec("torch-mlp", "torch", torch_mlp,
                      "torch MLP, 2 ReLU layers of --hidden units",
                      options=("hidden", "dropout"))),
    data=frozenset({"features", "images", "series"}),
    options=("hidden", "dropout", "gain_weight", "gain_bias", "heteroscedastic"))
