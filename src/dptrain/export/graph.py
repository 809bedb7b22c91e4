"""The graph an export holds: a run's model with its input normalisation and output decoding,
as plain tensor arithmetic (`RunGraph`), and what tracing it needs kept clean."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dptrain.errors import ExportError
from dptrain.inference import TrainedRun
from dptrain.tagi import base, lstm


LOGITS = ("logits",)
"""A language model's output: logits (batch, seq, vocabulary) for token ids (batch, seq)."""


def is_language_model(run: TrainedRun) -> bool:
    """A run on token data (torch-gpt): ids in, logits per position out."""
    return run.vocabulary is not None


class RunGraph(nn.Module):
    """Raw inputs -> the run's decoded outputs (module docstring), as plain tensor arithmetic;
    a language model: token ids -> logits per position."""

    def __init__(self, run: TrainedRun, model: Any | None = None) -> None:
        super().__init__()
        self.run = [run]  # a list: not a submodule (a TAGI network is no nn.Module)
        model = run.model if model is None else model
        if run.kind == "torch":
            self.model = model.eval()
        else:
            self.tagi = [model]
        norm = run.x_norm
        self.register_buffer("x_mean", norm.mean.float() if norm is not None else torch.zeros(()))
        self.register_buffer("x_std", norm.std.float() if norm is not None else torch.ones(()))
        self.outputs = output_names(run)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        run = self.run[0]
        if self.outputs == LOGITS:
            return (self.model(x).float(),)
        x = (x.float() - self.x_mean) / self.x_std
        if run.kind == "torch":
            out = self.model(x).float()
            if run.task == "classification":
                return (torch.softmax(out, dim=1),)
            return (run._to_data_units(out, None)[0],)
        net = self.tagi[0]
        mu, var = net(x.to(net.dtype))
        if run.task == "classification":
            return run.hrc.probabilities(mu, var), mu, var
        return run._to_data_units(*run.regression_moments(x, model=net))


def output_names(run: TrainedRun) -> tuple[str, ...]:
    if is_language_model(run):
        return LOGITS
    if run.kind == "torch":
        return ("probs",) if run.task == "classification" else ("mean",)
    return ("probs", "mu", "var") if run.task == "classification" else ("mean", "var")


def clear_tagi_caches(run: TrainedRun, graph: RunGraph | None = None) -> None:
    """TAGI layers cache m_W² + v_W between forwards: a cache filled while tracing would hold
    a tracer's tensor, and one filled before would be baked into the graph as a constant."""
    if run.kind != "tagi":
        return
    for model in (run.model, *(graph.tagi if graph is not None else ())):
        for layer in model.descendants():
            if hasattr(layer, "clear_cache"):
                layer.clear_cache()


def engine_caches(run: TrainedRun) -> list[dict]:
    """The TAGI engine's module-level caches of small constant tensors (made once per value,
    dtype and device); a tensor made while tracing and cached there would leak into every
    later forward. Restored after tracing."""
    if run.kind != "tagi":
        return []
    found = [base._CONSTANTS, base._SIGNED_INVERSES, lstm._INDICATORS, lstm._COV_PAIRS]
    if getattr(run, "hrc", None) is not None:
        found.append(run.hrc._on_device)
    return found


def refuse_recurrent(run: TrainedRun) -> None:
    """A TAGI LSTM carries its hidden and cell states from one call to the next (a forecast
    feeds its predictions back through them): no single graph of one input is that model. A
    TAGI language model's graph (token ids to the moments of every position's hierarchical
    softmax) is not written yet: refused in one line rather than half-traced."""
    if is_language_model(run):
        raise ExportError(f"{run.run_dir}: {run.model_config.model} cannot be exported yet: "
                          f"a TAGI language model's export (token ids to each position's "
                          f"output moments) is not written; dptrain generate samples from "
                          f"the run, and dptrain.load_run gives its model")
    for path, layer in run.model.named_leaves():
        if isinstance(layer, lstm.LSTM):
            raise ExportError(f"{run.run_dir}: layer {path} ({type(layer).__name__}) cannot be "
                              f"exported: it carries its state from one call to the next")


def culprit(err: BaseException, run: TrainedRun, graph: RunGraph) -> str:
    """The innermost layer of the model on the failing call's stack ("layer 3 (Conv2d)"), from
    the tracebacks of the error and its causes; else the model's name."""
    names = _layer_names(graph.model if run.kind == "torch" else graph.tagi[0], run.kind)
    found = None
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        tb = err.__traceback__
        while tb is not None:
            obj = tb.tb_frame.f_locals.get("self")
            if obj is not None and id(obj) in names:
                found = obj
            tb = tb.tb_next
        err = err.__cause__ or err.__context__
    if found is None:
        return f"the model {run.model_config.model}"
    return f"layer {names[id(found)]} ({type(found).__name__})"


def _layer_names(model: Any, kind: str) -> dict[int, str]:
    if kind == "torch":
        return {id(m): name for name, m in model.named_modules() if name}
    return {id(layer): path for path, layer in model.named_leaves()}
