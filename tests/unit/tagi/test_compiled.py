"""`Sequential.compile()`: the whole training step as one compiled program gives the eager loop's
parameters (float64: 1e-12 relative), for every layer family the tracer captures; σ_v and the
cap are inputs (no retrace); what it cannot capture steps eagerly after one log line.

Most cases trace with torch.compile's "aot_eager" backend: the same captured graph, run by
torch's own kernels, in seconds. Two cases generate code with inductor (tens of seconds)."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch

from dptrain import tagi
from dptrain.runtime import Runtime
from dptrain.runtime.env import SINGLE
from dptrain.learners.tagi_learner import TagiLearner
from dptrain.tagi import compiled as compiled_module

F64 = torch.float64


def _pair(build, dtype=F64):
    tagi.manual_seed(0)
    eager = build().to(dtype)
    tagi.manual_seed(0)
    return eager, build().to(dtype)


def _eager_step(net, x, y, var_y, update, idx=None):
    upd = tagi.OutputUpdater()
    net(x)
    if update == "heteros":
        upd.update_heteros(net.output_z_buffer, y, net.input_delta_z_buffer)
    elif update == "indices":
        upd.update_using_indices(net.output_z_buffer, y, var_y, idx, net.input_delta_z_buffer)
    else:
        upd.update(net.output_z_buffer, y, var_y, net.input_delta_z_buffer)
    net.backward()
    net.step()


def _run(build, x_shape, out, *, update="plain", backend="aot_eager", dtype=F64, steps=4,
         x_maker=None, native=None):
    """Steps both networks on the same batches; σ_v² changes at every step. Returns (eager,
    compiled network, the CompiledStep)."""
    eager, net = _pair(build, dtype)
    step = net.compile(update, backend=backend, native=native)
    g = torch.Generator().manual_seed(1)
    for k in range(steps):
        x = x_maker(g) if x_maker else torch.randn(*x_shape, generator=g, dtype=dtype)
        batch = x.shape[0]
        # σ_v² = 1 when the program is traced (step 1): it must stay an input, not the 1.0
        # the layers use inside
        var_y, idx = (0.1, 1.0, 0.3, 0.05, 0.2)[k % 5], None
        if update == "indices":
            idx = torch.randint(1, out + 1, (batch, 2), generator=g)
            y = torch.randn(batch, 2, generator=g, dtype=dtype)
        else:
            y = torch.randn(batch, out // 2 if update == "heteros" else out, generator=g,
                            dtype=dtype)
        _eager_step(eager, x, y, var_y, update, idx)
        step(x, y, var_y, idx)
    eager._probe = x
    return eager, net, step


def _assert_same(eager, net, tol=1e-12, out_tol=None):
    """The same parameters and state to `tol`; the same evaluation forward of `eager._probe`
    to `out_tol` (default `tol`)."""
    a, b = eager.flat_params, net.flat_params
    assert torch.allclose(b, a, rtol=tol, atol=tol * float(a.abs().max()))
    assert torch.allclose(net.flat_state, eager.flat_state, rtol=tol)
    # an evaluation forward after compiled steps sees the new parameters (no stale cache)
    x = getattr(eager, "_probe", None)
    if x is None:
        return
    eager.eval(), net.eval()
    out_tol = tol if out_tol is None else out_tol
    for got, want in zip(net(x), eager(x)):
        assert torch.allclose(got, want, rtol=out_tol, atol=out_tol * float(want.abs().max()))


FAMILIES = {
    "linear hrc": (lambda: tagi.Sequential(tagi.Linear(6, 16), tagi.ReLU(), tagi.Linear(16, 7)),
                   (8, 6), 7, "indices", None),
    "conv layernorm": (lambda: tagi.Sequential(
        tagi.Conv2d(2, 4, 3, padding=1, in_width=6, in_height=6), tagi.LayerNorm((4, 6, 6)),
        tagi.ReLU(), tagi.AvgPool2d(2), tagi.Linear(36, 3)), (4, 2, 6, 6), 3, "plain", None),
    "resnet block": (lambda: tagi.Sequential(
        tagi.Conv2d(2, 4, 3, padding=1, in_width=6, in_height=6),
        tagi.ResNetBlock(tagi.LayerBlock(tagi.Conv2d(4, 4, 3, padding=1), tagi.ReLU(),
                                         tagi.Conv2d(4, 4, 3, padding=1))),
        tagi.ReLU(), tagi.Linear(144, 2)), (3, 2, 6, 6), 2, "plain", None),
    "lstm": (lambda: tagi.Sequential(tagi.LSTM(1, 4, 3), tagi.LSTM(4, 4, 3),
                                     tagi.Linear(12, 1)), (5, 3), 1, "plain", None),
    # batch 1, seq_len 1: the states carried from step to step (kept by drop_forward)
    "lstm carried": (lambda: tagi.Sequential(tagi.LSTM(1, 4, 1), tagi.Linear(4, 1)),
                     (1, 1), 1, "plain", None),
    "slstm": (lambda: tagi.Sequential(tagi.SLSTM(1, 4, 1), tagi.SLinear(4, 1)),
              (3, 1), 1, "plain", None),
    "evenexp heteros": (lambda: tagi.Sequential(tagi.Linear(1, 8), tagi.ReLU(),
                                                tagi.Linear(8, 2), tagi.EvenExp()),
                        (10, 1), 2, "heteros", None),
    # running statistics updated inside the program (the first batch sets them)
    "batchnorm": (lambda: tagi.Sequential(tagi.Linear(4, 8), tagi.BatchNorm2d(8), tagi.ReLU(),
                                          tagi.Linear(8, 1)), (6, 4), 1, "plain", None),
    "batchnorm conv": (lambda: tagi.Sequential(
        tagi.Conv2d(2, 3, 3, padding=1, in_width=5, in_height=5), tagi.BatchNorm2d(3),
        tagi.ReLU(), tagi.Linear(75, 2)), (4, 2, 5, 5), 2, "plain", None),
    # the ids' value checks run before the program (Layer.check_values)
    "embedding": (lambda: tagi.Sequential(tagi.Embedding(5, 3, input_size=2),
                                          tagi.Linear(6, 2)), None, 2, "plain",
                  lambda g: torch.randint(0, 5, (4, 2), generator=g).to(F64)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_captured_step_equals_eager(family):
    build, x_shape, out, update, x_maker = FAMILIES[family]
    eager, net, step = _run(build, x_shape, out, update=update, x_maker=x_maker)
    assert step.fallback_reason is None
    assert step.compiled_steps == 3 and step.eager_steps == 1  # the first step is eager
    _assert_same(eager, net)


def test_sigma_v_and_cap_are_inputs_not_constants():
    """Four steps with four σ_v values trace one graph; a short last batch steps eagerly."""
    counts = []
    backend = lambda gm, inputs: counts.append(1) or gm.forward  # noqa: E731 - counts traces
    build, x_shape, out, *_ = FAMILIES["lstm"]
    eager, net, step = _run(build, x_shape, out, backend=backend, steps=5)
    assert len(counts) == 1 and step.compiled_steps == 4
    x, y = torch.randn(2, 3, dtype=F64), torch.randn(2, 1, dtype=F64)
    _eager_step(eager, x, y, 0.3, "plain")
    step(x, y, 0.3)  # a short last batch
    assert len(counts) == 1 and step.eager_steps == 2
    _assert_same(eager, net)


def test_program_is_called_directly_while_the_network_state_stays():
    """After a traced step that leaves the network's Python state as it found it, the program
    runs without dynamo; a change of that state (reset_lstm_states) goes through dynamo: the
    step after the reset (its own traced variant, which stores new carried states), then one
    that leaves the state unchanged and re-arms the direct call. The parameters stay the
    eager loop's throughout."""
    build, x_shape, out, *_ = FAMILIES["lstm"]
    eager, net, step = _run(build, x_shape, out, steps=3)  # eager, traced, direct
    traced = []
    through_dynamo = step._traced_call
    step._traced_call = lambda *args: traced.append(1) or through_dynamo(*args)
    g = torch.Generator().manual_seed(3)
    for k in range(4):
        if k == 2:
            eager.reset_lstm_states(), net.reset_lstm_states()
        x, y = torch.randn(*x_shape, generator=g, dtype=F64), torch.randn(5, 1, generator=g,
                                                                          dtype=F64)
        _eager_step(eager, x, y, 0.2, "plain")
        step(x, y, 0.2)
    assert step._direct is not None and len(traced) == 2 and step.compiled_steps == 6
    _assert_same(eager, net)


