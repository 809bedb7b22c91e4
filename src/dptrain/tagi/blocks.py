"""Blocks of layers (docs/tagi.md, LayerBlock and ResNetBlock): LayerBlock, ResNetBlock.

Shape legend: B batch; a block's states are whatever its layers take, (B, N) or (B, C, H, W).
Blocks own no storage: the outermost `Sequential` packs the parameters and state of every
layer inside them, however deep, into its flat buffers, under paths "<i>.<j>" (LayerBlock)
and "<i>.main.<j>" / "<i>.short.<j>" (ResNetBlock).
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


def _as_block(layer: Layer, role: str) -> Sequential:
    if isinstance(layer, Sequential):
        return layer
    if not isinstance(layer, Layer):
        raise TypeError(f"ResNetBlock: {role} must be a dptrain.tagi layer or LayerBlock, got "
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
