"""Normalisation layers (docs/tagi.md, BatchNorm2d and LayerNorm): BatchNorm2d, LayerNorm.

Shape legend: B batch, C features (after a Linear) or channels (after a convolution), H, W
image height and width; states are (B, C) or (B, C, H, W). γ, β (`mu_w, var_w`, `mu_b, var_b`)
are per feature / channel, shape (C,).

Both layers normalise with statistics (μ, σ²) of the input means and variances, treated as
constants (no derivative through them, as in cuTAGI)::

    r = 1/sqrt(σ² + ε),   x̂ = r (m_A − μ)
    m_Z = x̂ m_γ + m_β
    v_Z = r² v_A (m_γ² + v_γ) + v_γ x̂² + v_β
    backward: δm_in = r m_γ J δm,  δv_in = (r m_γ J)² δv
    deltas:   Δm_γ = v_γ Σ x̂ δm,  Δv_γ = v_γ² Σ x̂² δv,  Δm_β = v_β Σ δm,  Δv_β = v_β² Σ δv

summed over the batch (and positions). The statistics include the states' own variance,
with Bessel's correction on the total: σ² = (Σ (m_A − μ)² + Σ v_A) / (n − 1). BatchNorm takes
them per feature over the batch (and positions), LayerNorm per sample over its features.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from dptrain.tagi.base import ParamLayer
from dptrain.tagi.states import DeltaStates, HiddenStates

#: Maps this rank's (K,) statistics to the (world, K) stack of every rank's, in rank order.
StatsGather = Callable[[torch.Tensor], torch.Tensor]


def moments(mu_a: torch.Tensor, var_a: torch.Tensor | None, dims: tuple[int, ...]
            ) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(n, mean, M2) over `dims` (kept as size 1): M2 = Σ (m_A − mean)² + Σ v_A."""
    count = math.prod([mu_a.shape[d] for d in dims])  # a list: traceable
    if count == 0:  # a rank without a sample: weight 0 in `combine_moments`, and no NaN there
        shape = [1 if d in dims else n for d, n in enumerate(mu_a.shape)]
        return 0, mu_a.new_zeros(shape), mu_a.new_zeros(shape)
    mean = mu_a.mean(dims, keepdim=True)
    m2 = (mu_a - mean).square_().sum(dims, keepdim=True)
    if var_a is not None:
        m2.add_(var_a.sum(dims, keepdim=True))
    return count, mean, m2