def test_small_step_program_is_made_and_run_on_one_thread():
    threads_seen = []

    def backend(gm, inputs):  # records the thread count the program is generated under
        threads_seen.append(torch.get_num_threads())
        return gm.forward
    build, x_shape, out, *_ = FAMILIES["lstm"]
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, _, step = _run(build, x_shape, out, backend=backend, steps=3)
        assert threads_seen == [1] and step._single_thread
        assert torch.get_num_threads() == 2  # the caller's count, back after each step
    finally:
        torch.set_num_threads(saved)


EAGER_ONLY = {  # a statistics all-reduce inside the forward (sync_batchnorm) is not traceable;
    # an Embedding behind a Parallel block: its id checks need its share of the input
    "embedding in parallel": (lambda: tagi.Sequential(
        tagi.Parallel(tagi.Linear(2, 3), tagi.Embedding(4, 2, input_size=1), input_sizes=(2, 1)),
        tagi.Linear(5, 1)), None, 1, "plain",
        lambda g: torch.cat([torch.randn(4, 2, generator=g, dtype=F64),
                             torch.randint(0, 4, (4, 1), generator=g).to(F64)], 1)),
    "synced batchnorm": (lambda: _synced(tagi.Sequential(
        tagi.Linear(4, 8), tagi.BatchNorm2d(8), tagi.ReLU(), tagi.Linear(8, 1))), (6, 4), 1,
        "plain", None),
}


