"""Hierarchical binary softmax (HRC) class coding for TAGI classification (docs/tagi.md).

Shape legend: B batch, K num_classes, L = ceil(log2 K) observations per sample,
N = num_outputs network outputs (11 for K = 10).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch


def _tables(num_classes: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(observations (K, L) of ±1, 1-based output indices (K, L), number of outputs)."""
    depth = math.ceil(math.log2(num_classes))
    nodes = [num_classes]  # n_L = K, n_l = ceil(n_{l+1} / 2), built from the leaves up
    for _ in range(depth):
        nodes.insert(0, math.ceil(nodes[0] / 2))
    offsets = [1 + sum(nodes[:level + 1]) for level in range(depth)]  # o_l
    obs = torch.empty(num_classes, depth, dtype=torch.float64)
    idx = torch.empty(num_classes, depth, dtype=torch.int64)
    for label in range(num_classes):  # table construction only, K·L entries
        digits = [(label >> (depth - 1 - c)) & 1 for c in range(depth)]  # most significant first
        prefix = 0
        for c, digit in enumerate(digits):
            obs[label, c] = -1.0 if digit else 1.0
            idx[label, c] = 1 if c == 0 else prefix + offsets[c - 1]
            prefix = 2 * prefix + digit
    return obs, idx, int(idx.max())


LINKS = ("probit", "mean")
Link = Literal["probit", "mean"]


def _normal_pdf(t: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)


def _mean_link(mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """P_n = E[clip((1 + Z)/2, 0, 1)] for Z ~ N(m_n, v_n): the share of +1 observations that a
    Gaussian fit of ±1 targets estimates, m = 2P − 1, averaged over the output's uncertainty
    (the clip keeps a mean beyond ±1 a probability)."""
    std = var.clamp_min(1e-30).sqrt()
    low, high = (-1.0 - mu) / std, (1.0 - mu) / std
    cdf_low, cdf_high = torch.special.ndtr(low), torch.special.ndtr(high)
    # E[clip(Z, -1, 1)] = -P(Z < -1) + P(Z > 1) + E[Z; -1 <= Z <= 1]
    clipped = (mu * (cdf_high - cdf_low) + std * (_normal_pdf(low) - _normal_pdf(high))
               - cdf_low + (1.0 - cdf_high))
    return (0.5 * (1.0 + clipped)).clamp_(0.0, 1.0)


class HRCSoftmax:
    """Encodes labels as L binary observations on selected outputs; decodes class probabilities.

    `encode` feeds `OutputUpdater.update_using_indices`; `probabilities` gives
    P(class r) = Π_c (P_{idx_c} if y_c = +1 else 1 − P_{idx_c}), with the node probability P_n
    from the output's moments by `link`:
        "probit" (pytagi's): P_n = Φ(m_n / sqrt(1/α² + v_n)), α = 3;
        "mean": P_n = E[clip((1 + Z_n)/2, 0, 1)], Z_n ~ N(m_n, v_n): the output was fitted to ±1
            observations, so its mean estimates 2P − 1 (docs/tagi.md, Calibration).
    For K not a power of two they sum to < 1, which does not change the argmax.
    """

    def __init__(self, num_classes: int, alpha: float = 3.0, link: Link = "probit") -> None:
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"HRCSoftmax: num_classes must be an int >= 2, got {num_classes!r}")
        if link not in LINKS:
            raise ValueError(f"HRCSoftmax: link must be one of {LINKS}, got {link!r}")
        self.num_classes = num_classes
        self.alpha = float(alpha)
        self.link = link
        self.obs, self.idx, self.num_outputs = _tables(num_classes)  # (K, L), (K, L), N
        self.num_obs = self.obs.shape[1]
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _device_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on_device:
            self._on_device[device] = (self.obs.to(device), self.idx.to(device))
        return self._on_device[device]

    def encode(self, labels: Any, dtype: torch.dtype = torch.float32
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(y_obs (B, L) of ±1, y_idx (B, L) 1-based output indices) for integer labels (B,).

        Raises ValueError for labels that are not integers in [0, num_classes).
        """
        labels = torch.as_tensor(labels)
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
        if labels.dim() != 1:
            raise ValueError(f"labels must have shape (batch,), got {tuple(labels.shape)}")
        if labels.numel():
            low, high = torch.aminmax(labels)
            if low.item() < 0 or high.item() >= self.num_classes:
                at = int(((labels < 0) | (labels >= self.num_classes)).nonzero()[0, 0])
                raise ValueError(f"labels must be in [0, {self.num_classes}), got "
                                 f"{labels[at].item()} at index {at}")
        obs, idx = self._device_tables(labels.device)
        labels = labels.long()
        return obs[labels].to(dtype), idx[labels]

    def probabilities(self, mu: Any, var: Any) -> torch.Tensor:
        """(B, K) class probabilities from the output moments (B, N)."""
        mu = torch.as_tensor(mu)
        var = torch.as_tensor(var, dtype=mu.dtype, device=mu.device)
        if mu.dim() != 2 or mu.shape[1] != self.num_outputs or var.shape != mu.shape:
            raise ValueError(f"mu and var must both have shape (batch, {self.num_outputs}), got "
                             f"{tuple(mu.shape)} and {tuple(var.shape)}")
        obs, idx = self._device_tables(mu.device)
        if self.link == "mean":
            node = _mean_link(mu, var)  # (B, N)
        else:
            node = torch.special.ndtr(mu / torch.sqrt(var + 1.0 / self.alpha**2))
        chosen = node[:, idx - 1]  # (B, K, L)
        return torch.where(obs > 0, chosen, 1.0 - chosen).prod(-1)

    def predict(self, mu: Any, var: Any) -> torch.Tensor:
        """(B,) int64 most probable class."""
        return self.probabilities(mu, var).argmax(1)

    def __repr__(self) -> str:
        return f"HRCSoftmax(num_classes={self.num_classes}, link={self.link!r})"
