"""A network's whole training step as one compiled program (docs/tagi.md, Compiled step).

At pytagi's small batches (an LSTM at batch 5, an FNN at 32) an eager step is ~200 tensor
operations on tensors of a few hundred values: per-op overhead, not arithmetic. `CompiledStep`
traces forward moments, the output update, the backward deltas and the capped step once with
`torch.compile(fullgraph=True, dynamic=False)` and then calls the fused program once per step.

What stays outside the program, so that it is never recompiled for them: the input checks (the
same as eager), σ_v² and the cap factor (passed in as 0-dim tensors, so a new epoch's σ_v or
a data-parallel global batch is an input, not a constant), and a batch of another shape (a
short last batch: stepped eagerly, the same math). A network the tracer cannot capture
(BatchNorm's host-side counters, for one) is stepped eagerly from then on, after one log line
saying why. The first step is eager too: it fixes the output shape the update checks against.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dptrain.tagi._inputs import as_input
from dptrain.tagi.base import VAR_FLOOR, _signed_inverse, cap_factor
from dptrain.tagi.output_updater import (OutputUpdater, _agvi_innovations, _indices,
                                         _innovations, _noise, _shaped_like)
from dptrain.tagi.states import DeltaStates, HiddenStates

log = logging.getLogger(__name__)

#: inductor's options for a compiled step on the CPU: the program's glue generated as C++
#: instead of Python (faster on 4 of the 5 cases of bench/tagi_compiled_step.py).
DEFAULT_OPTIONS = {"cpp_wrapper": True}

#: The output updates a compiled step can run: OutputUpdater.update, .update_using_indices,
#: .update_heteros.
UPDATES = ("plain", "indices", "heteros")


class CompiledStep:
    """`step(x, y, var_y)` = pytagi's forward, update, backward, step, as one compiled call.

    `net`: the Sequential (`Sequential.compile()` builds this). `update`: one of `UPDATES`.
    `reduce`: for a data-parallel wrapper, called between the deltas and the capped step (the
    all-reduce stays outside the program: gloo and NCCL calls are not traceable); it returns
    the batch size the cap uses. `eager`: the object whose pytagi loop is the fallback (the
    wrapper itself, for data parallel). `backend`: torch.compile's (tests use "aot_eager",
    which traces the same graph without generating code). `mode`: torch.compile's, e.g.
    "reduce-overhead" to replay the program as a CUDA graph on a GPU. `options`: inductor's
    (default `DEFAULT_OPTIONS` with inductor and no `mode`).

    Returns (mu, var) of the output before the update, like the forward of the eager loop.
    """

    def __init__(self, net: Any, update: str = "plain", *, backend: str = "inductor",
                 mode: str | None = None, options: dict[str, Any] | None = None,
                 reduce: Callable[[], int] | None = None, eager: Any = None) -> None:
        if update not in UPDATES:
            raise ValueError(f"compile: update must be one of {', '.join(UPDATES)}, "
                             f"got {update!r}")
        self.net, self.update, self.backend, self.mode = net, update, backend, mode
        if options is None and backend == "inductor" and mode is None:
            options = dict(DEFAULT_OPTIONS)
        self.options = options
        self._reduce, self._eager = reduce, eager if eager is not None else net
        self.updater = OutputUpdater(net.device)
        self._program: Callable | None = None
        self._shapes: tuple | None = None  # the input shapes the program was traced for
        self._out_shape: torch.Size | None = None
        #: why the network is stepped eagerly (None while it compiles)
        self.fallback_reason: str | None = None
        self.compiled_steps = self.eager_steps = 0
        self._scalars: dict[tuple, torch.Tensor] = {}  # (value, dtype, device): tensor
        self._caps: dict[tuple, torch.Tensor] = {}
        self._cached = [layer for layer in net.descendants() if hasattr(layer, "_weight_cache")]
        stateful = [path for path, _ in net.named_stateful()]
        if stateful:  # traced, the running counters' in-place updates came out wrong
            self._give_up(f"running statistics of layer {', '.join(stateful)} are kept eager")

    # ------------------------------------------------------------------ one step
    def __call__(self, x: Any, y: Any, var_y: Any = 0.0,
                 selected_idx: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        net = self.net
        if not net.training:
            raise RuntimeError("a compiled step trains: call net.train() first")
        if (self.update == "indices") != (selected_idx is not None):
            raise ValueError(f"compiled step with update={self.update!r}: selected_idx is "
                             f"{'required' if self.update == 'indices' else 'not used'}")
        mu_x, _ = as_input(x, None, net.dtype, net.device, net.check_inputs,
                           net.input_sample_shape(),
                           allow_empty=net.allow_empty_batch or self._reduce is not None)
        if self._out_shape is None or self.fallback_reason is not None or \
                mu_x.shape[0] != self._out_shape[0]:
            return self._eager_step(mu_x, y, var_y, selected_idx)
        y, noise, idx = self._checked_targets(y, var_y, selected_idx)
        shapes = (mu_x.shape, y.shape, None if idx is None else idx.shape, noise.shape)
        if self._shapes is not None and shapes != self._shapes:
            return self._eager_step(mu_x, y, var_y, selected_idx)
        try:
            mu, var = self._compiled(shapes)(mu_x, y, noise, idx, self._cap(mu_x.shape[0]))
        except Exception as err:  # noqa: BLE001 - anything the tracer or compiler refuses
            if self.compiled_steps:  # it ran before: a real error of this step, not capture
                raise
            self._give_up(err)
            return self._eager_step(mu_x, y, var_y, selected_idx)
        self.compiled_steps += 1
        self._record(mu_x.shape[0], mu, var)
        if self._reduce is not None:
            saved, net.cap_batch_size = net.cap_batch_size, self._reduce()
            try:
                net.step()
            finally:
                net.cap_batch_size = saved
        return mu, var

    step = __call__

    def _cap(self, batch: int) -> torch.Tensor | None:
        """(−1/c, 1/c) of the cap, a cached tensor: an input of the program, not a constant
        (this object's own, like `_input_scalar`'s)."""
        if self._reduce is not None:
            return None
        size = self.net.cap_batch_size if self.net.cap_batch_size is not None else batch
        key = (cap_factor(size), self.net.dtype, self.net.device)  # `to()` may move the net
        if key not in self._caps:
            self._caps[key] = _signed_inverse(key[0], self.net.flat_params).clone()
        return self._caps[key]

    def _input_scalar(self, value: float) -> torch.Tensor:
        """`value` as a 0-dim input of the program, one tensor per value. Never one of the
        engine's shared `constant()`s: the tracer would take the program's input for the
        constant it also reads inside (σ_v² = 1 traced as the layers' 1.0, then a new σ_v
        would change their 1.0)."""
        key = (value, self.net.dtype, self.net.device)
        if key not in self._scalars:
            self._scalars[key] = torch.tensor(value, dtype=self.net.dtype,
                                              device=self.net.device)
        return self._scalars[key]

    def _checked_targets(self, y: Any, var_y: Any, selected_idx: Any
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The eager update's checks, made before the program runs (they read values)."""
        like = torch.empty(0, dtype=self.net.dtype, device=self.net.device)
        out = self._out_shape
        assert out is not None
        if self.update == "heteros":
            return (_shaped_like(y, torch.Size((out[0], out[1] // 2)), like, "mu_obs"),
                    self._input_scalar(0.0), None)
        idx = None
        shape = out
        if self.update == "indices":
            idx = _indices(selected_idx, torch.empty(out, dtype=like.dtype, device=like.device))
            shape = idx.shape
        noise = _noise(var_y, shape, like)
        if not isinstance(noise, torch.Tensor):
            noise = self._input_scalar(noise)
        return _shaped_like(y, shape, like, "mu_obs"), noise, idx

    def _compiled(self, shapes: tuple) -> Callable:
        if self._program is None:
            self.net._check_bindings()  # what eager checks after its first backward
            # torch.compile keeps its graphs per code object, at most 8 each: a copy of the
            # code per CompiledStep keeps networks (trials, tests) from evicting each other
            traced = CompiledStep._traced
            own = types.FunctionType(traced.__code__.replace(), traced.__globals__,
                                     traced.__name__)
            self._program = torch.compile(types.MethodType(own, self), fullgraph=True,
                                          dynamic=False, backend=self.backend,
                                          mode=self.mode, options=self.options)
            self._shapes = shapes
        return self._program

    def _traced(self, mu_x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor,
                idx: torch.Tensor | None, signed_inverse: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The program: forward, update, backward, g → Δ and (single process) the capped step,
        with exactly the eager layers' code."""
        net = self.net
        with torch.no_grad():
            states = net._forward_states(HiddenStates(mu_x, None, None))
            mu, var = states.mu_a, states.var_or_zeros()
            delta = _update(self.update, mu, var, states.jcb, y, noise, idx)
            net._backward_layers(delta, net.input_state_update)
            net._owned_pack().scale_deltas()
            if signed_inverse is not None:
                _capped_update_(net.flat_params, net.flat_deltas, signed_inverse)
        return mu, var

    # ------------------------------------------------------------------ eager and bookkeeping
    def _eager_step(self, mu_x: torch.Tensor, y: Any, var_y: Any, selected_idx: Any
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        loop, net = self._eager, self.net
        mu, var = loop(mu_x)
        if self.update == "heteros":
            self.updater.update_heteros(net.output_z_buffer, y, net.input_delta_z_buffer)
        elif self.update == "indices":
            self.updater.update_using_indices(net.output_z_buffer, y, var_y, selected_idx,
                                              net.input_delta_z_buffer)
        else:
            self.updater.update(net.output_z_buffer, y, var_y, net.input_delta_z_buffer)
        loop.backward()
        loop.step()
        if self._out_shape is None and mu.shape[0] > 0:
            self._out_shape = mu.shape
        self.eager_steps += 1
        return mu, var

    def _record(self, batch: int, mu: torch.Tensor, var: torch.Tensor) -> None:
        """What the eager loop leaves on the network after a step."""
        net = self.net
        net.last_batch_size = batch
        net._last_forward_trained = True
        net.output_z_buffer = HiddenStates(mu, var, None)
        # generated code may write the parameters without bumping torch's version counter,
        # which the eager weight caches are keyed on: drop them
        for layer in self._cached:
            layer._weight_cache = None

    def _give_up(self, why: Exception | str) -> None:
        if isinstance(why, str):
            self.fallback_reason = why
        else:
            first = next((line.strip() for line in str(why).splitlines() if line.strip()),
                         type(why).__name__)
            self.fallback_reason = f"{type(why).__name__}: {first}"
        log.warning("compile: %s cannot be captured as one program (%s); stepping eagerly",
                    type(self.net).__name__, self.fallback_reason)


def _update(kind: str, mu: torch.Tensor, var: torch.Tensor, jcb: torch.Tensor | None,
            y: torch.Tensor, noise: torch.Tensor, idx: torch.Tensor | None) -> DeltaStates:
    """OutputUpdater's three updates without their checks (made before the program)."""
    if kind == "plain":
        return DeltaStates(*_innovations(mu, var, jcb, y, noise))
    if kind == "indices":
        assert idx is not None
        j = None if jcb is None else jcb.gather(1, idx)
        delta_mu, delta_var = _innovations(mu.gather(1, idx), var.gather(1, idx), j, y, noise)
        return DeltaStates(torch.zeros_like(mu).scatter_add_(1, idx, delta_mu),
                           torch.zeros_like(mu).scatter_add_(1, idx, delta_var))
    batch, width = mu.shape
    pairs = (batch, width // 2, 2)
    mu_y, mu_t = mu.reshape(pairs).unbind(2)
    var_y, var_t = var.reshape(pairs).unbind(2)
    jcb_y, jcb_t = (None, None) if jcb is None else jcb.reshape(pairs).unbind(2)
    deltas = _agvi_innovations(mu_y, var_y, jcb_y, mu_t, var_t, jcb_t, y)
    return DeltaStates(deltas[:2].permute(1, 2, 0).reshape(batch, width),
                       deltas[2:].permute(1, 2, 0).reshape(batch, width))


def _capped_update_(params: torch.Tensor, deltas: torch.Tensor,
                    signed_inverse: torch.Tensor) -> None:
    """StepRows.capped_update_ (base.py) with the cap as a tensor input: the same operations
    in the same order, so the same values."""
    bounds = torch.sqrt(params[1]) * signed_inverse  # (2, P): −bar, +bar
    params.add_(torch.clamp(deltas, min=bounds[0], max=bounds[1]))
    F.threshold_(params[1], 0.0, VAR_FLOOR)
