"""SLSTM and SLinear: an LSTM stack over one time series, one step per call, smoothed backward
in time after a pass over the series (docs/tagi.md, SLSTM and the smoother).

Shape legend: B series processed side by side (the batch), O output_size, I input_size,
T the time steps recorded since the last smoother. pytagi 0.2.1 names: `SLSTM`, `SLinear`,
`Sequential.smoother()`; the TAGI-LSTM paper (Vuong, Nguyen & Goulet, International Journal of
Forecasting 41(1), 2025) describes the smoother.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dptrain.tagi.base import Layer
from dptrain.tagi.linear import Linear
from dptrain.tagi.lstm import LSTM
from dptrain.tagi.states import DeltaStates, HiddenStates

logger = logging.getLogger(__name__)

#: What the smoother uses for a prior variance ≤ 0 in a gain's denominator, and writes where a
#: smoothed variance comes out negative (pytagi's constant).
SMOOTHER_EPS = 1e-5


@dataclass(eq=False, slots=True)
class _TimeStep:
    """What one training step leaves for the smoother, each (B, O) unless noted."""

    mu_h_prior: torch.Tensor  # the forward's hidden state
    var_h_prior: torch.Tensor
    mu_c_prior: torch.Tensor  # the forward's cell state
    var_c_prior: torch.Tensor
    cov_cc: torch.Tensor  # Cov(C_{t−1}, C_t), per unit
    cov_hh: torch.Tensor  # (B, O, O) Cov(H_{t−1}[k], H_t[j]) at [b, k, j]
    mu_h_post: torch.Tensor | None = None  # the same states given the step's observation
    var_h_post: torch.Tensor | None = None
    mu_c_post: torch.Tensor | None = None
    var_c_post: torch.Tensor | None = None


class SLSTM(LSTM):
    """An LSTM layer whose hidden and cell states run through a time series, one step per
    call, and can be smoothed backward in time (pytagi's SLSTM).

    The math of a step is `LSTM`'s with `seq_len = 1` and the states carried from call to call
    (docs/tagi.md, LSTM): each call is the next time step, a training backward replaces the
    carried states by their posteriors. Unlike `LSTM` (and pytagi) the states are carried for
    any batch size: sample b of every call continues series b, so B series run side by side.

    Every training step records its prior and posterior states and the covariances between
    consecutive steps that the forward knows, Cov(C_{t−1}, C_t) and Cov(H_{t−1}, H_t); a
    forward without a backward records nothing. `smoother()` (usually through
    `Sequential.smoother()`) runs the backward pass over the recorded steps, leaves the result
    in `mu_h_smooths, var_h_smooths, mu_c_smooths, var_c_smooths` ((T, B, O) each), forgets the
    recorded steps and zeroes the carried states, so the next pass over the series starts
    afresh, as in pytagi.

    `seq_len` is pytagi's argument and must be 1: the smoother treats each call as one time
    step. Parameters, initialisation and `state_dict` keys are `LSTM`'s.
    """

    def __init__(self, input_size: int, output_size: int, seq_len: int = 1, bias: bool = True,
                 gain_weight: float = 1.0, gain_bias: float = 1.0, init_method: str = "He",
                 *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        if seq_len != 1:
            raise ValueError(f"SLSTM: seq_len must be 1 (each call is one time step of the "
                             f"series the smoother runs over), got {seq_len!r}")
        super().__init__(input_size, output_size, seq_len, bias, gain_weight, gain_bias,
                         init_method, dtype=dtype, device=device)
        self.mu_h_smooths = self.var_h_smooths = None
        self.mu_c_smooths = self.var_c_smooths = None

    def clear_cache(self) -> None:
        """Drop the stored forward, the carried states and the recorded steps."""
        self._steps: list[_TimeStep] = []
        self._pending: _TimeStep | None = None
        super().clear_cache()

    @property
    def carries_states(self) -> bool:
        return self._batch_size is not None

    @property
    def num_recorded_steps(self) -> int:
        """Training steps recorded since the last smoother (or construction)."""
        return len(self._steps)

    def forward(self, states: HiddenStates) -> HiddenStates:
        if self.training and self._steps:
            recorded = self._steps[0].mu_h_prior.shape[0]
            if states.mu_a.shape[0] != recorded:
                raise ValueError(f"{self.label}: {len(self._steps)} steps of {recorded} series "
                                 f"recorded, then a batch of {states.mu_a.shape[0]}; a series "
                                 "keeps its batch size until smoother()")
        out = super().forward(states)
        self._pending = self._time_step() if self.training else None
        return out

    def _time_step(self) -> _TimeStep:
        """The priors and covariances of the forward just run (pytagi's linearisation)."""
        coef = self._gate_coefficients()[:, 0]  # (B, 4, O): ∂H_t/∂Z_g at the means
        o, i = self.output_size, self.input_size
        recurrent = self.mu_w.view(4, o, i + o)[:, :, i:]  # (4, O_t, O_{t−1})
        # Cov(H_{t−1}[k], H_t[j]) = v_H{t−1}[k] Σ_g coef[g, j] W_g[j, I + k]
        paths = torch.einsum("bgj,gjk->bkj", coef, recurrent)  # (B, O_{t−1}, O_t)
        # Copies: the carried states start as these tensors and backward updates them.
        priors = (t[:, 0].clone() for t in (self.mu_h, self.var_h, self.mu_c, self.var_c))
        return _TimeStep(*priors, cov_cc=self.var_c_prev[:, 0] * self.mu_f_ga[:, 0],
                         cov_hh=self.var_h_prev[:, 0].unsqueeze(2) * paths)

    def backward(self, delta: DeltaStates, need_input_delta: bool) -> DeltaStates | None:
        out = super().backward(delta, need_input_delta)
        step, self._pending = self._pending, None
        if step is not None:  # the carried states are now the step's posteriors
            step.mu_h_post, step.var_h_post = self.mu_h_prior[:, 0], self.var_h_prior[:, 0]
            step.mu_c_post, step.var_c_post = self.mu_c_prior[:, 0], self.var_c_prior[:, 0]
            self._steps.append(step)
        return out

    def smoother(self) -> None:
        """Smooth the recorded steps backward in time, then start a new pass (see the class)."""
        if not self._steps:
            raise RuntimeError(f"{self.label}: smoother() needs recorded training steps "
                               "(forward, update, backward in training mode)")
        steps = {name: torch.stack([getattr(s, name) for s in self._steps])
                 for name in _TimeStep.__slots__}  # (T, B, …) each
        self.mu_c_smooths, self.var_c_smooths, clipped_c = _smooth(
            steps, "c", lambda gain, d: gain * d)
        self.mu_h_smooths, self.var_h_smooths, clipped_h = _smooth(
            steps, "h", lambda gain, d: torch.einsum("bkj,bj->bk", gain, d))
        clipped = int(clipped_c + clipped_h)  # one device sync per smoother call
        if clipped:
            logger.warning("%s: %d smoothed variances came out negative and were set to %g",
                           self.label, clipped, SMOOTHER_EPS)
        self._steps, self._pending = [], None
        self.reset_lstm_states()

    def __repr__(self) -> str:
        return f"SLSTM({self.input_size}, {self.output_size}, bias={self.bias})"


def _smooth(steps: dict[str, torch.Tensor], kind: str, apply
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rauch-Tung-Striebel pass over (T, B, O) posteriors of H or C (`kind`), from the last
    step back: with the gain G = Cov(X_t, X_{t+1}) / v_prior(X_{t+1}),

        m_s(t) = m_post(t) + G (m_s(t+1) − m_prior(t+1))
        v_s(t) = v_post(t) + G² (v_s(t+1) − v_prior(t+1))

    G is per unit for C (only C_t's own unit carries C_{t−1}), a (B, O, O) matrix for H, and
    `apply(G, d)` multiplies it (G² elementwise for the variances). Returns the smoothed
    means and variances and how many variances were clipped (a 0-d tensor)."""
    mu_post, var_post = steps[f"mu_{kind}_post"], steps[f"var_{kind}_post"]
    mu_prior, var_prior = steps[f"mu_{kind}_prior"], steps[f"var_{kind}_prior"]
    cov = steps[f"cov_{kind}{kind}"]
    mu_s, var_s = mu_post.clone(), var_post.clone()  # the last step is its own smoothed state
    clipped = torch.zeros((), dtype=torch.long, device=mu_s.device)
    for t in range(mu_post.shape[0] - 2, -1, -1):
        prior_var = torch.where(var_prior[t + 1] > 0, var_prior[t + 1], SMOOTHER_EPS)
        gain = cov[t + 1] / (prior_var.unsqueeze(1) if cov.dim() == 4 else prior_var)
        mu_s[t] = mu_post[t] + apply(gain, mu_s[t + 1] - mu_prior[t + 1])
        var = var_post[t] + apply(gain * gain, var_s[t + 1] - var_prior[t + 1])
        negative = var < 0
        clipped += negative.sum()
        var_s[t] = torch.where(negative, SMOOTHER_EPS, var)
    return mu_s, var_s, clipped


class SLinear(Linear):
    """The Linear head of an SLSTM stack (pytagi's SLinear): `Linear` in every respect, plus
    `smoother(mu_h, var_h)`, which maps the smoothed hidden states of the SLSTM before it to
    smoothed outputs with the current parameters (the Linear forward moments, step by step)."""

    def smoother(self, mu_h: torch.Tensor, var_h: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, B, I) smoothed hidden states → (T, B, O) smoothed outputs (means, variances)."""
        if mu_h.shape[-1] != self.input_size:
            raise ValueError(f"{self.label}: smoothed states of width {mu_h.shape[-1]}, "
                             f"this layer takes {self.input_size}")
        mu_z = F.linear(mu_h, self.mu_w, self.mu_b)
        var_z = F.linear(mu_h * mu_h, self.var_w, self.var_b) + \
            F.linear(var_h, self.mu_w * self.mu_w + self.var_w)
        return mu_z, var_z

    def __repr__(self) -> str:
        return f"SLinear({self.input_size}, {self.output_size}, bias={self.bias})"


def smooth_layers(layers: Iterable[Layer]) -> tuple[torch.Tensor, torch.Tensor]:
    """pytagi's `Sequential.smoother()` over `layers` in order: each SLSTM smooths its steps,
    each SLinear maps the last SLSTM's smoothed hidden states; returns the last SLinear's
    (T, B, O) means and variances."""
    hidden = out = None
    for layer in layers:
        if isinstance(layer, SLSTM):
            layer.smoother()
            hidden = layer.mu_h_smooths, layer.var_h_smooths
        elif isinstance(layer, SLinear):
            if hidden is None:
                raise ValueError(f"{layer.label}: smoother() needs an SLSTM before the SLinear")
            out = layer.smoother(*hidden)
    if out is None:
        raise ValueError("smoother() needs an SLinear after an SLSTM in the network")
    return out