def _synced(net):
    """`net` with its BatchNorm's statistics gathered as a one-rank world would (the rank's own
    (n, mean, M2), stacked): what DDPSequential(sync_batchnorm=True) sets."""
    for _, layer in net.named_stateful():
        layer.stats_gather = lambda local: local.unsqueeze(0)
    return net


@pytest.mark.parametrize("family", list(EAGER_ONLY))
def test_uncapturable_falls_back_to_eager_with_one_line(family, caplog):
    build, x_shape, out, update, x_maker = EAGER_ONLY[family]
    with caplog.at_level(logging.WARNING, logger=compiled_module.__name__):
        eager, net, step = _run(build, x_shape, out, update=update, x_maker=x_maker)
    assert step.fallback_reason is not None and step.compiled_steps == 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "stepping eagerly" in lines[0] and "\n" not in lines[0]
    _assert_same(eager, net)


def test_bad_inputs_fail_as_in_eager():
    build, x_shape, out, *_ = FAMILIES["linear hrc"]
    _, net, step = _run(build, x_shape, out, update="indices", steps=2)
    x, y = torch.randn(8, 6, dtype=F64), torch.randn(8, 2, dtype=F64)
    with pytest.raises(ValueError, match="1-based"):
        step(x, y, 0.1, torch.full((8, 2), 99))
    with pytest.raises(ValueError, match="var_obs"):
        step(x, y, -1.0, torch.ones(8, 2, dtype=torch.long))
    x[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN|nan"):
        step(x, y, 0.1, torch.ones(8, 2, dtype=torch.long))


def test_embedding_ids_are_checked_before_the_program():
    build, _, out, update, x_maker = FAMILIES["embedding"]
    _, net, step = _run(build, None, out, update=update, x_maker=x_maker, steps=3)
    assert step.compiled_steps == 2
    before = net.flat_params.clone()
    with pytest.raises(ValueError, match="id 7.0 at index"):
        step(torch.tensor([[1.0, 7.0]] * 4, dtype=F64), torch.zeros(4, 2, dtype=F64), 0.1)
    assert torch.equal(net.flat_params, before)


@pytest.mark.slow
def test_inductor_lstm_step_equals_eager_in_float32():
    """The generated code (inductor), on pytagi's LSTM example network made small."""
    build, x_shape, out, *_ = FAMILIES["lstm"]
    eager, net, step = _run(build, x_shape, out, backend="inductor", dtype=torch.float32,
                            steps=3, native=False)
    assert step.fallback_reason is None and step.compiled_steps == 2
    _assert_same(eager, net, 1e-6)


@pytest.mark.slow
def test_learner_compile_trains_like_eager():
    """`--compile` (LearnerConfig.compile): TagiLearner's steps through the compiled program
    (inductor, float64, HRC classification) give the eager learner's parameters and metrics.
    A Tanh keeps the network off the native step."""
    learners = []
    for compile in (False, True):
        tagi.manual_seed(0)
        net = tagi.Sequential(tagi.Linear(4, 8), tagi.Tanh(), tagi.Linear(8, 3), dtype=F64)
        learner = TagiLearner(net, task="classification", num_classes=3, sigma_v=0.1,
                              compile=compile)
        learner.setup(Runtime(SINGLE, None, torch.device("cpu"), timedelta(seconds=60)))
        learners.append(learner)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = torch.randn(6, 4, generator=g, dtype=F64), torch.randint(0, 3, (6,), generator=g)
        want, got = (learner.train_step((x, y)) for learner in learners)
        assert want.keys() == got.keys()
        for key in want:
            assert torch.allclose(torch.as_tensor(got[key], dtype=F64),
                                  torch.as_tensor(want[key], dtype=F64), rtol=1e-12), key
    assert learners[1].compiled is not None and learners[1].compiled.compiled_steps == 2
    _assert_same(learners[0].model, learners[1].model)


# ---------------------------------------------------------------------- the native step
NATIVE = {  # the stacks the native library steps: LSTM, Linear and ReLU layers
    "lstm": (*FAMILIES["lstm"][:3], "plain"),
    "lstm linear stack": (lambda: tagi.Sequential(
        tagi.LSTM(2, 8, 5), tagi.LSTM(8, 6, 5, bias=False), tagi.Linear(30, 3),
        tagi.Linear(3, 2, bias=False)), (4, 10), 2, "plain"),
    "linear": (lambda: tagi.Sequential(tagi.Linear(6, 16), tagi.Linear(16, 7)), (8, 6), 7,
               "plain"),
    # the HRC head's update; the first layer's products (8 x 64 x 48) go to the BLAS library
    "linear relu hrc": (lambda: tagi.Sequential(
        tagi.Linear(64, 48), tagi.ReLU(), tagi.Linear(48, 40, bias=False), tagi.ReLU(),
        tagi.Linear(40, 11)), (8, 64), 11, "indices"),
    "relu last": (lambda: tagi.Sequential(tagi.Linear(6, 16), tagi.ReLU(), tagi.Linear(16, 7),
                                          tagi.ReLU()), (8, 6), 7, "plain"),
    # the heteroscedastic head: (mean, noise) pairs, the AGVI update
    "evenexp heteros": (*FAMILIES["evenexp heteros"][:3], "heteros"),
    "lstm evenexp heteros": (lambda: tagi.Sequential(
        tagi.LSTM(1, 6, 4), tagi.Linear(24, 4), tagi.EvenExp()), (5, 4), 4, "heteros"),
}


def _targets(g, batch, out, update, dtype, k):
    """(y, var_y, idx) of step k: σ_v² changing per step, then a per-target tensor; a NaN
    target at step 2 (no update from it); for the indexed update 4 outputs per sample, one
    of them twice (its two innovations add)."""
    idx = None
    width = out // 2 if update == "heteros" else out
    if update == "indices":
        idx = torch.randint(1, out + 1, (batch, 4), generator=g)
        idx[:, 3] = idx[:, 0]
        width = 4
    y = torch.randn(batch, width, generator=g, dtype=dtype)
    y[0, 0] = float("nan") if k == 2 else y[0, 0]
    var_y = (0.1, 1.0, 0.3)[k % 3] if k < 3 else torch.rand(batch, width, generator=g,
                                                             dtype=dtype) + 0.05
    return y, var_y, idx


@pytest.mark.parametrize("dtype, tol", [(F64, 1e-12), (torch.float32, 1e-6)],
                         ids=["float64", "float32"])
@pytest.mark.parametrize("family", list(NATIVE))
def test_native_step_equals_eager(family, dtype, tol):
    """The native library's step gives the eager loop's parameters: σ_v² changing per step, a
    NaN target (no update from it) and, for the last steps, a per-output var_y tensor."""
    build, x_shape, out, update = NATIVE[family]
    eager, net = _pair(build, dtype)
    step = net.compile(update, native=True)
    g = torch.Generator().manual_seed(1)
    for k in range(5):
        x = torch.randn(*x_shape, generator=g, dtype=dtype)
        y, var_y, idx = _targets(g, x_shape[0], out, update, dtype, k)
        if update == "heteros":  # the noise is learned, not given
            var_y = 0.0
        _eager_step(eager, x, y, var_y, update, idx)
        mu, var = step(x, y, var_y, idx)
        # what the step returns: the eager forward's (every step native, the first too); in
        # float32 an EvenExp's e^Z turns Z's rounding (~1e-6 of |Z| ~ 10) into ~2e-6 of T's
        # variance, while the parameters still agree to 1e-7
        assert mu.shape == eager.output_z_buffer.mu_a.shape
        out_tol = tol * 10 if update == "heteros" and dtype == torch.float32 else tol
        assert torch.allclose(var, eager.output_z_buffer.var_a, rtol=out_tol)
    assert step.fallback_reason is None and list(step._natives) == [x_shape[0]]
    assert step.compiled_steps == 5 and step.eager_steps == 0
    eager._probe = x
    _assert_same(eager, net, tol, out_tol)


@pytest.mark.parametrize("family", ["lstm linear stack", "linear relu hrc", "evenexp heteros"])
def test_native_predict_is_the_eager_evaluation_forward(family, monkeypatch):
    """`step.predict(x)`: the eager evaluation forward's (mu, var) (float64), at the training
    batch size and another, through the library's forward, nothing stepped, the network's
    mode kept; a network the native step does not do gets the eager forward itself."""
    from dptrain.tagi import native
    forwards = []
    library_forward = native.NativeStep.forward
    monkeypatch.setattr(native.NativeStep, "forward", lambda self, *args: forwards.append(
        library_forward(self, *args)) or forwards[-1])
    build, x_shape, out, update = NATIVE[family]
    eager, net = _pair(build)
    step = net.compile(update, native=True)
    g = torch.Generator().manual_seed(7)
    for batch in (x_shape[0], 3):
        x = torch.randn(batch, *x_shape[1:], generator=g, dtype=F64)
        before = net.flat_params.clone()
        mu, var = step.predict(x)
        assert net.training and torch.equal(net.flat_params, before)
        eager.eval()
        want = eager(x)
        eager.train()
        for got, expected in zip((mu, var), want):
            assert got.shape == expected.shape
            assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12 * float(
                expected.abs().max()))
        assert forwards[-1] is not None and forwards[-1][0] is mu  # the library's, not eager
    assert len(forwards) == 2
    other = FAMILIES["batchnorm"][0]()
    other.to(F64)
    x = torch.randn(6, 4, dtype=F64)
    mu, _ = other.compile(native=True).predict(x)
    other.eval()
    assert torch.equal(mu, other(x)[0])


