"""One flat buffer for all parameters of a network, so that `step()` is 6 ops, not 6 per tensor.

`params` is (2, P): row 0 the means, row 1 the variances of every parameter tensor of every
parametric leaf, concatenated in state_dict order; `deltas` is (2, P) likewise. Each layer's
`mu_w, var_w, delta_mu_w, …` are re-bound to views of these rows, so a layer writes its deltas
straight into the flat buffer and every handed-out tensor is live storage.
"""

from __future__ import annotations

import math

import torch

from dptrain.tagi.base import ParamLayer, capped_update_, scale_deltas_


class ParameterPack:
    """Flat (2, P) parameter and delta storage shared by the leaves of one network."""

    def __init__(self, leaves: list[ParamLayer], dtype: torch.dtype,
                 device: torch.device) -> None:
        groups = [(leaf, group, shape) for leaf in leaves for group, shape in leaf.param_groups()]
        total = sum(math.prod(shape) for _, _, shape in groups)
        self.params = torch.empty(2, total, dtype=dtype, device=device)  # (2, P)
        self.deltas = torch.empty(2, total, dtype=dtype, device=device)  # (2, P)
        self._scratch = torch.empty(4, total, dtype=dtype, device=device)  # (4, P), step only
        offset = 0
        for leaf, group, shape in groups:
            end = offset + math.prod(shape)
            views = (self.params[0, offset:end], self.params[1, offset:end],
                     self.deltas[0, offset:end], self.deltas[1, offset:end])
            names = ("mu_", "var_", "delta_mu_", "delta_var_")
            for view, name in zip(views, names):
                # copy_ converts dtype and device when the pack is rebuilt by `to()`.
                view.copy_(getattr(leaf, name + group).reshape(-1))
            leaf.bind(group, *(view.view(shape) for view in views))
            offset = end

    @property
    def dtype(self) -> torch.dtype:
        return self.params.dtype

    @property
    def device(self) -> torch.device:
        return self.params.device

    def scale_deltas(self) -> None:
        """g → Δ for every layer at once (see base.py): Δm = v g_m, Δv = v² g_v."""
        scale_deltas_(self.params, self.deltas)

    def step(self, factor: float) -> None:
        if self.params.shape[1]:
            capped_update_(self.params, self.deltas, factor, self._scratch)
