"""LSTM layer (docs/tagi.md, LSTM): pytagi's TAGI-LSTM, every time step of a window at once.

Shape legend: B batch, T seq_len, I input_size, O output_size, G = 4 gates in pytagi's order
forget (f), input (i), cell candidate (c), output (o); H = I + O, the width of [x_t, h_prev_t].
The weights are one (4·O, H) matrix, gate-major: rows [g·O, (g+1)·O) are gate g's (O, H) block,
its first I columns multiplying x_t and its last O the previous hidden state. Flattened
row-major this is pytagi's flat `mu_w` (w_pos_f = 0, w_pos_i = O·H, …); biases are (4·O,).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dptrain.tagi.base import ParamLayer, constant, init_scale
from dptrain.tagi.linear import _version
from dptrain.tagi.states import DeltaStates, HiddenStates

#: Gate order of the stacked weights and of the gate axis of `mu_ga`, `var_ga`, `jcb_ga`.
GATES = ("f", "i", "c", "o")


class LSTM(ParamLayer):
    """TAGI LSTM over windows of `seq_len` steps, pytagi 0.2.1's math (Vuong, Nguyen & Goulet,
    International Journal of Forecasting 41(1), 2025); docs/tagi.md, LSTM, has the equations.

    Input: (B, T, I) states, or the flat (B, T·I) (and (B·T·I,) as a network's first layer)
    that pytagi passes. Output: every time step's hidden state, (B, T, O); a following
    `Linear(T * O, n)` flattens it (pytagi's `Sequential(LSTM(1, 8, 5), LSTM(8, 8, 5),
    Linear(8 * 5, 1))`), a following LSTM takes it as its sequence.

    Gates: f, i, o = sigmoid, c = tanh of the Gaussian [x_t, h_prev_t] through the stacked
    weights, linearised like any activation. Cell and hidden states are products of Gaussians
    with the covariances pytagi keeps: Cov(i, c̃) over all H inputs, Cov(o, tanh c) over the I
    inputs only. As in pytagi 0.2.1, the previous states (h_prev, c_prev) of step t are NOT step
    t−1 of the same window: they are states carried over from the previous forward call, and
    only when `seq_len == 1` and the batch holds one sample (the online, one step at a time
    use); otherwise they are zero, and the T steps of a window are computed independently.

    Carried states (batch 1, seq_len 1): after each forward, `mu_h_prior, var_h_prior,
    mu_c_prior, var_c_prior` hold the step's hidden and cell states; a training `backward`
    replaces them by their posteriors given the innovations; the next forward starts from them.
    `reset_lstm_states()` zeroes them (pytagi's `net.reset_lstm_states()`); a forward whose
    batch size differs from the previous forward's does too, as in pytagi. They are not
    parameters: not in `state_dict`, not synchronised by a data-parallel wrapper (each rank
    carries its own shard's), dropped by `Sequential.to()`.

    What the last forward stored, per sample and time step (each (B, T, ·), for backward and
    for a smoother):
        mu_ha, var_ha: (B, T, H) moments of [x_t, h_prev_t] (var_ha None when all zero).
        mu_ga, var_ga, jcb_ga: (B, T, 4, O) gate moments after their activation and the
            activation's Jacobian, gates in `GATES` order; `mu_f_ga`, `var_i_ga`, `jcb_o_ga`, …
            are views of one gate.
        cov_i_c, cov_o_tanh_c: (B, T, O) Cov(i, c̃) and Cov(o, tanh c) (None when v_X = 0:
            a deterministic input and no carried variance make both 0).
        mu_c, var_c: (B, T, O) cell state; mu_ca, var_ca, jcb_ca: its tanh and J.
        mu_h_prev, var_h_prev, mu_c_prev, var_c_prev: (B, T, O) the previous states used.
        mu_h, var_h: (B, T, O) the output hidden states (also returned).
    `forward` runs `_previous_states`, `_gates`, `_cell_state`, `_hidden_state` in that order,
    each reading and writing these attributes, so a subclass (a smoothing LSTM) can add to any
    step; `backward` uses `_gate_coefficients` (∂h/∂ each gate's pre-activation).

    Parameters: `mu_w, var_w` (4·O, I + O), `mu_b, var_b` (4·O,), pytagi's init: m ~ N(0, s²),
    v = (gain·s)², s = sqrt(1/(I + O)) for "He" (pytagi's default), sqrt(2/(I + 2·O)) for
    "Xavier", the four gates drawn one after the other, weights before biases.
    """

    def __init__(self, input_size: int, output_size: int, seq_len: int, bias: bool = True,
                 gain_weight: float = 1.0, gain_bias: float = 1.0, init_method: str = "He",
                 *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        for name, value in (("input_size", input_size), ("output_size", output_size),
                            ("seq_len", seq_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LSTM: {name} must be a positive int, got {value!r}")
        self.input_size, self.output_size, self.seq_len = input_size, output_size, seq_len
        self.bias = bias
        super().__init__()
        width = input_size + output_size
        scale = init_scale(init_method, width, output_size)
        self._init_group("w", (4 * output_size, width), scale, gain_weight, dtype, device)
        if bias:
            self._init_group("b", (4 * output_size,), scale, gain_bias, dtype, device)
        else:
            self.mu_b = self.var_b = self.delta_mu_b = self.delta_var_b = None
        self.clear_cache()

    def param_groups(self) -> list[tuple[str, tuple[int, ...]]]:
        groups = [("w", (4 * self.output_size, self.input_size + self.output_size))]
        if self.bias:
            groups.append(("b", (4 * self.output_size,)))
        return groups

    def input_sample_shape(self) -> tuple[int, ...]:
        """(T, I): a network starting with an LSTM takes pytagi's flat (B, T·I) inputs."""
        return (self.seq_len, self.input_size)

    # ------------------------------------------------------------------ stored states
    def clear_cache(self) -> None:
        """Drop what the last forward stored and the carried states."""
        self.drop_forward()
        self.reset_lstm_states()

    def drop_forward(self) -> None:
        """Drop what the last forward stored; the carried states stay."""
        self.mu_ha = self.var_ha = self.mu_ga = self.var_ga = self.jcb_ga = None
        self.cov_i_c = self.cov_o_tanh_c = None
        self.mu_c = self.var_c = self.mu_ca = self.var_ca = self.jcb_ca = None
        self.mu_h = self.var_h = None
        self._jcb_in: torch.Tensor | None = None  # J of the input states, None = 1
        self._mu_ha_rows = self._mu_ha_sq = None  # (B·T, H) m_X and m_X²
        self._cov_sums = self._mu_ca_sq = None
        self._mu_g = self._var_g = self._jcb_g = self._sq_g = self._second_g = ()
        self._in_shape: tuple[int, ...] = ()
        self._trained = False
        self._weight_cache: dict[str, object] | None = None

    def reset_lstm_states(self) -> None:
        """Zero the carried hidden and cell states (pytagi's `reset_lstm_states`)."""
        self.mu_h_prev = self.var_h_prev = self.mu_c_prev = self.var_c_prev = None
        self.mu_h_prior = self.var_h_prior = self.mu_c_prior = self.var_c_prior = None
        self._batch_size: int | None = None
        self._prev_zero = True

    def lstm_states(self) -> tuple[torch.Tensor | None, ...]:
        """(mu_h_prior, var_h_prior, mu_c_prior, var_c_prior), each (B, T, O), the states the
        next forward starts from (None before a forward or after a reset)."""
        return self.mu_h_prior, self.var_h_prior, self.mu_c_prior, self.var_c_prior

    def set_lstm_states(self, mu_h: torch.Tensor, var_h: torch.Tensor, mu_c: torch.Tensor,
                        var_c: torch.Tensor) -> None:
        """Start the next forward from these states (pytagi's `set_LSTM_states`): each holds
        B·T·O values for a batch of B windows; a forward with another batch size resets them."""
        step = self.seq_len * self.output_size
        values = [torch.as_tensor(x, dtype=self.mu_w.dtype, device=self.mu_w.device)
                  for x in (mu_h, var_h, mu_c, var_c)]
        sizes = [v.numel() for v in values]
        if len(set(sizes)) != 1 or sizes[0] == 0 or sizes[0] % step:
            raise ValueError(f"{self.label}: set_lstm_states needs four arrays of B·{step} "
                             f"values each (B windows of seq_len x output_size), got sizes "
                             f"{sizes}")
        values = [v.reshape(-1, self.seq_len, self.output_size).clone() for v in values]
        self.mu_h_prior, self.var_h_prior, self.mu_c_prior, self.var_c_prior = values
        self._batch_size = values[0].shape[0]
        self._prev_zero = False

    def _previous_states(self, batch: int, like: torch.Tensor) -> None:
        """Set mu/var_h/c_prev for this forward: the carried priors when carrying (B = 1,
        T = 1), else zeros; a batch size other than the last forward's resets the carry."""
        if batch != self._batch_size:
            self.reset_lstm_states()
            self._batch_size = batch
        shape = (batch, self.seq_len, self.output_size)
        if self.mu_h_prior is None or self.mu_h_prior.shape != shape or \
                self.mu_h_prior.dtype != like.dtype or self.mu_h_prior.device != like.device:
            zeros = like.new_zeros(shape)
            self.mu_h_prior = self.var_h_prior = self.mu_c_prior = self.var_c_prior = zeros
            self._prev_zero = True  # lets forward and backward skip the f·c_prev terms
        self.mu_h_prev, self.var_h_prev = self.mu_h_prior, self.var_h_prior
        self.mu_c_prev, self.var_c_prev = self.mu_c_prior, self.var_c_prior

    @property
    def carries_states(self) -> bool:
        """True when the last forward carried its states to the next (B = 1, T = 1)."""
        return self.seq_len == 1 and self._batch_size == 1

    # ------------------------------------------------------------------ weights
    def _weights(self, name: str) -> torch.Tensor:
        """A product of the weights, computed at most once per parameter version and only
        when asked for (same caching rule as `Linear._weight_moments`):

        "total" m_W² + v_W (4·O, H), for the variance of the gates given v_X.
        "cov" (4·O, H): per output unit j and input k, the products w_i·w_c̃ (all H inputs),
            w_f·w_o, w_i·w_o, w_c̃·w_o (the I inputs only; the hidden columns zeroed), so one
            product with v_X gives every covariance sum of the forward.
        "pairs" (16·O, I): w_g·w_g' over the input columns for the 16 gate pairs (g, g'), for
            the variance innovation of the input.
        """
        mu_w, var_w = self.mu_w, self.var_w
        if torch.compiler.is_compiling():  # traced: no cached state to guard on
            cache: dict = {}
        else:
            version = _version(mu_w), _version(var_w)
            cache = self._weight_cache
            if (cache is None or cache["mu_w"] is not mu_w or cache["var_w"] is not var_w or
                    cache["version"] != version or version[0] is None):
                cache = self._weight_cache = {"mu_w": mu_w, "var_w": var_w, "version": version}
        if name not in cache:
            o, i = self.output_size, self.input_size
            gates = mu_w.view(4, o, i + o)
            if name == "total":
                value = torch.addcmul(var_w, mu_w, mu_w)
            elif name == "cov":  # (i, c̃), (f, o), (i, o), (c̃, o), three of them masked
                left, right, mask = _cov_pairs(mu_w, i, o)
                value = torch.index_select(gates, 0, left).mul_(torch.index_select(gates, 0, right))
                value = value.mul_(mask).view(4 * o, i + o)
            else:
                x_part = gates[:, :, :i]  # (4, O, I)
                value = (x_part[:, None] * x_part[None, :]).reshape(16 * o, i)
            cache[name] = value
        return cache[name]

    # ------------------------------------------------------------------ forward
    def _sequence(self, states: HiddenStates) -> tuple[torch.Tensor, ...]:
        """The input as (B, T, I) mean, variance (or None) and J (or None)."""
        mu = states.mu_a
        t, i = self.seq_len, self.input_size
        if mu.dim() == 3 and tuple(mu.shape[1:]) == (t, i):
            return mu, states.var_a, states.jcb
        if mu.dim() == 2 and mu.shape[1] == t * i:
            shape = (mu.shape[0], t, i)
        else:
            raise ValueError(f"{self.label}: expected input of shape (batch, {t}, {i}) or "
                             f"(batch, {t * i}), got {tuple(mu.shape)}")
        return tuple(None if x is None else x.reshape(shape)
                     for x in (mu, states.var_a, states.jcb))

    def forward(self, states: HiddenStates) -> HiddenStates:
        mu_x, var_x, jcb = self._sequence(states)  # (B, T, I)
        self._previous_states(mu_x.shape[0], mu_x)
        self._gates(mu_x, var_x)
        self._cell_state()
        mu_h, var_h = self._hidden_state()
        if self.carries_states:  # the next forward starts from this step's states
            self.mu_h_prior, self.var_h_prior = mu_h, var_h
            self.mu_c_prior, self.var_c_prior = self.mu_c, self.var_c
            self._prev_zero = False
        self._trained = self.training
        if self.training:
            self._jcb_in, self._in_shape = jcb, tuple(states.mu_a.shape)
        return HiddenStates(mu_h, var_h, None)

    def _gates(self, mu_x: torch.Tensor, var_x: torch.Tensor | None) -> None:
        """X = [x_t, h_prev_t] and the four gates' moments (`mu_ha` … `jcb_ga`), plus the
        weighted sums of v_X behind the two covariances (`_cov_sums`, None when v_X = 0)."""
        batch, t, o = mu_x.shape[0], self.seq_len, self.output_size
        rows, width = batch * t, self.input_size + o
        mu_ha = torch.cat((mu_x, self.mu_h_prev), dim=2)  # (B, T, H)
        mu_rows = mu_ha.view(rows, width)  # 2-D from here on: F.linear on 3-D adds views
        mu_rows_sq = mu_rows * mu_rows
        var_ha = None
        if var_x is not None or not self._prev_zero:
            var_in = var_x if var_x is not None else torch.zeros_like(mu_x)
            var_ha = torch.cat((var_in, self.var_h_prev), dim=2)
        # All four gates of all T steps in one product per moment: (B·T, 4·O).
        mu_z = F.linear(mu_rows, self.mu_w, self.mu_b)
        var_z = F.linear(mu_rows_sq, self.var_w, self.var_b)
        self._cov_sums = None
        if var_ha is not None:
            var_rows = var_ha.view(rows, width)
            var_z.addmm_(var_rows, self._weights("total").t())
            self._cov_sums = torch.mm(var_rows, self._weights("cov").t()).view(batch, t, 4, o)
        self.mu_ha, self.var_ha = mu_ha, var_ha
        self._mu_ha_rows, self._mu_ha_sq = mu_rows, mu_rows_sq  # (B·T, H), for backward
        self.mu_ga, self.var_ga, self.jcb_ga = _gate_moments(mu_z.view(batch, t, 4, o),
                                                             var_z.view(batch, t, 4, o))
        sq_ga = self.mu_ga * self.mu_ga  # m² of every gate
        # Per-gate (B, T, O) views, split once: (f, i, c̃, o) each.
        self._mu_g, self._var_g, self._jcb_g = (x.unbind(2) for x in (self.mu_ga, self.var_ga,
                                                                        self.jcb_ga))
        self._sq_g, self._second_g = sq_ga.unbind(2), (sq_ga + self.var_ga).unbind(2)  # E[g²]

    def _cell_state(self) -> None:
        """c = f·c_prev + i·c̃ with f and c_prev independent and Cov(i, c̃) kept (`cov_i_c`,
        `mu_c`, `var_c`), then tanh(c) linearised (`mu_ca`, `var_ca`, `jcb_ca`)."""
        mu_f, mu_i, mu_cg, _ = self._mu_g
        var_f, var_i, var_cg, _ = self._var_g
        prod_ic = mu_i * mu_cg
        # v_c = v_c̃ E[i²] + v_i m_c̃² + Cov·(Cov + 2 m_i m_c̃) (+ the f·c_prev terms)
        var_c = var_cg * self._second_g[1]
        var_c.addcmul_(var_i, self._sq_g[2])
        cov_i_c, mu_c = None, prod_ic
        if self._cov_sums is not None:
            cov_i_c = self._jcb_g[1] * self._jcb_g[2] * self._cov_sums[:, :, 0]
            mu_c = prod_ic + cov_i_c
            var_c.addcmul_(cov_i_c, mu_c + prod_ic)
        if not self._prev_zero:
            mu_c_prev = self.mu_c_prev
            mu_c = torch.addcmul(mu_c, mu_f, mu_c_prev)
            var_c.addcmul_(self.var_c_prev, self._second_g[0])
            var_c.addcmul_(var_f, mu_c_prev * mu_c_prev)
        self.cov_i_c, self.mu_c, self.var_c = cov_i_c, mu_c, var_c
        self.mu_ca = torch.tanh(mu_c)
        self._mu_ca_sq = self.mu_ca * self.mu_ca
        self.jcb_ca = constant(1.0, var_c) - self._mu_ca_sq
        self.var_ca = self.jcb_ca * self.jcb_ca * var_c

    def _hidden_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """h = o·tanh(c) with Cov(o, tanh c) kept, through the gates that share inputs with o
        (`cov_o_tanh_c`, `mu_h`, `var_h`)."""
        _, mu_i, mu_cg, mu_o = self._mu_g
        jcb_f, jcb_i, jcb_cg, jcb_o = self._jcb_g
        prod_h = mu_o * self.mu_ca
        var_h = self.var_ca * self._second_g[3]
        var_h.addcmul_(self._var_g[3], self._mu_ca_sq)
        cov_o_tanh_c, mu_h, sums = None, prod_h, self._cov_sums
        if sums is not None:
            paths = jcb_i * mu_cg * sums[:, :, 2]
            paths.addcmul_(jcb_cg * mu_i, sums[:, :, 3])
            if not self._prev_zero:
                paths.addcmul_(jcb_f * self.mu_c_prev, sums[:, :, 1])
            cov_o_tanh_c = paths.mul_(jcb_o).mul_(self.jcb_ca)
            mu_h = prod_h + cov_o_tanh_c
            var_h.addcmul_(cov_o_tanh_c, mu_h + prod_h)
        self.cov_o_tanh_c, self.mu_h, self.var_h = cov_o_tanh_c, mu_h, var_h
        return mu_h, var_h

    # ------------------------------------------------------------------ backward
    def backward(self, delta: DeltaStates, need_input_delta: bool) -> DeltaStates | None:
        """Writes g_m, g_v of every gate's weights and biases (Δ = v g_m, v² g_v follows in
        `scale_deltas_`, base.py); returns the input's innovations; when carrying states,
        replaces the carried priors by their posteriors."""
        if not self._trained or self.mu_ga is None:
            raise RuntimeError(f"{self.label}: backward() needs a forward in training mode first")
        shape = self.mu_h.shape
        delta_mu, delta_var = delta.delta_mu, delta.delta_var  # (B, T, O)
        if delta_mu.shape != shape:  # from a Linear head: (B, T·O)
            delta_mu, delta_var = delta_mu.reshape(shape), delta_var.reshape(shape)
        batch, t, o = shape
        rows = batch * t
        coef = self._gate_coefficients()
        coef_mu = (coef * delta_mu.unsqueeze(2)).view(rows, 4 * o)
        coef_var = (coef * coef).mul_(delta_var.unsqueeze(2)).view(rows, 4 * o)
        # Linear's rule with δ replaced by a_g δ: one product for all four gates, (4·O, H).
        torch.mm(coef_mu.t(), self._mu_ha_rows, out=self.delta_mu_w)
        torch.mm(coef_var.t(), self._mu_ha_sq, out=self.delta_var_w)
        if self.bias:
            torch.sum(coef_mu, 0, out=self.delta_mu_b)
            torch.sum(coef_var, 0, out=self.delta_var_b)
        if self.carries_states:
            self._update_carried(delta_mu, delta_var)
        if not need_input_delta:
            return None
        return self._input_innovations(coef, coef_mu, delta_var)

    def _gate_coefficients(self) -> torch.Tensor:
        """a_g = ∂h/∂(gate g's pre-activation) per sample, step and unit, (B, T, 4, O): through
        tanh(c) for f, i, c̃, straight for o, with the other factors at their means."""
        _, mu_i, mu_cg, mu_o = self._mu_g
        through_cell = self.jcb_ca * mu_o
        # zero previous cells (nothing carried) give a_f = 0: the zeros themselves serve
        f_path = self.mu_c_prev if self._prev_zero else through_cell * self.mu_c_prev
        return self.jcb_ga * torch.stack((f_path,
                                          through_cell * mu_cg, through_cell * mu_i,
                                          self.mu_ca), dim=2)

    def _input_innovations(self, coef: torch.Tensor, coef_mu: torch.Tensor,
                           delta_var: torch.Tensor) -> DeltaStates:
        """δ of the step inputs x (not of h_prev), in the shape the input came in."""
        batch, t, o = delta_var.shape
        rows, i = batch * t, self.input_size
        delta_mu_in = torch.mm(coef_mu, self.mu_w[:, :i])  # (B·T, I)
        # δv_x = Σ_j δv_j (Σ_g a_g,j w_g,jx)²: the square of a sum over gates, so each gate
        # pair (g, g') contributes a_g a_g' δv against w_g w_g' (one product, 16·O wide).
        pair_coef = (coef.unsqueeze(3) * coef.unsqueeze(2)) * delta_var[:, :, None, None, :]
        delta_var_in = torch.mm(pair_coef.view(rows, 16 * o), self._weights("pairs"))
        if self._jcb_in is not None:
            jcb = self._jcb_in.reshape(rows, i)
            delta_mu_in = delta_mu_in * jcb
            delta_var_in = delta_var_in * jcb * jcb
        return DeltaStates(delta_mu_in.view(self._in_shape), delta_var_in.view(self._in_shape))

    def _update_carried(self, delta_mu: torch.Tensor, delta_var: torch.Tensor) -> None:
        """Posterior of the carried h and c given the innovations of h (pytagi's rule):
        Cov(h, h) = v_h; Cov(c, h) ≈ v_c · J_tanh(c) · m_o."""
        var_h = self.var_h_prior
        self.mu_h_prior = self.mu_h_prior + delta_mu * var_h
        self.var_h_prior = (1 + delta_var * var_h) * var_h
        gain = self.var_c_prior * self.jcb_ca * self._mu_g[3]
        self.mu_c_prior = self.mu_c_prior + gain * delta_mu
        self.var_c_prior = self.var_c_prior + gain * delta_var * gain

    def __repr__(self) -> str:
        return f"LSTM({self.input_size}, {self.output_size}, {self.seq_len}, bias={self.bias})"


def _gate_moments(mu_z: torch.Tensor, var_z: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, v, J) of the gates (B, T, 4, O): sigmoid for f, i, o, tanh for c̃, linearised.

    J = (1 − m)(m + e) with e = 1 for c̃, 0 elsewhere: m(1 − m) for a sigmoid, 1 − m² for tanh.
    """
    mu = torch.sigmoid(mu_z)
    if torch.compiler.is_compiling():  # a compiled step takes no strided out=, and fuses this
        mu[:, :, 2] = torch.tanh(mu_z[:, :, 2])
    else:
        torch.tanh(mu_z[:, :, 2], out=mu[:, :, 2])
    jcb = (constant(1.0, mu) - mu).mul_(mu + _cell_gate_indicator(mu))
    return mu, jcb * jcb * var_z, jcb


_INDICATORS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_COV_PAIRS: dict[tuple[int, int, torch.dtype, torch.device], tuple[torch.Tensor, ...]] = {}


def _cov_pairs(like: torch.Tensor, i: int, o: int) -> tuple[torch.Tensor, ...]:
    """Gate indices (1, 0, 1, 2) and (2, 3, 3, 3) of the four weight products behind the
    forward's covariances, and the (4, 1, I + O) mask keeping the hidden columns of the first
    only; made once per shape (three ops per step instead of a dozen)."""
    key = (i, o, like.dtype, like.device)
    if key not in _COV_PAIRS:
        mask = torch.ones(4, 1, i + o, dtype=like.dtype, device=like.device)
        mask[1:, :, i:] = 0
        _COV_PAIRS[key] = (torch.tensor([1, 0, 1, 2], device=like.device),
                           torch.tensor([2, 3, 3, 3], device=like.device), mask)
    return _COV_PAIRS[key]


def _cell_gate_indicator(like: torch.Tensor) -> torch.Tensor:
    """(4, 1) column (0, 0, 1, 0) in `like`'s dtype and device, made once."""
    key = (like.dtype, like.device)
    if key not in _INDICATORS:
        _INDICATORS[key] = torch.tensor([[0.0], [0.0], [1.0], [0.0]], dtype=like.dtype,
                                        device=like.device)
    return _INDICATORS[key]


def _gate_view(kind: str, index: int) -> property:
    def get(self: LSTM) -> torch.Tensor | None:
        stacked = getattr(self, f"{kind}_ga")
        return None if stacked is None else stacked[:, :, index]
    return property(get, doc=f"(B, T, O) {kind} of gate {GATES[index]} (a view of {kind}_ga)")


def _add_gate_views() -> None:
    """LSTM.mu_f_ga, var_f_ga, jcb_f_ga, … mu_o_ga: pytagi's per-gate names, as views."""
    for index, gate in enumerate(GATES):
        for kind in ("mu", "var", "jcb"):
            setattr(LSTM, f"{kind}_{gate}_ga", _gate_view(kind, index))


_add_gate_views()