def test_native_products_in_blas_and_loops_agree(monkeypatch):
    """The same network stepped with its products in the BLAS library and as the library's
    own loops (torch exporting none) gives the same parameters (float64)."""
    from dptrain.tagi import native
    build, x_shape, out, update = NATIVE["linear relu hrc"]
    nets = []
    for gemm in (True, False):
        if not gemm:
            monkeypatch.setattr(native, "_gemms", {F64: 0})
        tagi.manual_seed(0)
        net = build().to(F64)
        step = net.compile(update, native=True)
        g = torch.Generator().manual_seed(3)
        for k in range(3):
            x = torch.randn(*x_shape, generator=g, dtype=F64)
            step(x, *_targets(g, x_shape[0], out, update, F64, k))
        assert bool(step._natives[x_shape[0]].plan[8]) is gemm  # the product's address
        nets.append(net)
    assert torch.allclose(nets[0].flat_params, nets[1].flat_params, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["float32", "float64"])
def test_native_blas_products_take_32_and_64_bit_integers(dtype):
    """The step's call of a Fortran ?gemm_ reads right whether the library's integers are 32
    bits (LP64, `sgemm_`) or 64 (ILP64, MKL's `SGEMM_64`): both agree with torch on the
    check's product, so either found first would do."""
    from dptrain.tagi import native
    letter = "s" if dtype == torch.float32 else "d"
    found = {name: list(native._torch_symbols(name))
             for name in (f"{letter}gemm_", f"{letter.upper()}GEMM_64")}
    if not any(found.values()):
        pytest.skip("torch exports no Fortran BLAS product here: the step's loops do them")
    assert all(native._gemm_works(address, dtype)
               for addresses in found.values() for address in addresses)
    lp64 = found[f"{letter}gemm_"]
    assert native.blas(dtype) == (lp64[0] if lp64 else 0)  # the step takes ?gemm_


