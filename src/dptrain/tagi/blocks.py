"""Blocks of layers (docs/tagi.md, LayerBlock, ResNetBlock, Parallel): LayerBlock, ResNetBlock,
Parallel.

Shape legend: B batch; a block's states are whatever its layers take, (B, N) or (B, C, H, W).
Blocks own no storage: the outermost `Sequential` packs the parameters and state of every
layer inside them, however deep, into its flat buffers, under paths "<i>.<j>" (LayerBlock),
"<i>.main.<j>" / "<i>.short.<j>" (ResNetBlock) and "<i>.<k>.<j>" (Parallel, branch k).
"""

from __future__ import annotations

import torch

from dptrain.tagi.base import Layer
from dptrain.tagi.sequential import Sequential
from dptrain.tagi.states import DeltaStates, HiddenStates


class LayerBlock(Sequential):
    """Layers applied in order inside another network (pytagi's `LayerBlock`): a nested
    `Sequential`, adding one level "<i>.<j>" to the state_dict paths."""

    def __init__(self, *layers: Layer) -> None:
        super().__init__(*layers)

    def __repr__(self) -> str:
        inner = ", ".join(repr(layer) for layer in getattr(self, "layers", []))
        return f"LayerBlock({inner})"


def _as_block(layer: Layer, role: str, owner: str = "ResNetBlock") -> Sequential:
    if isinstance(layer, Sequential):
        return layer
    if not isinstance(layer, Layer):
        raise TypeError(f"{owner}: {role} must be a dptrain.tagi layer or LayerBlock, got "
                        f"{type(layer).__name__}")
    return LayerBlock(layer)  # a single layer: its path is "<i>.main.0" / "<i>.short.0"


def _scaled(delta: DeltaStates, jcb: torch.Tensor | None) -> DeltaStates:
    if jcb is None:
        return delta
    return DeltaStates(delta.delta_mu * jcb, delta.delta_var * jcb * jcb)


class ResNetBlock(Layer):
    """Residual block: `main_block(A) + shortcut(A)`, the shortcut the identity if None
    (pytagi's `ResNetBlock(main_block, shortcut=None)`); no activation after the sum.

    The two branches are treated as independent: output mean and variance are the sums of the
    branches' (docs/tagi.md, ResNetBlock). Backward feeds the block's innovations to both
    branches and adds the innovations they return for the block's input. Works on image states
    and on flat (B, N) states alike (pytagi's block assumes images).

    A branch ending in an activation hands its J to the block; its innovations are multiplied
    by it before entering the branch, so they reach the branch's last pre-activation, as
    everywhere else in the engine (cuTAGI drops that J). The identity shortcut is the same rule
    with the J of the block's input.
    """

    def __init__(self, main_block: Layer, shortcut: Layer | None = None) -> None:
        self.main = _as_block(main_block, "main_block")
        self.short = None if shortcut is None else _as_block(shortcut, "shortcut")
        if self.short is self.main:
            raise ValueError("ResNetBlock: main_block and shortcut must be different objects")
        super().__init__()
        self.clear_cache()

    @property
    def main_block(self) -> Sequential:
        return self.main

    @property
    def shortcut(self) -> Sequential | None:
        return self.short

    def named_children(self) -> list[tuple[str, Layer]]:
        children: list[tuple[str, Layer]] = [("main", self.main)]
        if self.short is not None:
            children.append(("short", self.short))
        return children

    def input_sample_shape(self) -> tuple[int, ...] | None:
        """The main block's, so a network starting with a block takes pytagi's flat inputs."""
        return self.main.input_sample_shape()

    def clear_cache(self) -> None:
        for _, child in self.named_children():
            child.clear_cache()
        self.drop_forward()

    def drop_forward(self) -> None:
        self._jcb_main: torch.Tensor | None = None  # J of the main branch's output
        self._jcb_short: torch.Tensor | None = None  # J of the shortcut's output (or input)
        self._trained = False

    def forward(self, states: HiddenStates) -> HiddenStates:
        main = self.main.forward(states)
        short = states if self.short is None else self.short.forward(states)
        if main.mu_a.shape != short.mu_a.shape:
            which = "shortcut" if self.short is not None else "identity shortcut"
            raise ValueError(f"{self.label}: the main block gives {tuple(main.mu_a.shape)}, "
                             f"the {which} {tuple(short.mu_a.shape)}; they must match to be "
                             f"added")
        mu = main.mu_a + short.mu_a
        if main.var_a is None:
            var = short.var_a
        else:
            var = main.var_a if short.var_a is None else main.var_a + short.var_a
        if self.training:
            self._jcb_main, self._jcb_short, self._trained = main.jcb, short.jcb, True
        return HiddenStates(mu, var, None)

    def backward(self, delta: DeltaStates, need_input_delta: bool) -> DeltaStates | None:
        if not self._trained:
            raise RuntimeError(f"{self.label}: backward() needs a forward in training mode first")
        from_main = self.main.backward(_scaled(delta, self._jcb_main), need_input_delta)
        to_short = _scaled(delta, self._jcb_short)
        from_short = to_short if self.short is None else \
            self.short.backward(to_short, need_input_delta)
        if not need_input_delta:
            return None
        assert from_main is not None and from_short is not None
        return DeltaStates(from_main.delta_mu + from_short.delta_mu,
                           from_main.delta_var + from_short.delta_var)

    def __repr__(self) -> str:
        short = "" if self.short is None else f", {self.short!r}"
        return f"ResNetBlock({self.main!r}{short})"


