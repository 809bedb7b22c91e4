"""A network's whole training step as one compiled program (docs/tagi.md, Compiled step).

At pytagi's small batches (an LSTM at batch 5, an FNN at 32) an eager step is ~200 tensor
operations on tensors of a few hundred values: per-op overhead, not arithmetic. `CompiledStep`
traces forward moments, the output update, the backward deltas and the capped step once with
`torch.compile(fullgraph=True, dynamic=False)` and then calls the fused program once per step.

What stays outside the program, so that it is never recompiled for them: the input checks (the
same as eager), σ_v² and the cap factor (passed in as 0-dim tensors, so a new epoch's σ_v or
a data-parallel global batch is an input, not a constant), and a batch of another shape (a
short last batch: stepped eagerly, the same math). A network the tracer cannot capture (a
BatchNorm that synchronises its statistics across ranks, for one) is stepped eagerly from then
on, after one log line saying why. The program's first step is eager too: it fixes the output
shape the update checks against.

A stack of LSTM, Linear and ReLU layers (and an EvenExp head) with the plain, indexed or
heteroscedastic update on the CPU is stepped by the native library instead (native.py): the
same math as loops over buffers allocated once (its larger products in torch's BLAS library),
without the generated program's allocations and Python wrappers, which were most of its time
at pytagi's batches.
"""

from __future__ import annotations

import functools
import importlib
import logging
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dptrain.tagi import native as native_module
from dptrain.tagi._inputs import as_input
from dptrain.tagi.base import VAR_FLOOR, Layer, _signed_inverse, cap_factor
from dptrain.tagi.output_updater import (OutputUpdater, _agvi_innovations, _indices,
                                         _innovations, _noise, _shaped_like)
from dptrain.tagi.states import DeltaStates, HiddenStates

log = logging.getLogger(__name__)

#: inductor's options for a compiled step on the CPU: the program's glue generated as C++
#: instead of Python (faster on 4 of the 5 cases of bench/tagi/tagi_compiled_step.py).
DEFAULT_OPTIONS = {"cpp_wrapper": True}

#: A matrix product of at most this many multiply-adds is generated as loops inside the
#: program (fused with its neighbours) instead of a call to the BLAS library: at pytagi's
#: small batches the call's overhead is most of such a product's time.
FUSED_MATMUL_MACS = 32768

#: A program whose step is at most this much work (parameters × batch size, ~ the
#: multiply-adds of one product) runs on one thread, whatever torch's thread count: its
#: kernels take microseconds, and on 2 shared cores a second thread's fork and join per
#: parallel loop cost more than it takes off (bench/tagi/tagi_compiled_step.py, --threads 2).
SINGLE_THREAD_WORK = 1_000_000

#: With `native=None`, a network the native step does (LSTM, Linear and ReLU stacks, an EvenExp
#: head, CPU) takes it on one thread whatever its size, and on more when the parameters × batch
#: size of the layers it steps as its own loops (`native.loop_work`: not a Linear whose
#: products go to the BLAS library) × torch's thread count is at most this: the loops run on
#: one thread, inductor's larger products are multithreaded BLAS calls. Measured
#: (bench/tagi/tagi_compiled_step.py --native, LSTM stacks): on one thread the native step was 5.2x
#: inductor's program on the LSTM example at batch 5 and 1.4x on a two-layer LSTM of 64 at
#: batch 128 (6.6·10⁶); on 2 threads 3.8x at 0.2·10⁶ (the example at batch 256), 0.91x at
#: 1.7·10⁶ and 0.77x at 6.6·10⁶.
NATIVE_WORK = 3_000_000

#: The output updates a compiled step can run: OutputUpdater.update, .update_using_indices,
#: .update_heteros.
UPDATES = ("plain", "indices", "heteros")


#: torch's internals the compiled step calls, (module, name): the package declares torch>=2.6,
#: and a release may move a private one. The first two are checked at import (cheap; the
#: native step needs them too), the others, whose modules take seconds to import, when the
#: first program is traced (which imports them anyway).
INTERNALS = (("torch", "compile"), ("torch.autograd.graph", "increment_version"))
TRACING_INTERNALS = (("torch._dynamo", "lookup_backend"),
                     ("torch._inductor.compile_fx", "compile_fx"),
                     ("torch._inductor.decomposition", "select_decomp_table"),
                     ("torch._functorch.config", "enable_autograd_cache"))


