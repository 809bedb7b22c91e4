"""Observation update of the network output (docs/tagi.md, Output update): innovations starting the
backward pass.

Shape legend: B batch, N output units, L observed outputs per sample (index update).

Missing observations: a NaN target gives zero innovations for that output (TAGI masking), so
it contributes nothing to any parameter delta; so does an inf/NaN innovation ratio. This holds
for both `update` and `update_using_indices` (cuTAGI masks only in `update`).
"""

from __future__ import annotations

from typing import Any

import torch

from dptrain.tagi.base import constant, finite
from dptrain.tagi.states import DeltaStates, HiddenStates


class OutputUpdater:
    """pytagi's `OutputUpdater`: writes δm, δv of the output into a `DeltaStates`.

    `device` is kept for pytagi compatibility; the computation runs where the output lives.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def update(self, output_states: HiddenStates, mu_obs: Any, var_obs: Any,
               delta_states: DeltaStates) -> None:
        """Every output observed: δm = J (y − m)/(v + v_y), δv = −J²/(v + v_y).

        `mu_obs`: (B, N) or flat (B·N,) targets (NaN = missing); `var_obs`: observation noise
        variance σ_v², a number or an array of the shape of `mu_obs`.
        """
        mu, var = _checked_output(output_states)
        y = _shaped_like(mu_obs, mu.shape, mu, "mu_obs")
        noise = _noise(var_obs, mu.shape, mu)
        delta_states.delta_mu, delta_states.delta_var = _innovations(
            mu, var, output_states.jcb, y, noise)

    def update_using_indices(self, output_states: HiddenStates, mu_obs: Any, var_obs: Any,
                             selected_idx: Any, delta_states: DeltaStates) -> None:
        """Only the outputs `selected_idx` are observed (HRC softmax); others get δ = 0.

        `selected_idx`: (B, L) or flat (B·L,) **1-based** output indices (pytagi's convention,
        what `HRCSoftmax.encode` returns); `mu_obs` and `var_obs` (number or array) match it.
        An output selected twice in a sample counts as two observations (innovations add).
        """
        mu, var = _checked_output(output_states)
        if mu.dim() != 2:
            raise ValueError(f"update_using_indices needs a (batch, outputs) output, got "
                             f"{tuple(mu.shape)}")
        idx = _indices(selected_idx, mu)  # (B, L), 0-based
        y = _shaped_like(mu_obs, idx.shape, mu, "mu_obs")
        noise = _noise(var_obs, idx.shape, mu)
        jcb = None if output_states.jcb is None else output_states.jcb.gather(1, idx)
        delta_mu, delta_var = _innovations(mu.gather(1, idx), var.gather(1, idx), jcb, y, noise)
        delta_states.delta_mu = torch.zeros_like(mu).scatter_add_(1, idx, delta_mu)
        delta_states.delta_var = torch.zeros_like(mu).scatter_add_(1, idx, delta_var)


    def update_heteros(self, output_states: HiddenStates, mu_obs: Any,
                       delta_states: DeltaStates) -> None:
        """Heteroscedastic (AGVI) update: the output holds (mean, noise variance) pairs from
        `EvenExp`, and the noise variance is learned instead of given.

        `mu_obs`: (B, K) or flat (B·K,) targets for an output of width 2K (NaN = missing: both
        slots of that target get δ = 0). See docs/tagi.md, Heteroscedastic regression. The
        noise slot's δv can be positive, unlike every other innovation.
        """
        mu, var = _checked_output(output_states)
        if mu.dim() != 2 or mu.shape[1] % 2:
            raise ValueError(f"update_heteros needs a (batch, 2 x targets) output of (mean, "
                             f"noise) pairs, got {tuple(mu.shape)}")
        batch, width = mu.shape
        y = _shaped_like(mu_obs, torch.Size((batch, width // 2)), mu, "mu_obs")
        pairs = (batch, width // 2, 2)
        mu_y, mu_t = mu.reshape(pairs).unbind(2)
        var_y, var_t = var.reshape(pairs).unbind(2)
        jcb_y, jcb_t = (None, None) if output_states.jcb is None else \
            output_states.jcb.reshape(pairs).unbind(2)
        # (4, B, K): δm of the mean slots, δm of the noise slots, then the two δv
        deltas = _agvi_innovations(mu_y, var_y, jcb_y, mu_t, var_t, jcb_t, y)
        # back to the (mean, noise) interleaving of the output: (B, K, 2) -> (B, 2K)
        delta_states.delta_mu = deltas[:2].permute(1, 2, 0).reshape(batch, width)
        delta_states.delta_var = deltas[2:].permute(1, 2, 0).reshape(batch, width)


def _agvi_innovations(mu_y: torch.Tensor, var_y: torch.Tensor, jcb_y: torch.Tensor | None,
                      mu_t: torch.Tensor, var_t: torch.Tensor, jcb_t: torch.Tensor | None,
                      y: torch.Tensor) -> torch.Tensor:
    """(δm_Y, δm_T, δv_Y, δv_T) stacked, each (B, K); J = None means 1.

    The noise V ~ N(0, T) enters the observation y = Y + V. Its posterior gives the posterior
    of V², whose prior mean is E[T] and variance 3 v_T + 2 m_T²; T is then updated through
    Cov(T, V²) = v_T (docs/tagi.md, Heteroscedastic regression). At batch 10 a step is all
    per-op overhead, so the algebra is arranged for few tensor operations.
    """
    one, two = constant(1.0, mu_t), constant(2.0, mu_t)  # Python numbers cost a tensor each
    inv_s = torch.reciprocal(var_y + mu_t)
    residual_over_s = (y - mu_y).mul_(inv_s)
    mean_v = mu_t * residual_over_s
    var_v = mu_t * (one - mu_t * inv_s)
    mean_v_sq = mean_v * mean_v
    prior_var_v2 = constant(3.0, mu_t) * var_t + two * mu_t * mu_t
    gain = var_t / prior_var_v2
    # J/v_T carries the change of T back to its pre-activation; 0 where v_T vanishes
    jv = torch.reciprocal(var_t) if jcb_t is None else jcb_t / var_t
    zero = constant(0.0, jv)
    jv = torch.where(finite(jv), jv, zero).mul_(gain)
    deltas = torch.stack([
        residual_over_s if jcb_y is None else jcb_y * residual_over_s,
        jv * (mean_v_sq + var_v - mu_t),
        -inv_s if jcb_y is None else -jcb_y * jcb_y * inv_s,
        jv * jv * (two * var_v * (var_v + two * mean_v_sq) - prior_var_v2)])
    # a missing target (NaN) or a non-finite ratio leaves both slots of that target unobserved
    return torch.where(finite(deltas.sum(0)), deltas, zero)


def _innovations(mu: torch.Tensor, var: torch.Tensor, jcb: torch.Tensor | None,
                 y: torch.Tensor, noise: torch.Tensor | float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    inv_s = torch.reciprocal(var + noise)
    delta_mu = (y - mu).mul_(inv_s)
    delta_var = inv_s.neg_()
    if jcb is not None:
        delta_mu.mul_(jcb)
        delta_var.mul_(jcb).mul_(jcb)
    observed = finite(delta_mu)  # False for NaN targets and inf/NaN ratios
    zero = constant(0.0, delta_mu)
    return torch.where(observed, delta_mu, zero), torch.where(observed, delta_var, zero)


def _checked_output(states: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(states, HiddenStates):
        raise ValueError("output_states must be net.output_z_buffer after a forward, got "
                         f"{type(states).__name__}")
    return states.mu_a, states.var_or_zeros()


def _shaped_like(value: Any, shape: torch.Size, like: torch.Tensor, name: str) -> torch.Tensor:
    """`value` as a tensor of `shape`; a flat array of the same size is reshaped (pytagi)."""
    tensor = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if tensor.shape == shape:
        return tensor
    if tensor.dim() == 1 and tensor.numel() == shape.numel():
        return tensor.view(shape)
    raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} (or flat "
                     f"{shape.numel()}) to match the last forward's batch of {shape[0]}")


def _noise(value: Any, shape: torch.Size, like: torch.Tensor) -> torch.Tensor | float:
    if isinstance(value, (int, float)):
        if not value >= 0:
            raise ValueError(f"var_obs must be >= 0, got {value}")
        return float(value)
    tensor = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if tensor.dim() != 0:
        tensor = _shaped_like(tensor, shape, like, "var_obs")
    if not bool((tensor >= 0).all()):
        raise ValueError(f"var_obs must be >= 0 everywhere, got min {tensor.min().item()}")
    return tensor


def _indices(value: Any, mu: torch.Tensor, values: bool = True) -> torch.Tensor:
    """`value` as (B, L) 0-based int64 indices into `mu`'s outputs, checked. `values=False`:
    only its dtype and shape are checked, and the 1-based indices come back as given, for a
    caller that checks the range itself (the native step, inside its call)."""
    idx = torch.as_tensor(value, device=mu.device)
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise ValueError(f"selected_idx must hold integers, got dtype {idx.dtype}")
    batch, width = mu.shape
    if idx.dim() == 1 and idx.numel() % batch == 0:
        idx = idx.view(batch, -1)
    if idx.dim() != 2 or idx.shape[0] != batch:
        raise ValueError(f"selected_idx has shape {tuple(idx.shape)}, expected (batch={batch}, "
                         f"observations per sample) or its flat form, to match the last "
                         f"forward's batch of {batch}")
    if not values:
        return idx.long()
    if idx.numel() == 0:  # a data-parallel rank without a sample in this step
        return idx.long()
    low, high = torch.aminmax(idx)
    if low.item() < 1 or high.item() > width:
        bad = ((idx < 1) | (idx > width)).nonzero()[0].tolist()
        raise ValueError(f"selected_idx must be 1-based output indices in [1, {width}], got "
                         f"{idx[bad[0], bad[1]].item()} at sample {bad[0]}, position {bad[1]}")
    return idx.long() - 1