def test_native_step_checks_indices_like_eager():
    """An index out of range fails as the eager update does, naming it, and writes nothing."""
    build, x_shape, out, update = NATIVE["linear relu hrc"]
    net = build()
    step = net.compile(update, native=True)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(*x_shape, generator=g)
    y, _, idx = _targets(g, x_shape[0], out, update, torch.float32, 0)
    step(x, y, 0.1, idx)
    before = net.flat_params.clone()
    idx[3, 1] = out + 1
    with pytest.raises(ValueError, match=rf"got {out + 1} at sample 3, position 1"):
        step(x, y, 0.1, idx)
    with pytest.raises(ValueError, match="must hold integers"):
        step(x, y, 0.1, idx.double())
    assert torch.equal(net.flat_params, before) and step.compiled_steps == 1


def test_native_step_checks_inputs_and_states_like_eager():
    """A non-finite input fails as in eager, before anything is written; states set by
    set_lstm_states (not zero) are the eager loop's to step; `to()` plans anew."""
    build, x_shape, out, _ = NATIVE["lstm"]
    eager, net = _pair(build)
    step = net.compile(native=True)
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(*x_shape, generator=g, dtype=F64),
                torch.randn(5, out, generator=g, dtype=F64)) for _ in range(6)]
    for x, y in batches[:3]:
        _eager_step(eager, x, y, 0.2, "plain")
        step(x, y, 0.2)
    before = net.flat_params.clone()
    bad = batches[3][0].clone()
    bad[1, 2] = float("inf")
    with pytest.raises(ValueError, match="inf"):
        step(bad, batches[3][1], 0.2)
    assert torch.equal(net.flat_params, before)
    states = [torch.rand(5, 3, 4, generator=g, dtype=F64) for _ in range(4)]
    for model in (eager, net):
        model.layers[0].set_lstm_states(*states)
    with pytest.raises(ValueError, match="inf"):  # checked on the eager path too
        step(bad, batches[3][1], 0.2)
    assert torch.equal(net.flat_params, before)
    compiled = step.compiled_steps
    for x, y in batches[3:5]:
        _eager_step(eager, x, y, 0.2, "plain")
        step(x, y, 0.2)
    assert step.compiled_steps == compiled and step.fallback_reason is None
    _assert_same(eager, net)
    for model in (eager, net):
        model.reset_lstm_states()
        model.to(torch.float32)
    x, y = (t.float() for t in batches[5])
    _eager_step(eager, x, y, 0.2, "plain")
    step(x, y, 0.2)
    assert step.compiled_steps == compiled + 1
    _assert_same(eager, net, 1e-6)


