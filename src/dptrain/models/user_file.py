"""Your own model for `dptrain train --model PATH.py:FUNCTION`.

    # my_model.py
    from dptrain.tagi import Conv2d, Linear, ReLU, AvgPool2d, Sequential

    def small_cnn(input_shape, num_outputs):
        c, h, w = input_shape
        return Sequential(Conv2d(c, 8, 3, padding=1), ReLU(), AvgPool2d(2),
                          Linear(8 * (h // 2) * (w // 2), num_outputs))

`FUNCTION(input_shape, num_outputs)` returns a `dptrain.tagi.Sequential` (trained by TAGI) or a
`torch.nn.Module` (trained with Adam and the task's loss). `num_outputs` is what the learner
needs: for TAGI classification the hierarchical-softmax width (11 for 10 classes), for torch
classification the number of classes, for regression the number of targets. The learner kind
is only known from what FUNCTION returns, so for classification it is first called with the
number of classes and, if it returns a TAGI network, called again with the softmax width (build
your model from the arguments only). Each problem is one line (a ConfigError) raised by
`load_user_model`, which the command line calls before any worker starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from dptrain import user_code
from dptrain.errors import ConfigError
from dptrain.models.spec import num_outputs
from dptrain.tagi import Sequential, manual_seed
from dptrain.user_code import file_sha256, is_code_spec

is_model_file = is_code_spec
"""True for `PATH.py:FUNCTION` (as opposed to a built-in model's name)."""
model_file_sha256 = file_sha256
"""sha256 of a model file (its path, or the `PATH.py:FUNCTION` spelling); None for a name."""


def load_function(spec: str) -> Callable[..., Any]:
    """The model-building function `spec` names, imported from its file."""
    return user_code.load_function(spec, option="--model", what="model file")


class UserModel(NamedTuple):
    model: Any
    kind: str
    """"tagi" or "torch"."""
    num_outputs: int


def load_user_model(spec: str, input_shape: tuple[int, ...], *, task: str,
                    num_classes: int | None, num_targets: int | None,
                    seed: int | None = None, heteroscedastic: bool = False,
                    input_dtype: torch.dtype = torch.float32) -> UserModel:
    """Build the user's model for this dataset and check it fits (type and output width).
    With `heteroscedastic` (TAGI regression), a TAGI model outputs (mean, noise) pairs: twice
    the targets. `input_dtype`: the data's (int64 for token ids, which an embedding needs);
    a torch classifier may output (batch, positions, classes) for per-position targets."""
    fn = load_function(spec)
    torch_width = num_outputs("torch", task, num_classes, num_targets)

    def call(width: int) -> Any:
        if seed is not None:
            torch.manual_seed(seed)
            manual_seed(seed)
        try:
            return fn(tuple(input_shape), width)
        except Exception as err:
            raise ConfigError(f"--model {spec}: {type(err).__name__} while building the model "
                              f"for inputs {tuple(input_shape)}, {width} outputs: {err}") from None

    model = call(torch_width)
    if isinstance(model, Sequential):
        kind = "tagi"
        width = num_outputs("tagi", task, num_classes, num_targets)
        if heteroscedastic:
            width *= 2
        if width != torch_width:
            model = call(width)
    elif isinstance(model, torch.nn.Module):
        kind, width = "torch", torch_width
        refuse_distributed_tensors(model, spec)
    else:
        raise ConfigError(f"--model {spec}: returned a {type(model).__name__}; expected a "
                          f"dptrain.tagi.Sequential or a torch.nn.Module")
    got = output_width(model, kind, input_shape, spec, input_dtype)
    if got != width:
        need = ("the hierarchical-softmax width for "
                f"{num_classes} classes" if kind == "tagi" and task == "classification"
                else f"{num_classes} classes" if task == "classification"
                else f"(mean, noise) pairs for {num_targets} target(s)" if width != torch_width
                else f"{num_targets} target(s)")
        raise ConfigError(f"--model {spec}: the model outputs {got} values per sample, the "
                          f"learner needs {width} ({need}, passed as num_outputs)")
    return UserModel(model, kind, width)


def refuse_distributed_tensors(model: torch.nn.Module, spec: str) -> None:
    """A model whose parameters are already DTensors is sharded for tensor (or other model)
    parallelism, which dptrain does not do: it replicates a plain module on every rank and
    only splits the data. Say so now, in one line, rather than fail inside the first step."""
    if not torch.distributed.is_available():  # no DTensor without torch.distributed
        return
    from torch.distributed.tensor import DTensor

    sharded = next((name for name, p in model.named_parameters() if isinstance(p, DTensor)),
                   None)
    if sharded is not None:
        raise ConfigError(f"--model {spec}: parameter {sharded!r} is a DTensor; dptrain does "
                          f"data parallelism only and wraps a plain torch.nn.Module in DDP or "
                          f"FSDP itself (return the module before distributing it; for tensor, "
                          f"pipeline or context parallelism use torch.distributed.tensor, "
                          f"torch.distributed.pipelining or torchtitan)")


def output_width(model: Any, kind: str, input_shape: tuple[int, ...], spec: str,
                 input_dtype: torch.dtype = torch.float32) -> int:
    """Width of the model's output on a batch of two zero samples (eval mode, no update): its
    last dimension, for (batch, outputs) or a torch model's per-position (batch, positions,
    outputs)."""
    x = torch.zeros(2, *input_shape, dtype=input_dtype if kind == "torch" else None)
    try:
        if kind == "tagi":
            model.eval()
            mu, _ = model(x.to(model.dtype))
            model.train()
            out = mu
        else:
            was_training = model.training
            model.eval()
            with torch.no_grad():
                out = model(x)
            model.train(was_training)
    except Exception as err:
        raise ConfigError(f"--model {spec}: the model fails on inputs of shape "
                          f"{tuple(input_shape)}: {type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}") from None
    per_position = kind == "torch" and out.dim() == 3 and len(input_shape) == 1 \
        and out.shape[1] == input_shape[0]
    if out.dim() != 2 and not per_position:
        raise ConfigError(f"--model {spec}: the model's output has shape {tuple(out.shape)} for "
                          f"a batch of 2; expected (batch, outputs), or (batch, positions, "
                          f"classes) for windows of {input_shape[0] if input_shape else 'N'} "
                          f"positions")
    return int(out.shape[-1])
