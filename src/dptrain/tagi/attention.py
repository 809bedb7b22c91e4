"""Causal multi-head self-attention with grouped key/value heads and RoPE (docs/tagi.md,
MultiheadAttention and RMSNorm), cuTAGI main's layer on torch tensors.

Shape legend: B batch, T positions, E `embed_dim`, H `num_heads`, G `num_kv_heads` (H/G query
heads share one key/value head), D = E/H head size, P = (H + 2G)·D projected features.
States are cuTAGI's flat (B, T·E), position t at columns [t·E, (t+1)·E) (what `Embedding`
outputs), or (B, T, E); the output has the input's shape. T is read from each input.

Forward, per position a Linear (weights (P, E): the Q, K, V blocks stacked) and per head::

    q, k, v = projection of x (k, v of the head's group)      exact moments, as Linear
    q, k ← RoPE(q), RoPE(k)       pairs (2i, 2i+1) rotated by t·θ^(−2i/D); v' = c² v₁ + s² v₂
    s[t, u] = Σ_d q[t, d] k[u, d]           (no 1/sqrt(D) scale, as cuTAGI) product moments
    s[t, u] = 0 (mean and variance) for u > t                        (the causal mask)
    a[t, ·] = Remax(s[t, ·]),  J = its Jacobian;  a[t, u] = 0, J = 0 for u > t
    o[t, d] = Σ_u a[t, u] v[u, d]                                     product moments

Backward (innovations δ; posterior m + v δ, as every layer), with the means of the forward::

    δv[u] = Σ_t a[t, u] δo[t]      δa[t, u] = Σ_d v[u, d] δo[t, d]     δs = J δa (masked)
    δq[t] = Σ_u δs[t, u] k[u]      δk[u] = Σ_t δs[t, u] q[t]           (δv: squares of all)
    RoPE back: δx = Rᵀ δy,  projection back as Linear (J of the input applied)

Parameters `mu_w, var_w` (P, E), `mu_b, var_b` (P,). Init (cuTAGI's): Q, K and V blocks each
as a Linear of their own (fan-out H·D or G·D), drawn in the order Q, K, V (weights then bias).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dptrain.tagi import _rng
from dptrain.tagi.base import ParamLayer, init_scale
from dptrain.tagi.remax import Remax
from dptrain.tagi.softmax import masked_softmax_moments
from dptrain.tagi.states import DeltaStates, HiddenStates

Pair = tuple[torch.Tensor, torch.Tensor]
ATTENTION_WEIGHTS = ("remax", "softmax")


def split_qkv(mu_p: torch.Tensor, var_p: torch.Tensor, batch: int, steps: int, heads: int,
              kv_heads: int, head_dim: int) -> tuple[Pair, Pair, Pair]:
    """(B·T, P) projection → q (B, H, T, D), k and v (B, G, T, D), (mean, variance) each.

    cuTAGI main reads its projection buffer with the strides of a (3, B, T, E) array instead
    (docs/tagi.md, MultiheadAttention and RMSNorm)."""
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    out = []
    for mu, var in zip(mu_p.split(sizes, 1), var_p.split(sizes, 1)):
        n = mu.shape[1] // head_dim
        out.append(tuple(t.reshape(batch, steps, n, head_dim).transpose(1, 2)
                         for t in (mu, var)))
    return out[0], out[1], out[2]


def merge_qkv(q: Pair, k: Pair, v: Pair, batch: int, steps: int) -> Pair:
    """The inverse of `split_qkv` for innovations: (B·T, P) mean and variance parts."""
    parts = [tuple(t.transpose(1, 2).reshape(batch * steps, -1) for t in pair)
             for pair in (q, k, v)]
    return (torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1))


def score_innovations(delta_mu_o: torch.Tensor, delta_var_o: torch.Tensor, mu_a: torch.Tensor,
                      mu_v: torch.Tensor) -> Pair:
    """δa[t, u] = Σ_d m_v[u, d] δo[t, d] (and the squares for δv), (B, H, T, T)."""
    return (delta_mu_o @ mu_v.transpose(-1, -2),
            delta_var_o @ (mu_v * mu_v).transpose(-1, -2))


def qk_innovations(delta_mu_s: torch.Tensor, delta_var_s: torch.Tensor, mu_q: torch.Tensor,
                   mu_k: torch.Tensor, heads: int) -> tuple[Pair, Pair]:
    """(δq, δk) from the masked score innovations, (B, H, T, D) each:
    δq[t] = Σ_u δs[t, u] m_k[u], δk[u] = Σ_t δs[t, u] m_q[t]."""
    q = (delta_mu_s @ mu_k, delta_var_s @ (mu_k * mu_k))
    k = (delta_mu_s.transpose(-1, -2) @ mu_q, delta_var_s.transpose(-1, -2) @ (mu_q * mu_q))
    return q, k


class MultiheadAttention(ParamLayer):
    """Causal self-attention of TAGI Gaussians (see the module docstring for the equations).

    `num_kv_heads` (default `num_heads`) must divide `num_heads`. `use_rope` rotates queries and
    keys by position (RoPE, base `rope_theta`, positions < `max_seq_len`; D must be even).
    `init_method` "Xavier" (default, cuTAGI's) or "He"; the gains scale only the variances.
    `weights` turns scores into attention weights: "remax" (cuTAGI's: ReLU, then the ratio to
    the row's sum) or "softmax" (dptrain's: the closed-form moments of the softmax over the
    row, `masked_softmax_moments`; docs/tagi.md, Attention weights). `score_scale` c (dptrain's)
    multiplies every score, as 1/sqrt(D) does in a torch transformer.
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None,
                 bias: bool = True, gain_weight: float = 1.0, gain_bias: float = 1.0,
                 init_method: str = "Xavier", use_rope: bool = True,
                 rope_theta: float = 10000.0, max_seq_len: int = 2048, *,
                 score_scale: float = 1.0, weights: str = "remax",
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads), ("max_seq_len", max_seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MultiheadAttention: {name} must be a positive int, "
                                 f"got {value!r}")
        if embed_dim % num_heads:
            raise ValueError(f"MultiheadAttention: embed_dim {embed_dim} is not a multiple of "
                             f"num_heads {num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"MultiheadAttention: num_kv_heads {num_kv_heads} does not divide "
                             f"num_heads {num_heads}")
        head_dim = embed_dim // num_heads
        if use_rope and head_dim % 2:
            raise ValueError(f"MultiheadAttention: RoPE rotates pairs of features, so the head "
                             f"size embed_dim/num_heads must be even, got {head_dim}")
        if use_rope and not rope_theta > 0:
            raise ValueError(f"MultiheadAttention: rope_theta must be > 0, got {rope_theta!r}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim, self.bias = head_dim, bias
        self.use_rope, self.rope_theta = bool(use_rope), float(rope_theta)
        self.max_seq_len = max_seq_len
        if not score_scale > 0:
            raise ValueError(f"MultiheadAttention: score_scale must be > 0, got {score_scale!r}")
        self.score_scale = float(score_scale)
        if weights not in ATTENTION_WEIGHTS:
            raise ValueError(f"MultiheadAttention: weights must be one of {ATTENTION_WEIGHTS}, "
                             f"got {weights!r}")
        self.weights = weights
        self.gain_weight, self.gain_bias, self.init_method = gain_weight, gain_bias, init_method
        super().__init__()
        self._remax = Remax()
        self._init_params(dtype, device)
        self.clear_cache()

    @property
    def projected_size(self) -> int:
        """P = (H + 2G)·D, the rows of `mu_w`."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def _init_params(self, dtype: torch.dtype, device: torch.device | str | None) -> None:
        e = self.embed_dim
        weights, biases = [], []
        scales = []
        for out in (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                    self.num_kv_heads * self.head_dim):
            scale = init_scale(self.init_method, e, out)
            scales.append((scale, out))
            weights.append(_rng.normal((out, e), scale))
            if self.bias:
                biases.append(_rng.normal((out,), scale))

        def variances(gain: float, per_row: bool) -> torch.Tensor:
            return torch.cat([torch.full((out, e) if per_row else (out,), (gain * s) ** 2,
                                         dtype=torch.float64) for s, out in scales])

        mu_w = torch.cat(weights).to(dtype=dtype, device=device)
        var_w = variances(self.gain_weight, True).to(dtype=dtype, device=device)
        self.bind("w", mu_w, var_w, torch.zeros_like(mu_w), torch.zeros_like(mu_w))
        if self.bias:
            mu_b = torch.cat(biases).to(dtype=dtype, device=device)
            var_b = variances(self.gain_bias, False).to(dtype=dtype, device=device)
            self.bind("b", mu_b, var_b, torch.zeros_like(mu_b), torch.zeros_like(mu_b))
        else:
            self.mu_b = self.var_b = self.delta_mu_b = self.delta_var_b = None

    def param_groups(self) -> list[tuple[str, tuple[int, ...]]]:
        groups = [("w", (self.projected_size, self.embed_dim))]
        if self.bias:
            groups.append(("b", (self.projected_size,)))
        return groups

    def input_sample_shape(self) -> tuple[int, ...]:
        """(E,): pytagi's flat (n·E,) array is n one-position samples, as cuTAGI reads it; a
        (B, T·E) tensor is taken as it comes."""
        return (self.embed_dim,)

    def clear_cache(self) -> None:
        self._saved: dict | None = None  # what the last training forward keeps for backward

    def _rope_tables(self, steps: int, like: torch.Tensor) -> Pair:
        """(cos, sin) of t·θ^(−2i/D), (T, D/2), computed in float64 then cast."""
        half = self.head_dim // 2
        freq = self.rope_theta ** (-2.0 * torch.arange(half, dtype=torch.float64)
                                   / self.head_dim)
        angle = torch.arange(steps, dtype=torch.float64)[:, None] * freq
        return (angle.cos().to(like.dtype).to(like.device),
                angle.sin().to(like.dtype).to(like.device))

    @staticmethod
    def _rotate(mu: torch.Tensor, var: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                transpose: bool = False) -> Pair:
        """y = R x on pairs (2i, 2i+1) (x = Rᵀ y with `transpose`); variances through R²."""
        if transpose:
            sin = -sin
        m1, m2 = mu[..., 0::2], mu[..., 1::2]
        v1, v2 = var[..., 0::2], var[..., 1::2]
        c2, s2 = cos * cos, sin * sin
        mu_out = torch.stack((m1 * cos - m2 * sin, m1 * sin + m2 * cos), -1).flatten(-2)
        var_out = torch.stack((v1 * c2 + v2 * s2, v1 * s2 + v2 * c2), -1).flatten(-2)
        return mu_out, var_out

    def _expand(self, t: torch.Tensor) -> torch.Tensor:
        """(B, G, …) → (B, H, …): query head h reads key/value head h // (H/G)."""
        reps = self.num_heads // self.num_kv_heads
        return t if reps == 1 else t.repeat_interleave(reps, 1)

    def _fold(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H, …) → (B, G, …), summing the innovations of the heads sharing a group."""
        reps = self.num_heads // self.num_kv_heads
        return t if reps == 1 else t.unflatten(1, (self.num_kv_heads, reps)).sum(2)

    def forward(self, states: HiddenStates) -> HiddenStates:
        mu_x, e = states.mu_a, self.embed_dim
        batch = mu_x.shape[0]
        width = math.prod(mu_x.shape[1:])
        if mu_x.dim() not in (2, 3) or width % e or mu_x.shape[-1] % e or width == 0:
            raise ValueError(f"{self.label}: expected input (batch, T·{e}) or (batch, T, {e}), "
                             f"got {tuple(mu_x.shape)}")
        steps = width // e
        if self.use_rope and steps > self.max_seq_len:
            raise ValueError(f"{self.label}: {steps} positions exceed max_seq_len "
                             f"{self.max_seq_len}")
        x = mu_x.reshape(batch * steps, e)
        x_sq = x * x
        mu_p = F.linear(x, self.mu_w, self.mu_b)  # (B·T, P)
        var_p = F.linear(x_sq, self.var_w, self.var_b)
        if states.var_a is not None:
            var_p.addmm_(states.var_a.reshape(batch * steps, e),
                         (self.mu_w * self.mu_w + self.var_w).t())
        q, k, v = split_qkv(mu_p, var_p, batch, steps, self.num_heads, self.num_kv_heads,
                            self.head_dim)
        tables = None
        if self.use_rope:
            tables = self._rope_tables(steps, mu_p)
            q, k = self._rotate(*q, *tables), self._rotate(*k, *tables)
        mu_k, var_k = self._expand(k[0]), self._expand(k[1])
        mu_v, var_v = self._expand(v[0]), self._expand(v[1])
        (mu_q, var_q) = q
        mu_s, var_s = _product_moments(mu_q, var_q, mu_k.transpose(-1, -2),
                                       var_k.transpose(-1, -2))  # (B, H, T, T)
        if self.score_scale != 1.0:
            mu_s, var_s = mu_s * self.score_scale, var_s * self.score_scale ** 2
        future = torch.ones(steps, steps, dtype=torch.bool, device=mu_x.device).triu_(1)
        if self.weights == "softmax":
            mu_a, var_a, jcb = masked_softmax_moments(mu_s, var_s, ~future)
        else:
            mu_s, var_s = mu_s.masked_fill(future, 0.0), var_s.masked_fill(future, 0.0)
            mu_a, var_a, jcb = self._remax.moments(mu_s.reshape(-1, steps),
                                                   var_s.reshape(-1, steps))
            # Remax floors every weight, the masked ones too: zeroed, no future value is read
            mu_a, var_a, jcb = (t.view(mu_s.shape).masked_fill(future, 0.0)
                                for t in (mu_a, var_a, jcb))
        mu_o, var_o = _product_moments(mu_a, var_a, mu_v, var_v)  # (B, H, T, D)
        shape = mu_x.shape
        mu_o = mu_o.transpose(1, 2).reshape(shape)
        var_o = var_o.transpose(1, 2).reshape(shape)
        if self.training:
            self._saved = dict(x=x, x_sq=x_sq, jcb=states.jcb, shape=shape, steps=steps,
                               mu_q=mu_q, mu_k=mu_k, mu_v=mu_v, mu_a=mu_a,
                               jcb_s=jcb, tables=tables)
        return HiddenStates(mu_o, var_o, None)

    def backward(self, delta: DeltaStates, need_input_delta: bool) -> DeltaStates | None:
        """Writes g_m = δPᵀ m_X, g_v = δPᵥᵀ m_X² (summed over batch and positions) and the bias
        sums; Δ = v g_m, v² g_v follows in `scale_deltas_` (base.py)."""
        saved = self._saved
        if saved is None:
            raise RuntimeError(f"{self.label}: backward() needs a forward in training mode first")
        batch, steps = saved["shape"][0], saved["steps"]
        heads, d = self.num_heads, self.head_dim

        def per_head(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch, steps, heads, d).transpose(1, 2)

        d_mu_o, d_var_o = per_head(delta.delta_mu), per_head(delta.delta_var)
        mu_a = saved["mu_a"]
        d_v = (self._fold(mu_a.transpose(-1, -2) @ d_mu_o),
               self._fold((mu_a * mu_a).transpose(-1, -2) @ d_var_o))
        d_mu_a, d_var_a = score_innovations(d_mu_o, d_var_o, mu_a, saved["mu_v"])
        jcb = saved["jcb_s"]
        d_mu_s, d_var_s = d_mu_a * jcb, d_var_a * (jcb * jcb)
        if self.score_scale != 1.0:  # s = c q·k: the innovations of q·k are c times those of s
            d_mu_s, d_var_s = d_mu_s * self.score_scale, d_var_s * self.score_scale ** 2
        d_q, d_k = qk_innovations(d_mu_s, d_var_s, saved["mu_q"], saved["mu_k"], heads)
        d_k = (self._fold(d_k[0]), self._fold(d_k[1]))
        if saved["tables"] is not None:
            d_q = self._rotate(*d_q, *saved["tables"], transpose=True)
            d_k = self._rotate(*d_k, *saved["tables"], transpose=True)
        d_mu_p, d_var_p = merge_qkv(d_q, d_k, d_v, batch, steps)  # (B·T, P)
        torch.mm(d_mu_p.t(), saved["x"], out=self.delta_mu_w)
        torch.mm(d_var_p.t(), saved["x_sq"], out=self.delta_var_w)
        if self.bias:
            torch.sum(d_mu_p, 0, out=self.delta_mu_b)
            torch.sum(d_var_p, 0, out=self.delta_var_b)
        if not need_input_delta:
            return None
        d_mu_x = torch.mm(d_mu_p, self.mu_w)  # (B·T, E)
        d_var_x = torch.mm(d_var_p, self.mu_w * self.mu_w)
        shape = saved["shape"]
        d_mu_x, d_var_x = d_mu_x.reshape(shape), d_var_x.reshape(shape)
        if saved["jcb"] is not None:
            jcb_x = saved["jcb"]
            d_mu_x = d_mu_x * jcb_x
            d_var_x = d_var_x * jcb_x * jcb_x
        return DeltaStates(d_mu_x, d_var_x)

    def __repr__(self) -> str:
        return (f"MultiheadAttention({self.embed_dim}, heads={self.num_heads}, "
                f"kv_heads={self.num_kv_heads}, bias={self.bias}, rope={self.use_rope}, "
                f"weights={self.weights!r})")


def _product_moments(mu_a: torch.Tensor, var_a: torch.Tensor, mu_b: torch.Tensor,
                     var_b: torch.Tensor) -> Pair:
    """Moments of A @ B with independent Gaussian entries:
    m = m_A m_B, v = v_A v_B + v_A m_B² + m_A² v_B (batched matrix products)."""
    mu = mu_a @ mu_b
    var = var_a @ (var_b + mu_b * mu_b) + (mu_a * mu_a) @ var_b
    return mu, var
