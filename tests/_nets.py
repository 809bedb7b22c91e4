"""Small networks the tests build often, from the registry's builders."""

from __future__ import annotations

from dptrain.models import ModelOptions, build_model
from dptrain.tagi import Sequential


def tagi_mlp(input_dim: int, output_dim: int, *, hidden: int = 128) -> Sequential:
    """The registry's tagi-mlp (two ReLU layers of `hidden`) on flat inputs of `input_dim`."""
    return build_model("tagi-mlp", (input_dim,), output_dim, ModelOptions(hidden=hidden))