def test_native_step_leaves_other_networks_to_the_program(caplog):
    """`native=True` on a network it does not do steps eagerly after one line; `native=None`
    leaves it to inductor's program, saying why at INFO."""
    build, x_shape, out, *_ = FAMILIES["batchnorm"]
    with caplog.at_level(logging.INFO, logger=compiled_module.__name__):
        eager, net, step = _run(build, x_shape, out, native=True, steps=3, update="plain")
        assert "(not BatchNorm2d)" in step.fallback_reason and step.compiled_steps == 0
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "stepping eagerly" in lines[0]
        _assert_same(eager, net)
        caplog.clear()
        auto = net.compile()  # inductor, native where it applies
        assert auto._native_step(8) is None and auto._native_off
        assert [r.levelname for r in caplog.records] == ["INFO"]


@pytest.mark.parametrize("layers, why", [
    ((tagi.ReLU(), tagi.Linear(4, 2)), "a ReLU only between Linear layers"),
    ((tagi.Linear(4, 4), tagi.ReLU(), tagi.ReLU(), tagi.Linear(4, 2)), "a ReLU only"),
    ((tagi.LSTM(1, 4, 1), tagi.ReLU(), tagi.Linear(4, 2)), "a ReLU only"),
    ((tagi.Linear(4, 3), tagi.Sigmoid()), "(not Sigmoid)"),
    ((tagi.Linear(4, 4), tagi.EvenExp(), tagi.Linear(4, 2)), "an EvenExp only after the last"),
    ((tagi.Linear(4, 3), tagi.ReLU(), tagi.Linear(3, 3)), "(batch, even width)"),
    ((tagi.Linear(4, 4), tagi.ReLU(), tagi.Linear(4, 2)), None),
    ((tagi.Linear(4, 4), tagi.ReLU(), tagi.Linear(4, 2), tagi.EvenExp()), None),
])
def test_native_step_says_which_networks_it_does(layers, why):
    from dptrain.tagi import native
    got = native.not_native(tagi.Sequential(*layers), "heteros")
    assert got is None if why is None else why in got
    assert "not 'mixture'" in native.not_native(tagi.Sequential(*layers), "mixture")