def combine_moments(stacked: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Pool per-rank (n_r, mean_r, M2_r) rows [n, mean (C), M2 (C)] of a (world, 1 + 2C) stack:
    n = Σ n_r, mean = Σ n_r mean_r / n, M2 = Σ M2_r + Σ n_r (mean_r − mean)².

    Exact, and stable in float32 (Chan et al.): no Σ m² − n mean² cancellation. Every rank
    combines the same stack in the same order, so every rank gets the same bits.
    """
    width = (stacked.shape[1] - 1) // 2
    counts = stacked[:, :1]  # (world, 1)
    means, m2s = stacked[:, 1:1 + width], stacked[:, 1 + width:]
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
    return int(round(total.item())), mean, m2


def _norm_forward(mu_a: torch.Tensor, var_a: torch.Tensor | None, mean: torch.Tensor,
                  var: torch.Tensor, eps: float, mu_w: torch.Tensor, var_w: torch.Tensor,
                  mu_b: torch.Tensor | None, var_b: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m_Z, v_Z, x̂, r); statistics and parameters already shaped to broadcast."""
    r = torch.rsqrt(var + eps)
    x_hat = (mu_a - mean).mul_(r)
    mu_z = x_hat * mu_w
    var_z = x_hat.square().mul_(var_w)  # in place on temporaries: fewer full-size allocations
    if var_a is not None:
        var_z.add_((var_a * (r * r)).mul_(mu_w * mu_w + var_w))
    if mu_b is not None and var_b is not None:
        mu_z.add_(mu_b)
        var_z.add_(var_b)
    return mu_z, var_z, x_hat, r


class _Norm(ParamLayer):
    """What both norms share: γ, β (pytagi's init), the normalisation and its backward."""

    eps: float
    num_features: int

    def _init_gamma_beta(self, bias: bool, gain_weight: float, gain_bias: float) -> None:
        """m_γ = 1, v_γ = gain_w²/C; m_β = 0, v_β = gain_b²/C (cuTAGI: 2/(C + C))."""
        self.bias = bias
        shape = (self.num_features,)
        scale = 2.0 / (2 * self.num_features)
        self.bind("w", torch.ones(shape), torch.full(shape, scale * gain_weight ** 2),
                  torch.zeros(shape), torch.zeros(shape))
        if bias:
            self.bind("b", torch.zeros(shape), torch.full(shape, scale * gain_bias ** 2),
                      torch.zeros(shape), torch.zeros(shape))
        else:
            self.mu_b = self.var_b = self.delta_mu_b = self.delta_var_b = None

    def param_groups(self) -> list[tuple[str, tuple[int, ...]]]:
        groups = [("w", (self.num_features,))]
        if self.bias:
            groups.append(("b", (self.num_features,)))
        return groups

    def clear_cache(self) -> None:
        self._x_hat: torch.Tensor | None = None  # (B, C[, H, W]) normalised input mean
        self._gain: torch.Tensor | None = None  # r m_γ, broadcastable to the input
        self._jcb: torch.Tensor | None = None  # J of the input, None = 1

    def _per_channel(self, t: torch.Tensor | None, rank: int) -> torch.Tensor | None:
        """(C,) → (1, C) or (1, C, 1, 1), to broadcast over a state of `rank` dims."""
        return None if t is None else t.view((1, -1) + (1,) * (rank - 2))

    def _normalise(self, states: HiddenStates, mean: torch.Tensor, var: torch.Tensor
                   ) -> HiddenStates:
        rank = states.mu_a.dim()
        mu_w, var_w = self._per_channel(self.mu_w, rank), self._per_channel(self.var_w, rank)
        mu_z, var_z, x_hat, r = _norm_forward(
            states.mu_a, states.var_a, mean, var, self.eps, mu_w, var_w,
            self._per_channel(self.mu_b, rank), self._per_channel(self.var_b, rank))
        if self.training:
            self._x_hat, self._gain, self._jcb = x_hat, r * mu_w, states.jcb
        return HiddenStates(mu_z, var_z, None)

    def backward(self, delta: DeltaStates, need_input_delta: bool) -> DeltaStates | None:
        """Writes g_m = Σ x̂ δm, g_v = Σ x̂² δv (and Σ δm, Σ δv for β) into the delta buffers;
        Δ = v g_m, v² g_v follows in `scale_deltas_` (base.py)."""
        if self._x_hat is None or self._gain is None:
            raise RuntimeError(f"{self.label}: backward() needs a forward in training mode first")
        delta_mu, delta_var = delta.delta_mu, delta.delta_var
        dims = (0,) + tuple(range(2, delta_mu.dim()))  # all but the channel dim
        # out= keeps the flat-buffer delta storage (see Sequential._check_bindings).
        # In place only on fresh temporaries: `delta` may be shared (a residual block feeds the
        # same innovations to both branches). Same products in the same order as the formulas.
        torch.sum(self._x_hat * delta_mu, dims, out=self.delta_mu_w)
        torch.sum(self._x_hat.square().mul_(delta_var), dims, out=self.delta_var_w)
        if self.bias:
            torch.sum(delta_mu, dims, out=self.delta_mu_b)
            torch.sum(delta_var, dims, out=self.delta_var_b)
        if not need_input_delta:
            return None
        gain = self._gain if self._jcb is None else self._gain * self._jcb
        return DeltaStates(delta_mu * gain, (delta_var * gain).mul_(gain))


class BatchNorm2d(_Norm):
    """Normalise each feature (after a Linear, input (B, C)) or channel (after a convolution,
    input (B, C, H, W)) with the statistics of the batch (and positions) in training and with
    running averages of them in evaluation.

    The mode is decided once, from the rank of the first input (cuTAGI decides it twice and
    can disagree with itself after a conv stack followed by a Linear). Running statistics
    `mu_ra`, `var_ra` (C,) start at (0, 1); the first training batch sets them to its
    statistics, later ones update `ra ← momentum·ra + (1 − momentum)·batch` (pytagi's
    convention: `momentum` weighs the old value). `num_batches_tracked` counts training batches,
    so an evaluation forward before the first training batch does not change which batch sets
    the running statistics (cuTAGI's first-batch flag is cleared by any forward).
    All three are state (`state_dict` keys `<path>.mu_ra`, …), not parameters.

    Statistics over a single value (a (1, C) batch) are undefined (n − 1 = 0): an error.
    Under `DDPSequential(..., sync_batchnorm=True)` the statistics are those of the global
    batch: `stats_gather` (set by the wrapper) collects every rank's (n, mean, M2) and
    `combine_moments` pools them, so n counts the global batch.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.9,
                 bias: bool = True, gain_weight: float = 1.0, gain_bias: float = 1.0) -> None:
        if isinstance(num_features, bool) or not isinstance(num_features, int) or \
                num_features < 1:
            raise ValueError(f"BatchNorm2d: num_features must be a positive int, got "
                             f"{num_features!r}")
        if not eps > 0:
            raise ValueError(f"BatchNorm2d: eps must be > 0, got {eps!r}")
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"BatchNorm2d: momentum must be in [0, 1], got {momentum!r}")
        self.num_features, self.eps, self.momentum = num_features, float(eps), float(momentum)
        self.bias = bias
        super().__init__()
        self._init_gamma_beta(bias, gain_weight, gain_bias)
        self.mu_ra = torch.zeros(num_features)
        self.var_ra = torch.ones(num_features)
        self.num_batches_tracked = torch.zeros(())
        self.stats_gather: StatsGather | None = None
        self.input_rank: int | None = None
        """2 (per feature) or 4 (per channel), fixed by the first input."""
        self.mu_norm_batch: torch.Tensor | None = None
        """(C,) mean and variance of the last training batch (pytagi's names), for inspection."""
        self.var_norm_batch: torch.Tensor | None = None
        self.clear_cache()

    def state_groups(self) -> list[tuple[str, tuple[int, ...]]]:
        c = self.num_features
        return [("mu_ra", (c,)), ("var_ra", (c,)), ("num_batches_tracked", ())]

    def drop_forward(self) -> None:
        """Also the batch statistics kept for inspection (`mu_norm_batch`, `var_norm_batch`):
        a compiled step then leaves this layer's Python state as it found it."""
        super().drop_forward()
        self.mu_norm_batch = self.var_norm_batch = None

    def _check_input(self, mu_a: torch.Tensor) -> int:
        rank = mu_a.dim()
        if rank not in (2, 4) or mu_a.shape[1] != self.num_features:
            raise ValueError(f"{self.label}: expected input (batch, {self.num_features}) or "
                             f"(batch, {self.num_features}, H, W), got {tuple(mu_a.shape)}")
        if self.input_rank is None:
            self.input_rank = rank
        elif rank != self.input_rank:
            raise ValueError(f"{self.label}: normalises {self.input_rank}-d inputs (decided by "
                             f"its first input), got {tuple(mu_a.shape)}")
        return rank

    def forward(self, states: HiddenStates) -> HiddenStates:
        rank = self._check_input(states.mu_a)
        if not self.training:
            return self._normalise(states, self._per_channel(self.mu_ra, rank),
                                   self._per_channel(self.var_ra, rank))
        mean, var = self._batch_statistics(states, rank)
        self._update_running(mean, var)
        return self._normalise(states, self._per_channel(mean, rank),
                               self._per_channel(var, rank))

    def _batch_statistics(self, states: HiddenStates, rank: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, σ²) per channel, (C,) each, of this batch or, synchronised, the global one."""
        dims = (0,) + tuple(range(2, rank))
        count, mean, m2 = moments(states.mu_a, states.var_a, dims)
        mean, m2 = mean.reshape(-1), m2.reshape(-1)
        if self.stats_gather is not None:
            local = torch.cat([mean.new_full((1,), float(count)), mean, m2])
            count, mean, m2 = combine_moments(self.stats_gather(local))
        if count < 2:
            raise ValueError(f"{self.label}: batch statistics over "
                             f"{'a single value' if count else 'no value'} per "
                             f"{'feature' if rank == 2 else 'channel'} (input "
                             f"{tuple(states.mu_a.shape)}) are undefined; use a batch of 2 or "
                             f"more, or LayerNorm")
        var = m2.div_(count - 1)
        self.mu_norm_batch, self.var_norm_batch = mean, var
        return mean, var

    def _update_running(self, mean: torch.Tensor, var: torch.Tensor) -> None:
        # In place: the running statistics are views of the network's flat state buffer.
        if torch.compiler.is_compiling():  # traced: the first-batch test without a host read
            # (as a (1,) view: torch.compile drops in-place writes to a 0-dim view of a
            # buffer, torch 2.13)
            counter = self.num_batches_tracked.view(1)
            first = counter == 0
            for running, batch in ((self.mu_ra, mean), (self.var_ra, var)):
                running.copy_(torch.where(first, batch,
                                          running * self.momentum + batch * (1.0 - self.momentum)))
            counter.add_(1)
            return
        if self.num_batches_tracked.item() == 0:  # the first batch sets them (pytagi)
            self.mu_ra.copy_(mean)
            self.var_ra.copy_(var)
        else:
            self.mu_ra.mul_(self.momentum).add_(mean * (1.0 - self.momentum))
            self.var_ra.mul_(self.momentum).add_(var * (1.0 - self.momentum))
        self.num_batches_tracked.add_(1)

    def __repr__(self) -> str:
        extra = "" if self.bias else ", bias=False"
        return f"BatchNorm2d({self.num_features}{extra})"


class LayerNorm(_Norm):
    """Normalise each sample over its features: `normalized_shape` (N,) for (B, N) inputs,
    (C, H, W) for images (γ, β per channel, statistics over all C·H·W values of the sample).

    Same in training and evaluation; no state. (cuTAGI keeps the per-sample statistics in
    fields named `mu_ra`/`var_ra`, but they are not running averages.) Init: m_γ = 1,
    v_γ = 1/C, m_β = 0, v_β = 1/C.
    """

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-4,
                 bias: bool = True) -> None:
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else \
            tuple(normalized_shape)
        if len(shape) not in (1, 3) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
            raise ValueError(f"LayerNorm: normalized_shape must be (N,) or (C, H, W) of "
                             f"positive ints, got {normalized_shape!r}")
        if math.prod(shape) < 2:
            raise ValueError(f"LayerNorm: statistics over a single value are undefined, got "
                             f"normalized_shape {shape}")
        if not eps > 0:
            raise ValueError(f"LayerNorm: eps must be > 0, got {eps!r}")
        self.normalized_shape, self.num_features, self.eps = shape, shape[0], float(eps)
        self.bias = bias
        super().__init__()
        self._init_gamma_beta(bias, 1.0, 1.0)
        self.clear_cache()

    def forward(self, states: HiddenStates) -> HiddenStates:
        mu_a = states.mu_a
        if tuple(mu_a.shape[1:]) != self.normalized_shape:
            raise ValueError(f"{self.label}: expected input (batch, "
                             f"{', '.join(map(str, self.normalized_shape))}), got "
                             f"{tuple(mu_a.shape)}")
        dims = tuple(range(1, mu_a.dim()))
        count, mean, m2 = moments(mu_a, states.var_a, dims)  # (B, 1[, 1, 1]) each
        return self._normalise(states, mean, m2.div_(count - 1))

    def __repr__(self) -> str:
        extra = "" if self.bias else ", bias=False"
        return f"LayerNorm({list(self.normalized_shape)}{extra})"
