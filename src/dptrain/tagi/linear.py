"""Fully connected TAGI layer (docs/tagi.md, Linear).

Shape legend: B batch, T positions, I input_size, O output_size. Weights are (O, I) like torch's
`Linear.weight` and pytagi's flat `mu_w` (index i*I + j), biases (O,).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dptrain.tagi.base import ParamLayer, init_scale
from dptrain.tagi.states import DeltaStates, HiddenStates


class Linear(ParamLayer):
    """Z = W A + B with independent Gaussian W, B, A; forward moments are exact.

    An image state (B, C, H, W) with C·H·W = I (after a conv stack) is flattened C-major, like
    `torch.nn.Flatten`, and the innovations go back in its shape.

    `per_position`: the layer is applied to every position of a sequence, the same weights at
    each (a transformer's MLP and head): the input is (B, T·I), position t at columns
    [t·I, (t+1)·I) as `Embedding` and `MultiheadAttention` lay it out, or (B, T, I); the output
    is (B, T·O) or (B, T, O). T is read from each input. The deltas sum over batch and
    positions, as a convolution's sum over pixels.

    Parameters: `mu_w, var_w` (O, I), `mu_b, var_b` (O,), and their proposed increments
    `delta_mu_w, …`, written (overwritten, summed over the batch) by every `backward`.
    Init (pytagi): m ~ N(0, s²), v = (gain·s)², s = sqrt(1/I) for "He", sqrt(2/(I+O)) for
    "Xavier"; the gains scale only the variances.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 gain_weight: float = 1.0, gain_bias: float = 1.0, init_method: str = "He",
                 *, per_position: bool = False, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        for name, value in (("input_size", input_size), ("output_size", output_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Linear: {name} must be a positive int, got {value!r}")
        self.input_size = input_size
        self.output_size = output_size
        self.bias = bias
        self.per_position = bool(per_position)
        super().__init__()
        scale = init_scale(init_method, input_size, output_size)
        self._init_group("w", (output_size, input_size), scale, gain_weight, dtype, device)
        if bias:
            self._init_group("b", (output_size,), scale, gain_bias, dtype, device)
        else:
            self.mu_b = self.var_b = self.delta_mu_b = self.delta_var_b = None
        self.clear_cache()

    def param_groups(self) -> list[tuple[str, tuple[int, ...]]]:
        groups = [("w", (self.output_size, self.input_size))]
        if self.bias:
            groups.append(("b", (self.output_size,)))
        return groups

    def input_sample_shape(self) -> tuple[int, ...]:
        """(I,): a network starting with a Linear also takes pytagi's flat (B·I,) arrays, e.g.
        the (B,) inputs of a 1-D regression; a flat array that is not whole samples is refused."""
        return (self.input_size,)

    def clear_cache(self) -> None:
        self._mu_a: torch.Tensor | None = None  # (B, I) input mean of the last training forward
        self._mu_a_sq: torch.Tensor | None = None  # (B, I)
        self._mu_w_sq: torch.Tensor | None = None  # (O, I) m_W² of that forward, for backward
        self._jcb: torch.Tensor | None = None  # (B, I) J of the input, None = 1
        self._jcb_is_mask = False  # J ∈ {0, 1}, so J² = J
        self._in_shape: tuple[int, ...] = ()  # (B, I) or the (B, C, H, W) it was flattened from
        # (m_W, v_W, their version, m_W², m_W² + v_W): see _weight_moments
        self._weight_cache: tuple | None = None

    def _weight_moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(m_W², m_W² + v_W), each (O, I), computed once per version of the parameters.

        Within a training step the parameters do not change between forward and backward, and
        between steps an evaluation loop forwards many batches with the same ones, so the two
        products are cached. The cache is keyed on the tensors themselves (re-binding by `to()`
        or `Sequential` makes new ones) and on torch's version counter, which every in-place
        torch operation on them or on any view of their storage bumps: `step()`,
        `load_state_dict`, a broadcast copied in, `flat_params[...] = x`, `mu_w.add_(…)`.
        Writes that bypass torch (through a numpy view, or `.data`) do not bump it; call
        `clear_cache()` after those.
        """
        mu_w, var_w = self.mu_w, self.var_w
        if torch.compiler.is_compiling():  # traced: no cached state to guard on
            mu_w_sq = mu_w * mu_w
            return mu_w_sq, mu_w_sq + var_w
        version = _version(mu_w), _version(var_w)
        cache = self._weight_cache
        if (cache is None or cache[0] is not mu_w or cache[1] is not var_w or
                cache[2] != version or version[0] is None):
            mu_w_sq = mu_w * mu_w
            cache = (mu_w, var_w, version, mu_w_sq, mu_w_sq + var_w)
            self._weight_cache = cache
        return cache[3], cache[4]

    def forward(self, states: HiddenStates) -> HiddenStates:
        mu_a, var_a, jcb = states.mu_a, states.var_a, states.jcb  # (B, I) or (B, C, H, W)
        if self.per_position:
            # (B, T·I) or (B, T, I) → (B·T, I): positions become rows, the same weights apply
            mu_a, var_a, jcb = (None if t is None else t.reshape(-1, self.input_size)
                                for t in self._positions(mu_a, var_a, jcb))
        elif mu_a.dim() > 2 and math.prod(mu_a.shape[1:]) == self.input_size:
            # After a conv stack: flatten C-major, exactly like torch.nn.Flatten (a view).
            mu_a, var_a, jcb = (None if t is None else t.flatten(1) for t in (mu_a, var_a, jcb))
        if mu_a.dim() != 2 or mu_a.shape[1] != self.input_size:
            image = (f" or (batch, C, H, W) with C·H·W = {self.input_size}"
                     if states.mu_a.dim() > 2 else "")
            raise ValueError(f"{self.label}: expected input of shape (batch, {self.input_size})"
                             f"{image}, got {tuple(states.mu_a.shape)}")
        mu_a_sq = mu_a * mu_a
        mu_z = F.linear(mu_a, self.mu_w, self.mu_b)  # (B, O)
        # v_Z = m_A² v_Wᵀ + v_A (m_W² + v_W)ᵀ + v_B. A deterministic input (the usual network
        # input) needs neither the second product nor m_W², the costliest terms of a wide first
        # layer; otherwise m_W² + v_W comes from a cache kept per parameter version.
        var_z = F.linear(mu_a_sq, self.var_w, self.var_b)
        mu_w_sq = None
        if var_a is not None:
            mu_w_sq, var_w_total = self._weight_moments()
            var_z.addmm_(var_a, var_w_total.t())
        if self.training:
            self._mu_a, self._mu_a_sq, self._mu_w_sq, self._jcb = mu_a, mu_a_sq, mu_w_sq, jcb
            self._jcb_is_mask = states.jcb_is_mask
            self._in_shape = tuple(states.mu_a.shape)
        if self.per_position:
            shape = (*states.mu_a.shape[:-1], -1)  # (B, T·O) or (B, T, O)
            return HiddenStates(mu_z.view(shape), var_z.view(shape), None)
        return HiddenStates(mu_z, var_z, None)

    def _positions(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """The per-position input checked: whole positions of I features."""
        mu_a = tensors[0]
        if mu_a.dim() not in (2, 3) or mu_a.shape[-1] % self.input_size or not mu_a.numel():
            raise ValueError(f"{self.label}: per position, expected input (batch, "
                             f"T·{self.input_size}) or (batch, T, {self.input_size}), got "
                             f"{tuple(mu_a.shape)}")
        return tensors

    def backward(self, delta: DeltaStates, need_input_delta: bool) -> DeltaStates | None:
        """Writes g_m = δmᵀ m_A, g_v = δvᵀ m_A² (and the batch sums of δm, δv for the bias) into
        the delta buffers; Δ = v g_m, v² g_v follows in `scale_deltas_` (base.py)."""
        if self._mu_a is None or self._mu_a_sq is None:
            raise RuntimeError(f"{self.label}: backward() needs a forward in training mode first")
        delta_mu, delta_var = delta.delta_mu, delta.delta_var  # (B, O)
        if self.per_position:  # (B, T·O) → (B·T, O), the rows of the forward
            delta_mu = delta_mu.reshape(-1, self.output_size)
            delta_var = delta_var.reshape(-1, self.output_size)
        # out= keeps the (possibly flat-buffer) delta storage: views handed out stay live.
        torch.mm(delta_mu.t(), self._mu_a, out=self.delta_mu_w)  # (O, I)
        torch.mm(delta_var.t(), self._mu_a_sq, out=self.delta_var_w)
        if self.bias:
            torch.sum(delta_mu, 0, out=self.delta_mu_b)  # (O,)
            torch.sum(delta_var, 0, out=self.delta_var_b)
        if not need_input_delta:
            return None
        mu_w_sq = self._mu_w_sq if self._mu_w_sq is not None else self._weight_moments()[0]
        delta_mu_in = torch.mm(delta_mu, self.mu_w)  # (B, I)
        delta_var_in = torch.mm(delta_var, mu_w_sq)
        if self._jcb is not None:
            delta_mu_in.mul_(self._jcb)
            delta_var_in.mul_(self._jcb)
            if not self._jcb_is_mask:  # J ∈ {0, 1} (ReLU): J² = J, one pass saved
                delta_var_in.mul_(self._jcb)
        # The innovations have the shape of the state they belong to (views, no copy).
        return DeltaStates(delta_mu_in.view(self._in_shape), delta_var_in.view(self._in_shape))

    def __repr__(self) -> str:
        per_position = ", per_position=True" if self.per_position else ""
        return f"Linear({self.input_size}, {self.output_size}, bias={self.bias}{per_position})"


def _version(tensor: torch.Tensor) -> int | None:
    """torch's in-place write counter of `tensor`'s storage; None where torch keeps none
    (tensors made under torch.inference_mode), which disables caching."""
    try:
        return tensor._version
    except RuntimeError:
        return None