def test_native_library_is_built_once_and_cached(tmp_path, monkeypatch):
    """The library is built into the cache at first use and loaded from it after; a machine
    without a working compiler gets a reason, not an exception out of the step."""
    from dptrain.tagi import native
    monkeypatch.setenv("DPTRAIN_NATIVE_CACHE", str(tmp_path))
    built = native._build()
    assert built.parent == tmp_path and built.suffix == ".so"
    stamp = built.stat().st_mtime_ns
    assert native._build() == built and built.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no partial files left
    monkeypatch.setenv("DPTRAIN_NATIVE_CACHE", str(tmp_path / "other"))
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native.shutil, "which",
                        lambda name: "/bin/false" if name == "false" else None)
    with pytest.raises(native.NotNative, match="could not be built"):
        native.library()


def test_learner_compile_steps_an_lstm_natively():
    """`--compile` on a forecasting network (LSTM and Linear): TagiLearner's steps through the
    native library give the eager learner's parameters and metrics (float64)."""
    learners = []
    for compile in (False, True):
        tagi.manual_seed(0)
        net = tagi.Sequential(tagi.LSTM(2, 6, 4), tagi.Linear(24, 1), dtype=F64)
        learner = TagiLearner(net, task="regression", sigma_v=0.2, compile=compile)
        learner.setup(Runtime(SINGLE, None, torch.device("cpu"), timedelta(seconds=60)))
        learners.append(learner)
    g = torch.Generator().manual_seed(2)
    _learn_alike(learners, [(torch.randn(5, 4, 2, generator=g, dtype=F64),
                             torch.randn(5, 1, generator=g, dtype=F64)) for _ in range(3)])


