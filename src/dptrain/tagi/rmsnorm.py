"""RMSNorm: scale each position's features by the root mean square of their means
(docs/tagi.md, MultiheadAttention and RMSNorm), cuTAGI main's layer (no bias, no centring).

Shape legend: B batch, E `normalized_shape` (features), R rows = positions normalised on their
own. A state (B, E), (B, T, E) or cuTAGI's flat (B, T·E) is read as R = B·T rows of E values::

    r = 1/sqrt(mean_e(m_A²) + ε)                  (the means only, a constant, as in cuTAGI)
    m_Z = r m_A m_γ
    v_Z = r² (v_A (m_γ² + v_γ) + v_γ m_A²)
    backward: δm_in = r m_γ J δm,  δv_in = (r m_γ J)² δv
    deltas:   Δm_γ = v_γ Σ r m_A δm,  Δv_γ = v_γ² Σ (r m_A)² δv      (summed over all rows)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dptrain.tagi.base import ParamLayer
from dptrain.tagi.states import DeltaStates, HiddenStates


def rms_variance(mu_a: torch.Tensor, var_a: torch.Tensor | None, r: torch.Tensor,
                 mu_w: torch.Tensor, var_w: torch.Tensor) -> torch.Tensor:
    """v_Z of `m_A r γ` with independent A and γ: r² (v_A (m_γ² + v_γ) + v_γ m_A²).

    cuTAGI main multiplies this by one more v_A (docs/tagi.md, MultiheadAttention and
    RMSNorm); its parity test swaps that form in here to replay the recorded forward."""
    var_z = (mu_a * mu_a).mul_(var_w)
    if var_a is not None:
        var_z.add_(var_a * (mu_w * mu_w + var_w))
    return var_z.mul_(r * r)


class RMSNorm(ParamLayer):
    """Normalise each position's E features by their RMS and scale by γ (`mu_w, var_w`, (E,)).

    Same in training and evaluation; no state. Init (cuTAGI's): m_γ = 1, v_γ = 1/E.
    `normalized_shape` is E or [E] (pytagi passes a list).
    """

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-6, *,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else \
            tuple(normalized_shape)
        if len(shape) != 1 or isinstance(shape[0], bool) or not isinstance(shape[0], int) \
                or shape[0] < 1:
            raise ValueError(f"RMSNorm: normalized_shape must be one positive int (E or [E]), "
                             f"got {normalized_shape!r}")
        if not eps > 0:
            raise ValueError(f"RMSNorm: eps must be > 0, got {eps!r}")
        self.normalized_shape, self.num_features, self.eps = shape, shape[0], float(eps)
        self.bias = False
        super().__init__()
        size = self.num_features
        ones = torch.ones(size, dtype=dtype, device=device)
        self.bind("w", ones, torch.full_like(ones, 2.0 / (size + size)),
                  torch.zeros_like(ones), torch.zeros_like(ones))
        self.mu_b = self.var_b = self.delta_mu_b = self.delta_var_b = None
        self.clear_cache()

    def param_groups(self) -> list[tuple[str, tuple[int, ...]]]:
        return [("w", (self.num_features,))]

    def input_sample_shape(self) -> tuple[int, ...]:
        """(E,): a flat (n·E,) array is n rows."""
        return (self.num_features,)

    def clear_cache(self) -> None:
        self._a_hat: torch.Tensor | None = None  # (R, E) r m_A of the last training forward
        self._r: torch.Tensor | None = None  # (R, 1)
        self._jcb: torch.Tensor | None = None  # (R, E) J of the input, None = 1
        self._in_shape: tuple[int, ...] = ()

    def _rows(self, t: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
        return None if t is None else t.reshape(-1, self.num_features)

    def forward(self, states: HiddenStates) -> HiddenStates:
        mu_a, e = states.mu_a, self.num_features
        width = math.prod(mu_a.shape[1:])
        if mu_a.dim() < 2 or mu_a.shape[-1] % e or width % e:
            raise ValueError(f"{self.label}: expected input (batch, E), (batch, T, E) or "
                             f"(batch, T·E) with E = {e}, got {tuple(mu_a.shape)}")
        rows = mu_a.reshape(-1, e)
        var_rows = self._rows(states.var_a, mu_a.shape)
        r = torch.rsqrt((rows * rows).mean(1, keepdim=True) + self.eps)  # (R, 1)
        a_hat = rows * r
        mu_z = a_hat * self.mu_w
        var_z = rms_variance(rows, var_rows, r, self.mu_w, self.var_w)
        if self.training:
            self._a_hat, self._r = a_hat, r
            self._jcb = self._rows(states.jcb, mu_a.shape)
            self._in_shape = tuple(mu_a.shape)
        return HiddenStates(mu_z.view(mu_a.shape), var_z.view(mu_a.shape), None)

    def backward(self, delta: DeltaStates, need_input_delta: bool) -> DeltaStates | None:
        """Writes g_m = Σ r m_A δm, g_v = Σ (r m_A)² δv; Δ = v g_m, v² g_v in `scale_deltas_`."""
        if self._a_hat is None or self._r is None:
            raise RuntimeError(f"{self.label}: backward() needs a forward in training mode first")
        delta_mu = delta.delta_mu.reshape(-1, self.num_features)
        delta_var = delta.delta_var.reshape(-1, self.num_features)
        torch.sum(self._a_hat * delta_mu, 0, out=self.delta_mu_w)
        torch.sum(self._a_hat.square().mul_(delta_var), 0, out=self.delta_var_w)
        if not need_input_delta:
            return None
        gain = self._r * self.mu_w  # (R, E)
        if self._jcb is not None:
            gain = gain * self._jcb
        return DeltaStates((delta_mu * gain).view(self._in_shape),
                           (delta_var * gain).mul_(gain).view(self._in_shape))

    def __repr__(self) -> str:
        return f"RMSNorm({list(self.normalized_shape)})"
