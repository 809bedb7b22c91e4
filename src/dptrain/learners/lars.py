"""LARS, layer-wise adaptive rate scaling (You, Gitman, Ginsburg 2017, "Large Batch Training of
Convolutional Networks", Algorithm 1), for SGD at large global batches.

Per parameter tensor w with gradient g, weight decay β, trust coefficient η, momentum m and the
global rate γ (the schedule's):

    local_lr = η ||w|| / (||g|| + β ||w||)        (1 where either norm is 0)
    v        = m v + γ local_lr (g + β w)
    w        = w - v

The usual practice (SimCLR's, timm's `Lars`) adapts only the tensors that are decayed, so a
group with weight_decay 0 (biases and normalisation weights, `dptrain.learners.optim`) takes
plain momentum SGD steps. Norms of sharded (FSDP) tensors are those of the whole tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class Lars(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float, *, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001,
                 nesterov: bool = False) -> None:
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "trust_coefficient": trust_coefficient, "nesterov": nesterov}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            decay, momentum = group["weight_decay"], group["momentum"]
            for w in group["params"]:
                if w.grad is None:
                    continue
                g = w.grad
                update = g.add(w, alpha=decay) if decay else g.clone()
                if decay:
                    w_norm, g_norm = torch.linalg.vector_norm(w), torch.linalg.vector_norm(g)
                    trust = group["trust_coefficient"] * w_norm / (g_norm + decay * w_norm)
                    # A fresh (zero) tensor or a zero gradient: no ratio to speak of.
                    trust = torch.where((w_norm > 0) & (g_norm > 0), trust,
                                        torch.ones_like(trust))
                    update.mul_(trust)
                update.mul_(group["lr"])
                if momentum:
                    state = self.state[w]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = update.clone()
                    else:
                        state["momentum_buffer"].mul_(momentum).add_(update)
                    buf = state["momentum_buffer"]
                    update = update.add(buf, alpha=momentum) if group["nesterov"] else buf
                w.sub_(update)
        return loss
