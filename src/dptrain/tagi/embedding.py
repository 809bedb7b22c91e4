"""Embedding layer: a Gaussian vector per category, looked up by id (docs/tagi.md, Embedding).

Shape legend: B batch, N ids per sample (`input_size`), K `num_embeddings`, E `embedding_dim`.
The table is (K, E), row k the embedding of id k: pytagi's flat `mu_w` (index k·E + e).
"""

from __future__ import annotations

import torch

from dptrain.tagi.base import ParamLayer
from dptrain.tagi.states import DeltaStates, HiddenStates


class Embedding(ParamLayer):
    """Maps each id to its row of a table of independent Gaussians: `m_Z = m_W[id]`,
    `v_Z = v_W[id]`, exactly (a lookup involves no product).

    Input, as pytagi feeds it: `N` ids per sample coded as floats, (B, N) (or pytagi's flat
    (B·N,) when `input_size` is given and the layer comes first). Every id must be a whole
    number in [0, K), or `padding_idx`, else ValueError names the first bad one. Output: the
    N embeddings of a sample side by side, (B, N·E), sample b's id j at columns [j·E, (j+1)·E).

    `padding_idx` (pytagi: −1 for none): ids equal to it give zeros (mean and variance) and
    leave the table unchanged. `scale`: the initial means are N(0, scale²), the variances
    scale² (pytagi's). With `input_size = 0` (pytagi's default) N is taken from each input.

    Parameters: `mu_w, var_w` (K, E), no bias. The deltas of a row sum the innovations of
    every position holding its id, over the batch: Δm = v_W Σ δm, Δv = v_W² Σ δv.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, input_size: int = 0,
                 scale: float = 1.0, padding_idx: int = -1, *,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        for name, value, least in (("num_embeddings", num_embeddings, 1),
                                   ("embedding_dim", embedding_dim, 1),
                                   ("input_size", input_size, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"Embedding: {name} must be an int >= {least}, got {value!r}")
        if not isinstance(padding_idx, int) or not -1 <= padding_idx < num_embeddings:
            raise ValueError(f"Embedding: padding_idx must be -1 (none) or an id in "
                             f"[0, {num_embeddings}), got {padding_idx!r}")
        if not scale > 0:
            raise ValueError(f"Embedding: scale must be > 0, got {scale!r}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.input_size, self.scale, self.padding_idx = input_size, scale, padding_idx
        self.bias = False
        super().__init__()
        self._init_group("w", (num_embeddings, embedding_dim), scale, 1.0, dtype, device)
        self.clear_cache()

    def param_groups(self) -> list[tuple[str, tuple[int, ...]]]:
        return [("w", (self.num_embeddings, self.embedding_dim))]

    def input_sample_shape(self) -> tuple[int, ...] | None:
        """(N,) when `input_size` is set: a network starting here takes pytagi's flat ids."""
        return (self.input_size,) if self.input_size else None

    def clear_cache(self) -> None:
        self._rows: torch.Tensor | None = None  # (B·N,) table row of each position
        self._kept: torch.Tensor | None = None  # (B·N, 1) 1 where the id is not padding
        self._in_shape: tuple[int, ...] = ()

    def _checked_ids(self, states: HiddenStates) -> torch.Tensor:
        """The ids as (B, N), after checking they are whole numbers in range."""
        ids = states.mu_a
        if ids.dim() != 2 or (self.input_size and ids.shape[1] != self.input_size):
            width = self.input_size or "N"
            raise ValueError(f"{self.label}: expected ids of shape (batch, {width}), got "
                             f"{tuple(ids.shape)}")
        if torch.compiler.is_compiling():  # checked before the program (check_values)
            return ids
        self.check_values(states)
        return ids

    def check_values(self, states: HiddenStates) -> None:
        """The ids are exact whole numbers in range (read on the host)."""
        ids = states.mu_a
        if states.var_a is not None and bool((states.var_a != 0).any()):
            raise ValueError(f"{self.label}: ids must be known exactly (variance 0); an "
                             f"Embedding takes the network input, not an uncertain state")
        valid = (ids == ids.round()) & (ids >= 0) & (ids < self.num_embeddings)
        if self.padding_idx >= 0:
            valid |= ids == self.padding_idx
        if not bool(valid.all()):
            where = tuple((~valid).nonzero()[0].tolist())
            raise ValueError(f"{self.label}: id {ids[where].item()!r} at index {where} is not a "
                             f"whole number in [0, {self.num_embeddings})")

    def forward(self, states: HiddenStates) -> HiddenStates:
        ids = self._checked_ids(states)  # (B, N)
        width = ids.shape[1] * self.embedding_dim
        kept = None
        rows = ids.reshape(-1).long()  # (B·N,)
        if self.padding_idx >= 0:
            kept = (rows != self.padding_idx).unsqueeze(1).to(ids.dtype)  # (B·N, 1)
        mu_z = self.mu_w.index_select(0, rows)  # (B·N, E)
        var_z = self.var_w.index_select(0, rows)
        if kept is not None:
            mu_z.mul_(kept)
            var_z.mul_(kept)
        if self.training:
            self._rows, self._kept, self._in_shape = rows, kept, tuple(states.mu_a.shape)
        return HiddenStates(mu_z.view(-1, width), var_z.view(-1, width), None)

    def backward(self, delta: DeltaStates, need_input_delta: bool) -> DeltaStates | None:
        """Writes g_m = Σ δm, g_v = Σ δv per table row (over every position holding its id);
        Δ = v g_m, v² g_v follows in `scale_deltas_` (base.py). The ids are known exactly, so
        their innovations, if asked for, are zero."""
        if self._rows is None:
            raise RuntimeError(f"{self.label}: backward() needs a forward in training mode first")
        dim = self.embedding_dim
        delta_mu = delta.delta_mu.reshape(-1, dim)  # (B·N, E)
        delta_var = delta.delta_var.reshape(-1, dim)
        if self._kept is not None:
            delta_mu, delta_var = delta_mu * self._kept, delta_var * self._kept
        # In place: the delta buffers are views of the network's flat storage.
        self.delta_mu_w.zero_().index_add_(0, self._rows, delta_mu)
        self.delta_var_w.zero_().index_add_(0, self._rows, delta_var)
        if not need_input_delta:
            return None
        zeros = delta_mu.new_zeros(self._in_shape)
        return DeltaStates(zeros, zeros.clone())

    def __repr__(self) -> str:
        padding = f", padding_idx={self.padding_idx}" if self.padding_idx >= 0 else ""
        return f"Embedding({self.num_embeddings}, {self.embedding_dim}{padding})"