def _learn_alike(learners, batches):
    """The eager learner and the native one (second) give the same metrics (float64, 1e-12),
    training and evaluating, and parameters on `batches`, every step of the second native."""
    for batch in batches:
        for method in ("train_step", "eval_step"):
            want, got = (getattr(learner, method)(batch) for learner in learners)
            for key in want:
                assert torch.allclose(torch.as_tensor(got[key], dtype=F64),
                                      torch.as_tensor(want[key], dtype=F64), rtol=1e-12), key
    compiled = learners[1].compiled
    assert compiled is not None and compiled.compiled_steps == len(batches)
    assert list(compiled._natives)
    # the evaluations went through the library's forward
    assert compiled._predictors and None not in compiled._predictors.values()
    _assert_same(learners[0].model, learners[1].model)


@pytest.mark.parametrize("task", ["classification", "heteroscedastic"])
def test_learner_compile_steps_a_classifier_and_a_heteroscedastic_mlp_natively(task):
    """`--compile` auto on a classifier (Linear and ReLU layers, the HRC head's indexed
    update) and on heteroscedastic regression (an EvenExp head, the AGVI update): the same
    parameters and metrics as the eager learner (float64)."""
    runtime = Runtime(SINGLE, None, torch.device("cpu"), timedelta(seconds=60))
    learners = []
    for compile in (False, "auto"):
        tagi.manual_seed(0)
        if task == "classification":
            net = tagi.Sequential(tagi.Linear(12, 16), tagi.ReLU(), tagi.Linear(16, 6),
                                  dtype=F64)
            learner = TagiLearner(net, task=task, num_classes=5, compile=compile)
        else:
            net = tagi.Sequential(tagi.Linear(12, 16), tagi.ReLU(), tagi.Linear(16, 2),
                                  tagi.EvenExp(), dtype=F64)
            learner = TagiLearner(net, task="regression", heteroscedastic=True,
                                  compile=compile)
        learner.setup(runtime)
        learners.append(learner)
    g = torch.Generator().manual_seed(6)
    batches = []
    for _ in range(3):
        x = torch.randn(8, 12, generator=g, dtype=F64)
        batches.append((x, torch.randint(0, 5, (8,), generator=g) if task == "classification"
                        else torch.randn(8, 1, generator=g, dtype=F64)))
    _learn_alike(learners, batches)


def test_learner_compile_auto_is_native_where_it_applies():
    """The main job's default (`compile` auto): the native step for LSTM, Linear and ReLU
    stacks, eager for the networks it does not do (no minute-long torch.compile unasked)."""
    runtime = Runtime(SINGLE, None, torch.device("cpu"), timedelta(seconds=60))
    for net, native in ((tagi.Sequential(tagi.LSTM(2, 6, 4), tagi.Linear(24, 1)), True),
                        (tagi.Sequential(tagi.Linear(8, 6), tagi.ReLU(), tagi.Linear(6, 1)),
                         True),
                        (tagi.Sequential(tagi.Linear(8, 6), tagi.Tanh(), tagi.Linear(6, 1)),
                         False)):
        learner = TagiLearner(net, task="regression", sigma_v=0.2, compile="auto")
        learner.setup(runtime)
        assert (learner.compiled is not None) is native
        if native:
            learner.train_step((torch.randn(5, 8), torch.randn(5, 1)))
            assert learner.compiled.compiled_steps == 1 and list(learner.compiled._natives)