def _split_columns(tensor: torch.Tensor | None, sizes: list[int]) -> list[torch.Tensor | None]:
    if tensor is None:
        return [None] * len(sizes)
    return [part.contiguous() for part in torch.split(tensor, sizes, dim=1)]


def _joined(parts: list[torch.Tensor | None], means: list[torch.Tensor], fill: float
            ) -> torch.Tensor | None:
    """The (B, ·) parts side by side; None if every part is None (its implicit value `fill`
    everywhere), else a None part materialised as `fill`."""
    if all(part is None for part in parts):
        return None
    return torch.cat([torch.full_like(mu, fill) if part is None else part
                      for part, mu in zip(parts, means)], dim=1)


class Parallel(Layer):
    """Branches side by side: the input's columns are cut into consecutive parts of
    `input_sizes`, branch k runs on part k, and the branches' outputs, each flattened to
    (B, N_k), are concatenated, (B, Σ N_k). One network thus takes part of its input through
    one sub-network and the rest through another, e.g. a window of values through LSTM layers
    and a series id through an `Embedding` (docs/tagi.md, Parallel).

    The branches see disjoint inputs, so the block is exact: its output moments are the
    branches' moments, side by side, and so is its J (a branch ending in an activation hands
    its J on, for the next layer to apply as everywhere in the engine). Backward cuts the
    innovations at the same columns, runs each branch's backward, and puts the innovations
    they return for the input side by side again. Input: flat (B, Σ input_sizes) states.

    Parameters of every branch live in the outermost network's flat buffers, under paths
    "<i>.<k>.<j>" (branch k, its layer j; a single layer is branch "<i>.<k>.0").
    """

    def __init__(self, *branches: Layer, input_sizes: tuple[int, ...] | list[int]) -> None:
        if len(branches) < 2:
            raise ValueError(f"Parallel: needs at least 2 branches, got {len(branches)}")
        sizes = list(input_sizes)
        if len(sizes) != len(branches) or any(
                not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
            raise ValueError(f"Parallel: input_sizes must give a positive int per branch "
                             f"({len(branches)}), got {input_sizes!r}")
        self.branches = [_as_block(branch, f"branch {k}", "Parallel")
                         for k, branch in enumerate(branches)]
        if len({id(branch) for branch in self.branches}) != len(self.branches):
            raise ValueError("Parallel: the branches must be different objects")
        self.input_sizes = sizes
        super().__init__()
        self.clear_cache()

    def named_children(self) -> list[tuple[str, Layer]]:
        return [(str(k), branch) for k, branch in enumerate(self.branches)]

    def clear_cache(self) -> None:
        for branch in self.branches:
            branch.clear_cache()
        self._out_sizes: list[int] | None = None  # output width of each branch
        self._in_shape: tuple[int, ...] = ()

    def forward(self, states: HiddenStates) -> HiddenStates:
        width = sum(self.input_sizes)
        if states.mu_a.dim() != 2 or states.mu_a.shape[1] != width:
            raise ValueError(f"{self.label}: expected input of shape (batch, {width}) "
                             f"(branch widths {self.input_sizes}), got "
                             f"{tuple(states.mu_a.shape)}")
        parts = zip(*(_split_columns(t, self.input_sizes)
                      for t in (states.mu_a, states.var_a, states.jcb)))
        outs = [branch.forward(HiddenStates(mu, var, jcb, states.jcb_is_mask))
                for branch, (mu, var, jcb) in zip(self.branches, parts)]
        means = [out.mu_a.flatten(1) for out in outs]
        var = _joined([None if o.var_a is None else o.var_a.flatten(1) for o in outs], means, 0.0)
        jcb = _joined([None if o.jcb is None else o.jcb.flatten(1) for o in outs], means, 1.0)
        # J = 1 is a mask too (1² = 1), so the joined J is one if every given J is.
        mask = jcb is not None and all(o.jcb is None or o.jcb_is_mask for o in outs)
        if self.training:
            self._out_sizes = [mu.shape[1] for mu in means]
            self._in_shape = tuple(states.mu_a.shape)
        return HiddenStates(torch.cat(means, dim=1), var, jcb, mask)

    def backward(self, delta: DeltaStates, need_input_delta: bool) -> DeltaStates | None:
        if self._out_sizes is None:
            raise RuntimeError(f"{self.label}: backward() needs a forward in training mode first")
        parts = zip(_split_columns(delta.delta_mu, self._out_sizes),
                    _split_columns(delta.delta_var, self._out_sizes))
        returned = [branch.backward(DeltaStates(mu, var), need_input_delta)
                    for branch, (mu, var) in zip(self.branches, parts)]
        if not need_input_delta:
            return None
        assert all(r is not None for r in returned)
        return DeltaStates(torch.cat([r.delta_mu.flatten(1) for r in returned], dim=1),
                           torch.cat([r.delta_var.flatten(1) for r in returned], dim=1))

    def __repr__(self) -> str:
        inner = ", ".join(repr(branch) for branch in getattr(self, "branches", []))
        return f"Parallel({inner}, input_sizes={getattr(self, 'input_sizes', None)})"