def missing_internals(internals: tuple[tuple[str, str], ...] = INTERNALS) -> str | None:
    """Which of `internals` this torch lacks, as one phrase (None: it has them all)."""
    missing = []
    for module, name in internals:
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            missing.append(f"{module}.{name}")
    if not missing:
        return None
    return f"torch {torch.__version__} lacks {', '.join(missing)}"


#: why this torch cannot run the compiled step at all (None: it can)
MISSING = missing_internals()


class CompiledStep:
    """`step(x, y, var_y)` = pytagi's forward, update, backward, step, as one compiled call.

    `net`: the Sequential (`Sequential.compile()` builds this). `update`: one of `UPDATES`.
    `reduce`: for a data-parallel wrapper, called between the deltas and the capped step (the
    all-reduce stays outside the program: gloo and NCCL calls are not traceable); it returns
    the batch size the cap uses. `eager`: the object whose pytagi loop is the fallback (the
    wrapper itself, for data parallel). `backend`: torch.compile's (tests use "aot_eager",
    which traces the same graph without generating code). `mode`: torch.compile's, e.g.
    "reduce-overhead" to replay the program as a CUDA graph on a GPU. `options`: inductor's
    (default `DEFAULT_OPTIONS` with inductor and no `mode`). `fused_matmul_macs`: with
    inductor, no `mode` and on the CPU, matrix products up to this many multiply-adds are
    generated as loops fused into the program (0: every product calls the BLAS library).
    `single_thread_work`: on the CPU, a program whose parameters × batch size is at most this
    is generated for, and run on, one thread (None: torch's thread count, always).
    `native`: step a stack of LSTM, Linear and ReLU layers with the native library (native.py)
    instead of a traced program: None where it applies and `NATIVE_WORK` says it wins (with
    inductor, no `mode`, on the CPU), True wherever it applies (a network it does not do
    then steps eagerly, after one log line), False never. `predict(x)`: the evaluation
    forward, through the same library where the step is native.

    Returns (mu, var) of the output before the update, like the forward of the eager loop.
    """

    def __init__(self, net: Any, update: str = "plain", *, backend: str = "inductor",
                 mode: str | None = None, options: dict[str, Any] | None = None,
                 reduce: Callable[[], int] | None = None, eager: Any = None,
                 fused_matmul_macs: int = FUSED_MATMUL_MACS,
                 single_thread_work: int | None = SINGLE_THREAD_WORK,
                 native: bool | None = None) -> None:
        if update not in UPDATES:
            raise ValueError(f"compile: update must be one of {', '.join(UPDATES)}, "
                             f"got {update!r}")
        self.net, self.update, self.backend, self.mode = net, update, backend, mode
        if options is None and backend == "inductor" and mode is None:
            options = dict(DEFAULT_OPTIONS)
        self.options, self.fused_matmul_macs = options, fused_matmul_macs
        self.single_thread_work = single_thread_work
        self._single_thread = False
        self._reduce, self._eager = reduce, eager if eager is not None else net
        self.updater = OutputUpdater(net.device)
        self._program: Callable | None = None
        self._capture: _Capture | None = None  # the backend's program, as dynamo calls it
        self._direct: _DirectCall | None = None  # that program, called without dynamo
        self._shapes: tuple | None = None  # the input shapes the program was traced for
        self._out_shape: torch.Size | None = None
        #: why the network is stepped eagerly (None while it compiles)
        self.fallback_reason: str | None = None
        self.compiled_steps = self.eager_steps = 0
        self._scalars: dict[tuple, torch.Tensor] = {}  # (value, dtype, device): tensor
        self._caps: dict[tuple, torch.Tensor] = {}
        self._likes: dict[tuple, torch.Tensor] = {}
        self.native = native
        self._natives: dict[int, native_module.NativeStep] = {}  # per batch size
        self._loop_works: dict[tuple, int] = {}
        self._predictors: dict[int, native_module.NativeStep | None] = {}  # per batch size
        self._native_off = native is False or (native is None and (
            update not in native_module.UPDATES or backend != "inductor" or mode is not None))
        if MISSING is not None:  # one line, and every step eager
            self._native_off = True
            self._give_up(MISSING)
        self._layers = list(net.descendants())
        self._cached = [layer for layer in self._layers if hasattr(layer, "_weight_cache")]
        synced = [path for path, layer in net.named_stateful()
                  if getattr(layer, "stats_gather", None) is not None]
        if synced:  # a collective inside the forward: not traceable
            self._give_up(f"layer {', '.join(synced)} synchronises its batch statistics")
        # the program checks only the first layer's values, with the network input
        checking = [layer.label for layer in self._layers[1:]
                    if type(layer).check_values is not Layer.check_values]
        if checking:
            self._give_up(f"{', '.join(checking)} checks values of an input that is not the "
                          f"network's")

    # ------------------------------------------------------------------ one step
    def __call__(self, x: Any, y: Any, var_y: Any = 0.0,
                 selected_idx: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        net = self.net
        if not net.training:
            raise RuntimeError("a compiled step trains: call net.train() first")
        if (self.update == "indices") != (selected_idx is not None):
            raise ValueError(f"compiled step with update={self.update!r}: selected_idx is "
                             f"{'required' if self.update == 'indices' else 'not used'}")
        # once a native step exists, the check that x is finite is left to its call (the
        # same check, cheaper); an eager step makes it in its forward, the traced program's
        # path below (`_check_deferred`)
        deferred = net.check_inputs and bool(self._natives) and self.fallback_reason is None
        mu_x, _ = as_input(x, None, net.dtype, net.device, net.check_inputs and not deferred,
                           net.input_sample_shape(),
                           allow_empty=net.allow_empty_batch or self._reduce is not None)
        # the native step takes every batch size (a short last batch too), from the first
        # step: which steps are native never depends on what ran before, so a resumed run
        # steps as the uninterrupted one did
        native = self._native_step(mu_x.shape[0]) if mu_x.shape[0] and \
            self.fallback_reason is None else None
        if native is not None:
            y, noise, idx = self._checked_targets(y, var_y, selected_idx, native.out_shape)
            return self._native_call(native, mu_x, y, noise, var_y, deferred, idx)
        if self._out_shape is None or self.fallback_reason is not None or \
                mu_x.shape[0] != self._out_shape[0]:
            return self._eager_step(mu_x, y, var_y, selected_idx)
        y, noise, idx = self._checked_targets(y, var_y, selected_idx)
        self._check_deferred(mu_x, deferred)
        if self.fallback_reason is not None:  # native=True, and the network is not native
            return self._eager_step(mu_x, y, var_y, selected_idx)
        shapes = (mu_x.shape, y.shape, None if idx is None else idx.shape, noise.shape)
        if self._shapes is not None and shapes != self._shapes:
            return self._eager_step(mu_x, y, var_y, selected_idx)
        self._layers[0].check_values(HiddenStates(mu_x, None, None))  # e.g. Embedding ids
        inputs = (mu_x, y, noise, idx, self._cap(mu_x.shape[0]))
        try:
            mu, var = self._run(shapes, inputs)
        except Exception as err:  # noqa: BLE001 - anything the tracer or compiler refuses
            if self.compiled_steps:  # it ran before: a real error of this step, not capture
                raise
            self._give_up(str(err) if isinstance(err, _MissingInternals) else err)
            return self._eager_step(mu_x, y, var_y, selected_idx)
        return self._stepped(mu_x.shape[0], mu, var)

    step = __call__

    def predict(self, x: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The evaluation forward of `x`, (mu, var) of the output: what `net.eval(); net(x)`
        returns, the network left in its mode and nothing stepped. Through the native library
        where the network's training step is native (its products on torch's threads), else
        the eager forward."""
        net = self.net
        mu_x, _ = as_input(x, None, net.dtype, net.device, False, net.input_sample_shape(),
                           allow_empty=True)
        predictor = self._predictor(mu_x.shape[0]) if mu_x.shape[0] else None
        out = None if predictor is None else predictor.forward(mu_x, net.check_inputs)
        if out is not None:
            return out
        training = net.training
        net.eval()
        try:
            return net(mu_x)
        finally:
            net.train(training)

    def _stepped(self, batch: int, mu: torch.Tensor, var: torch.Tensor,
                 native: native_module.NativeStep | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """After the program or the native call: what the eager loop leaves on the network,
        and, data parallel, the all-reduce of the deltas and the capped step (the native
        library's, after a native call)."""
        net = self.net
        self.compiled_steps += 1
        self._record(batch, mu, var)
        if self._reduce is not None and native is not None:
            native.step(cap_factor(self._reduce()))
        elif self._reduce is not None:
            saved, net.cap_batch_size = net.cap_batch_size, self._reduce()
            try:
                net.step()
            finally:
                net.cap_batch_size = saved
        return mu, var

    def _native_step(self, batch: int) -> native_module.NativeStep | None:
        """The native step for this batch size, made at its first use; None where the traced
        program (or, with `native=True`, the eager loop) steps instead."""
        if self._native_off:
            return None
        found = self._natives.get(batch)
        if found is not None and found.current():
            return found
        try:
            if not self._native_pays(batch):
                return None
            found = self._natives[batch] = native_module.NativeStep(
                self.net, batch, native_module.output_shape(self.net, batch), self.update)
        except native_module.NotNative as why:
            if self.native:
                self._give_up(str(why))
            else:
                log.info("compile: %s; using inductor's program", why)
            self._native_off = True
            return None
        return found

    def _predictor(self, batch: int) -> native_module.NativeStep | None:
        """The native library's plan for evaluation forwards of this batch size, where it
        would step the network (None: the eager forward)."""
        if self._native_off:
            return None
        if batch in self._predictors:
            found = self._predictors[batch]
            if found is None or found.current():
                return found
        try:
            if not self._native_pays(batch):
                return None
            found = native_module.NativeStep(
                self.net, batch, native_module.output_shape(self.net, batch), self.update)
        except native_module.NotNative:
            found = None
        self._predictors[batch] = found
        return found

    def _native_pays(self, batch: int) -> bool:
        """Whether the native library takes this batch size on torch's present thread count:
        always with `native=True`, else where `NATIVE_WORK` says it wins. NotNative for a
        network it does not do."""
        threads = torch.get_num_threads()
        return bool(self.native) or threads == 1 or \
            self._loop_work(batch) * threads <= NATIVE_WORK

    def _loop_work(self, batch: int) -> int:
        key = (batch, self.net.dtype)  # `to()` may change what goes to the BLAS library
        if key not in self._loop_works:
            self._loop_works[key] = native_module.loop_work(self.net, batch)
        return self._loop_works[key]

    def _check_deferred(self, mu_x: torch.Tensor, deferred: bool) -> None:
        """The eager input check (x finite), where `__call__` left it to a native call and
        the traced program steps instead."""
        if deferred:
            as_input(mu_x, None, self.net.dtype, self.net.device, True, allow_empty=True)

    def _native_call(self, native: native_module.NativeStep, mu_x: torch.Tensor,
                     y: torch.Tensor, noise: torch.Tensor, var_y: Any, check_x: bool,
                     idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        net, batch = self.net, mu_x.shape[0]
        factor = None
        if self._reduce is None:
            factor = cap_factor(net.cap_batch_size if net.cap_batch_size is not None else batch)
        out = native(mu_x, y, noise, factor, check_x, idx)
        if out is None:  # LSTM states set by the user: the eager loop's
            return self._eager_step(mu_x, y, var_y, idx)
        return self._stepped(batch, *out, native)

    def _small(self, batch: int) -> bool:
        """Whether the program (compiled at this batch) runs on one thread: fixed when it is
        compiled, as inductor generates its loops for the thread count of that moment."""
        self._single_thread = (self.single_thread_work is not None and
                               self.net.device.type == "cpu" and
                               self.net.flat_params.shape[-1] * batch <= self.single_thread_work)
        return self._single_thread

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

    def _like(self) -> torch.Tensor:
        """An empty tensor of the network's dtype and device (`to()` may change them)."""
        key = (self.net.dtype, self.net.device)
        like = self._likes.get(key)
        if like is None:
            like = self._likes[key] = torch.empty(0, dtype=key[0], device=key[1])
        return like

    def _checked_targets(self, y: Any, var_y: Any, selected_idx: Any,
                         native_out: tuple[int, ...] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The eager update's checks, made before the program runs (they read values), against
        the program's output shape. `native_out`: a native call's output shape instead; the
        indices' range is then left to the call, which checks it (they come back 1-based, as
        given)."""
        like = self._like()
        out = native_out if native_out is not None else self._out_shape
        check_idx = native_out is None
        assert out is not None
        if self.update == "heteros":
            return (_shaped_like(y, torch.Size((out[0], out[1] // 2)), like, "mu_obs"),
                    self._input_scalar(0.0), None)
        idx = None
        shape = out
        if self.update == "indices":
            idx = _indices(selected_idx, torch.empty(out, dtype=like.dtype, device=like.device),
                           check_idx)
            shape = idx.shape
        noise = _noise(var_y, shape, like)
        if not isinstance(noise, torch.Tensor):
            noise = self._input_scalar(noise)
        return _shaped_like(y, shape, like, "mu_obs"), noise, idx

    def _run(self, shapes: tuple, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The program (the direct call where armed), on one thread if the step is small."""
        small = self._single_thread if self._program is not None else \
            self._small(shapes[0][0])
        threads = torch.get_num_threads()
        single = small and threads > 1
        if single:  # the program is generated, and runs, for one thread
            torch.set_num_threads(1)
        try:
            direct = self._direct
            if direct is not None and direct.ready(inputs):
                return direct(inputs)
            return self._traced_call(shapes, inputs)
        finally:
            if single:
                torch.set_num_threads(threads)

    def _traced_call(self, shapes: tuple, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The step through torch.compile (its guards, its side effects); where the step
        leaves the network's Python state as it found it, the graph's program is then called
        directly for as long as that state stays the same (`_DirectCall`)."""
        program = self._compiled(shapes)
        capture = self._capture
        if capture is None:
            return program(*inputs)
        objects = _state_objects(self.net)
        before = _fingerprint(objects)
        capture.args = None
        mu, var = program(*inputs)
        self._direct = None
        if capture.args is not None and capture.outputs == 2 and \
                _fingerprint(objects) == before:
            self._direct = _DirectCall.arm(capture, inputs, objects, before)
        return mu, var

    def _compiled(self, shapes: tuple) -> Callable:
        if self._program is None:
            needed = TRACING_INTERNALS if self.backend == "inductor" else \
                TRACING_INTERNALS[:1] if isinstance(self.backend, str) else ()
            missing = missing_internals(needed)
            if missing is not None:
                raise _MissingInternals(missing)
            self.net._check_bindings()  # what eager checks after its first backward
            # torch.compile keeps its graphs per code object, at most 8 each: a copy of the
            # code per CompiledStep keeps networks (trials, tests) from evicting each other
            traced = CompiledStep._traced
            own = types.FunctionType(traced.__code__.replace(), traced.__globals__,
                                     traced.__name__)
            backend, options = self.backend, self.options
            if self.mode is None:  # (a mode's own wrapper, e.g. CUDA graphs, stays whole)
                if backend == "inductor" and self.fused_matmul_macs and \
                        self.net.device.type == "cpu":  # (measured on the CPU only)
                    backend = _inductor_with_fused_matmuls(options, self.fused_matmul_macs)
                elif isinstance(backend, str):
                    backend = torch._dynamo.lookup_backend(backend)
                    if options:
                        backend = functools.partial(backend, config_patches=options)
                self._capture = backend = _Capture(backend)
                options = None
            self._program = torch.compile(types.MethodType(own, self), fullgraph=True,
                                          dynamic=False, backend=backend,
                                          mode=self.mode, options=options)
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
            for layer in self._layers:  # what the forward stored stays inside the program
                layer.drop_forward()
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


class _MissingInternals(Exception):
    """This torch lacks an internal the traced program needs (`TRACING_INTERNALS`)."""


class _Capture:
    """A torch.compile backend wrapping another: keeps the program it compiled and the
    arguments dynamo passed it on the call made while `args` is None (dynamo may hold
    several of its programs, one per guarded variant of the step)."""

    def __init__(self, compile_graph: Callable) -> None:
        self.compile_graph = compile_graph
        self.program: Callable | None = None
        self.outputs = -1  # how many tensors that program returns
        self.args: list | None = None

    def __call__(self, graph: torch.fx.GraphModule, inputs: list) -> Callable:
        outputs = len(graph.graph.output_node().args[0])
        program = self.compile_graph(graph, inputs)

        def recorded(*args: Any) -> Any:
            if self.args is None:
                self.args, self.program, self.outputs = list(args), program, outputs
            return program(*args)
        return recorded


class _DirectCall:
    """The compiled graph's program called with the arguments dynamo passed it, the step's own
    tensors swapped in: no guards, no side effects replayed (~0.2 ms a step at pytagi's
    batches). Armed only after a call through dynamo that returned nothing but (mu, var) and
    left the Python state of the network, its parameter pack and every layer as it found it
    (`_fingerprint`): the step's effects are then the program's in-place writes alone. Used
    while that state and the step's input shapes and strides stay the same."""

    def __init__(self, program: Callable, args: list, slots: list[tuple[int, int]],
                 layout: list, objects: list, fingerprint: list) -> None:
        self.program, self.args, self.slots, self.layout = program, args, slots, layout
        self.objects, self.fingerprint = objects, fingerprint

    @classmethod
    def arm(cls, capture: _Capture, inputs: tuple, objects: list, fingerprint: list
            ) -> _DirectCall | None:
        args = capture.args
        assert args is not None and capture.program is not None
        slots = []  # (which input, which argument)
        for i, tensor in enumerate(inputs):
            found = [k for k, arg in enumerate(args) if tensor is not None and arg is tensor]
            if len(found) > 1:  # not an argument of its own: leave it to dynamo
                return None
            slots.extend((i, k) for k in found)  # none: the graph does not read it
        armed = cls(capture.program, list(args), slots, _layout(inputs), objects, fingerprint)
        # the values the fingerprint names, kept alive so that no new object takes one's id
        armed.pinned = [_values(obj) for obj in objects]
        return armed

    def ready(self, inputs: tuple) -> bool:
        return _layout(inputs) == self.layout and \
            _fingerprint(self.objects) == self.fingerprint

    def __call__(self, inputs: tuple) -> Any:
        args = self.args
        for i, k in self.slots:
            args[k] = inputs[i]
        return self.program(*args)


def _layout(inputs: tuple) -> list:
    return [None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in inputs]


def _state_objects(net: Any) -> list:
    """The objects whose attributes a traced step reads: the network, its parameter pack
    (and the pack's own dptrain objects), every layer."""
    objects = [net, *net.descendants()]
    pack = getattr(net, "_pack", None)
    if pack is not None:
        objects.append(pack)
        objects.extend(value for value in vars(pack).values()
                       if type(value).__module__.startswith("dptrain"))
    return objects


#: the network's attributes a compiled step sets outside its program, every step
#: (`CompiledStep._record`)
_WRITTEN_OUTSIDE = frozenset({"output_z_buffer", "last_batch_size", "_last_forward_trained"})


def _fingerprint(objects: list) -> list:
    """The Python state of `objects` (the network first): the identity of every attribute's
    value. An equal value rebuilt (a new int, a new tuple) reads as a change: the step then
    goes through dynamo once more, which re-arms the direct call."""
    net, *others = objects
    out = [id(value) for key, value in vars(net).items() if key not in _WRITTEN_OUTSIDE]
    for obj in others:
        out.extend(map(id, _values(obj)))
    return out


def _values(obj: Any) -> list:
    """The values of `obj`'s attributes (of its slots, for a slotted object)."""
    attrs = getattr(obj, "__dict__", None)
    if attrs is None:
        return [getattr(obj, key, None) for key in type(obj).__slots__]
    return list(attrs.values())


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


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, batched or not, as a broadcast product summed over the shared axis: loops that
    inductor fuses with the operations around them."""
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)


def _small(a: torch.Tensor, b: torch.Tensor, limit: int) -> bool:
    return a.numel() * b.shape[-1] <= limit


def _fused_matmuls(limit: int) -> dict:
    """Decompositions of aten's matrix products of at most `limit` multiply-adds (larger ones
    stay calls to the BLAS library)."""
    aten = torch.ops.aten

    def mm(a: torch.Tensor, b: torch.Tensor) -> Any:
        return _product(a, b) if _small(a, b, limit) else NotImplemented

    def addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1,
              alpha: Any = 1) -> Any:
        if not _small(a, b, limit):
            return NotImplemented
        out = _product(a, b)
        return (out if alpha == 1 else alpha * out) + (c if beta == 1 else beta * c)

    def bmm(a: torch.Tensor, b: torch.Tensor) -> Any:
        return _product(a, b) if _small(a, b, limit) else NotImplemented

    def baddbmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1,
                alpha: Any = 1) -> Any:
        return addmm(c, a, b, beta=beta, alpha=alpha)

    return {aten.mm.default: mm, aten.addmm.default: addmm, aten.bmm.default: bmm,
            aten.baddbmm.default: baddbmm}


def _inductor_with_fused_matmuls(options: dict[str, Any] | None, limit: int) -> Callable:
    """torch.compile's inductor backend, with the small matrix products as loops."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    def backend(graph: torch.fx.GraphModule, inputs: list) -> Callable:
        table = {**select_decomp_table(), **_fused_matmuls(limit)}
        # the autograd cache's key leaves the decompositions out: it would hand back a program
        # traced with another table (inductor's own cache is keyed on the traced graph)
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(graph, inputs, config_patches=options, decompositions=table)
    return backend
