"""One flat buffer for all parameters of a network, so that `step()` is 5 ops, not 5 per tensor.

`params` is (2, P): row 0 the means, row 1 the variances of every parameter tensor of every
parametric leaf, concatenated in state_dict order; `deltas` is (2, P) likewise. Each layer's
`mu_w, var_w, delta_mu_w, …` are re-bound to views of these rows, so a layer writes its deltas
straight into the flat buffer and every handed-out tensor is live storage.

`StatePack` does the same for non-parameter state (BatchNorm's running statistics): one flat
(S,) buffer, so that a data-parallel wrapper broadcasts, averages and fingerprints it in one go.

A layer that re-assigns one of these attributes instead of writing into it detaches from the
flat buffer silently (its deltas would never be all-reduced, its state never saved): both packs
remember the views they handed out, and `detached()` lists the attributes that no longer
point at them.
"""

from __future__ import annotations

import math

import torch

from dptrain.tagi.base import Layer, ParamLayer, StepRows, scale_deltas_


class ParameterPack:
    """Flat (2, P) parameter and delta storage shared by the leaves of one network."""

    def __init__(self, leaves: list[ParamLayer], dtype: torch.dtype,
                 device: torch.device) -> None:
        groups = [(leaf, group, shape) for leaf in leaves for group, shape in leaf.param_groups()]
        total = sum(math.prod(shape) for _, _, shape in groups)
        self.params = torch.empty(2, total, dtype=dtype, device=device)  # (2, P)
        self.deltas = torch.empty(2, total, dtype=dtype, device=device)  # (2, P)
        self._rows = StepRows(self.params, self.deltas,
                              torch.empty(4, total, dtype=dtype, device=device))  # step scratch
        self._bound: list[tuple[Layer, str, torch.Tensor]] = []
        offset = 0
        for leaf, group, shape in groups:
            end = offset + math.prod(shape)
            views = (self.params[0, offset:end], self.params[1, offset:end],
                     self.deltas[0, offset:end], self.deltas[1, offset:end])
            names = ("mu_", "var_", "delta_mu_", "delta_var_")
            for view, name in zip(views, names):
                # copy_ converts dtype and device when the pack is rebuilt by `to()`.
                view.copy_(getattr(leaf, name + group).reshape(-1))
            shaped = [view.view(shape) for view in views]
            leaf.bind(group, *shaped)
            self._bound += [(leaf, name + group, view) for name, view in zip(names, shaped)]
            offset = end

    @property
    def dtype(self) -> torch.dtype:
        return self.params.dtype

    @property
    def device(self) -> torch.device:
        return self.params.device

    def scale_deltas(self, start: int = 0, end: int | None = None) -> None:
        """g → Δ (see base.py): Δm = v g_m, Δv = v² g_v, for every layer at once or for the
        columns [start, end) (one layer's slice, as a data-parallel wrapper reduces it)."""
        if start == 0 and end is None:
            self._rows.scale_deltas_()
        else:
            scale_deltas_(self.params[:, start:end], self.deltas[:, start:end])

    def step(self, factor: float) -> None:
        if self.params.shape[1]:
            self._rows.capped_update_(factor)

    def detached(self) -> list[str]:
        return _detached(self._bound)


class StatePack:
    """Flat (S,) storage of every layer's non-parameter state, in `named_stateful` order."""

    def __init__(self, layers: list[Layer], dtype: torch.dtype, device: torch.device) -> None:
        entries = [(layer, name, shape) for layer in layers
                   for name, shape in layer.state_groups()]
        self.state = torch.empty(sum(math.prod(shape) for _, _, shape in entries), dtype=dtype,
                                 device=device)  # (S,)
        self._bound: list[tuple[Layer, str, torch.Tensor]] = []
        offset = 0
        for layer, name, shape in entries:
            end = offset + math.prod(shape)
            view = self.state[offset:end]
            view.copy_(getattr(layer, name).reshape(-1))
            shaped = view.view(shape)
            setattr(layer, name, shaped)
            self._bound.append((layer, name, shaped))
            offset = end

    def detached(self) -> list[str]:
        return _detached(self._bound)


def _detached(bound: list[tuple[Layer, str, torch.Tensor]]) -> list[str]:
    """"<layer label>.<attribute>" of every bound attribute that is no longer its view."""
    return [f"{layer.label}.{name}" for layer, name, view in bound
            if getattr(layer, name) is not view and
            (not isinstance(getattr(layer, name), torch.Tensor) or
             getattr(layer, name).data_ptr() != view.data_ptr())]
