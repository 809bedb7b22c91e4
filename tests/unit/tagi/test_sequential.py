"""Sequential: the properties of docs/tagi.md on whole networks, and the DDP-facing API."""

from __future__ import annotations

import math

import pytest
import torch

from dptrain.tagi import (HRCSoftmax, Linear, MixtureReLU, MixtureTanh, OutputUpdater, ReLU,
                          Remax, Sequential, Sigmoid, cap_factor, manual_seed)
from dptrain.tagi.base import VAR_FLOOR
from tests.unit.tagi.helpers import F64, deltas, gen, hrc_step, regression_step


def _mlp(dtype: torch.dtype = torch.float32, seed: int = 0) -> Sequential:
    manual_seed(seed)
    return Sequential(Linear(6, 16), MixtureReLU(), Linear(16, 16), ReLU(), Linear(16, 11),
                      dtype=dtype)


def _batch(n: int, seed: int = 1, dtype: torch.dtype = torch.float32):
    g = gen(seed)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 10, (n,), generator=g)


def test_state_dict_names_and_parameter_order():
    net = _mlp()
    names = [name for name, _ in net.named_parameter_tensors()]
    assert names == [f"{i}.{p}" for i in (0, 2, 4) for p in ("mu_w", "var_w", "mu_b", "var_b")]
    assert list(net.state_dict()) == names
    assert [n for n, _ in net.named_delta_tensors()] == [
        f"{i}.{p}" for i in (0, 2, 4)
        for p in ("delta_mu_w", "delta_var_w", "delta_mu_b", "delta_var_b")]
    assert net.device == torch.device("cpu") and net.dtype == torch.float32


def test_signs_and_positivity():
    """δv ≤ 0 so Δv_W, Δv_B ≤ 0 (docs/tagi.md); forward variances ≥ 0; variances > 0 after step."""
    net = _mlp(F64)
    x, labels = _batch(32)
    for _ in range(5):
        hrc_step(net, x.double(), labels, do_step=False)
        _, var = net.output_z_buffer.mu_a, net.output_z_buffer.var_a
        assert bool((var >= 0).all())
        for name, t in net.named_delta_tensors():
            if "delta_var" in name:
                assert bool((t <= 0).all()), name
        net.step()
        for name, t in net.named_parameter_tensors():
            if ".var_" in name:
                assert bool((t > 0).all()), name


def test_cap_factor_regimes():
    """c(B) = 0.1 for B = 1, 2 for 1 < B < 256, 3 for B >= 256 (docs/tagi.md, Capped step)."""
    assert [cap_factor(b) for b in (1, 2, 255, 256, 4096)] == [0.1, 2.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="cap batch size must be >= 1, got 0"):
        cap_factor(0)


@pytest.mark.parametrize("batch,cap_batch", [(1, None), (5, None), (256, None), (8, 256)])
def test_cap_bound(batch, cap_batch):
    """|Δapplied| ≤ sqrt(v_old)/c(B) for means and variances unless the floor fired;
    `cap_batch_size` replaces the forward's batch size in c(B)."""
    net = _mlp(F64)
    net.cap_batch_size = cap_batch
    x, labels = _batch(batch)
    hrc_step(net, x.double(), labels, sigma_v=0.01, do_step=False)  # small noise: big deltas
    old = {n: t.clone() for n, t in net.named_parameter_tensors()}
    proposed = deltas(net)
    net.step()
    c = cap_factor(cap_batch or batch)
    capped = 0
    for name, new in net.named_parameter_tensors():
        path, kind = name.rsplit(".", 1)
        group = kind.split("_")[1]
        bar = old[f"{path}.var_{group}"].sqrt() / c
        change = (new - old[name]).abs()
        floored = (new == VAR_FLOOR) & kind.startswith("var")
        assert bool((change[~floored] <= bar[~floored] * (1 + 1e-12)).all()), name
        want = proposed[f"{path}.delta_{kind}"]
        clipped = want.abs() > bar
        capped += int(clipped.sum())
        # Clipped entries move by exactly sign(Δ)·bar, the others by Δ; then the floor rule.
        moved = old[name] + torch.where(clipped, torch.sign(want) * bar, want)
        if kind.startswith("var"):
            moved = torch.where(moved > 0, moved, torch.full_like(moved, VAR_FLOOR))
        torch.testing.assert_close(new, moved, rtol=1e-12, atol=0)
    assert capped > 0 or batch == 1  # the test exercises the cap (c(1) = 0.1 rarely binds)


def test_variance_floor_rule_is_exact():
    """v_new = v_old + clip(Δv) if that is > 0, else exactly 1e-5: a tiny positive result stays
    (no 'v ≤ 1e-5' floor), zero and negative results become 1e-5; means are never floored."""
    from dptrain.tagi.base import capped_update_

    v_old = torch.full((5,), 0.01, dtype=F64)  # c = 0.1 (B = 1): bar = 10·sqrt(v) = 1 ≥ v
    dv = torch.tensor([-0.01 + 1e-6, -0.01, -0.5, 0.7, -3.0], dtype=F64)
    params = torch.stack([torch.zeros(5, dtype=F64), v_old])
    dm = torch.tensor([0.1, -0.6, 0.5, -0.5, 2.0], dtype=F64)
    capped_update_(params, torch.stack([dm, dv]), 0.1)
    torch.testing.assert_close(params[0], torch.tensor([0.1, -0.6, 0.5, -0.5, 1.0],
                                                       dtype=F64), rtol=1e-15, atol=0)
    want = torch.tensor([1e-6, VAR_FLOOR, VAR_FLOOR, 0.71, VAR_FLOOR], dtype=F64)
    torch.testing.assert_close(params[1], want, rtol=1e-9, atol=0)
    assert params[1, 0].item() < VAR_FLOOR and params[1, 1].item() == VAR_FLOOR


def test_step_rows_kept_across_steps_match_fresh_ones():
    """A Sequential keeps its step's row views (StepRows) for every step; stepping through them
    twice is exactly stepping through freshly made views twice."""
    from dptrain.tagi.base import StepRows, capped_update_, scale_deltas_

    gen = torch.Generator().manual_seed(0)
    params = torch.stack([torch.randn(50, generator=gen, dtype=F64),
                          torch.rand(50, generator=gen, dtype=F64)])
    deltas = torch.randn(2, 50, generator=gen, dtype=F64)
    kept_params, kept_deltas = params.clone(), deltas.clone()
    rows = StepRows(kept_params, kept_deltas)
    for _ in range(2):
        rows.scale_deltas_()
        rows.capped_update_(2.0)
        scale_deltas_(params, deltas)
        capped_update_(params, deltas, 2.0)
    assert torch.equal(kept_params, params) and torch.equal(kept_deltas, deltas)


def test_finite_and_constant():
    from dptrain.tagi.base import constant, finite

    x = torch.tensor([0.0, -1.5, 3e38, float("inf"), float("-inf"), float("nan")])
    assert torch.equal(finite(x), torch.isfinite(x))
    one = constant(1.0, x)
    assert one.dim() == 0 and one.dtype == x.dtype and constant(1.0, x) is one
    assert constant(1.0, x.double()).dtype == F64


def test_reassigned_delta_or_state_attribute_is_caught_after_the_first_backward():
    """A layer that re-binds a delta attribute instead of writing into its view would never be
    stepped or all-reduced; the first backward names it (and `to()` re-arms the check)."""

    class Rebinding(Linear):
        def backward(self, delta, need_input_delta):
            out = super().backward(delta, need_input_delta)
            self.delta_mu_w = self.delta_mu_w.clone()  # detached from the flat buffer
            return out

    net = Sequential(Linear(6, 4), ReLU(), Rebinding(4, 11), dtype=F64)
    x, labels = _batch(4, dtype=F64)
    with pytest.raises(RuntimeError, match=r"layer 2 \(Linear\(4, 11, bias=True\)\)"
                                           r"\.delta_mu_w: re-assigned instead of written"):
        hrc_step(net, x, labels)
    good = _mlp(F64)
    hrc_step(good, x, labels)  # the check passes once and is not repeated
    good.layers[0].mu_b = good.layers[0].mu_b.clone()
    hrc_step(good, x, labels)
    good.to(torch.float32)  # rebinds: re-armed, and the rebuilt views are fine
    hrc_step(good, x.float(), labels)

    from dptrain.tagi import BatchNorm2d

    bn_net = Sequential(Linear(6, 4), BatchNorm2d(4), Linear(4, 11), dtype=F64)
    bn = bn_net.layers[1]
    original = bn._update_running
    bn._update_running = lambda mean, var: (original(mean, var),
                                            setattr(bn, "mu_ra", mean.clone()))
    with pytest.raises(RuntimeError, match=r"layer 1 \(BatchNorm2d\(4\)\)\.mu_ra: re-assigned"):
        hrc_step(bn_net, x, labels)


def test_batch_additivity():
    """Deltas of a batch equal the sum of the deltas of any split of it (docs/tagi.md, Linear)."""
    net = Sequential(Linear(6, 16), MixtureReLU(), Linear(16, 8), Sigmoid(), Linear(8, 11),
                     Remax(), dtype=F64)
    x, labels = _batch(9, dtype=F64)
    y = torch.nn.functional.one_hot(labels, 11).to(F64)
    regression_step(net, x, y, 0.1, do_step=False)
    whole = deltas(net)
    parts = []
    for sl in (slice(0, 4), slice(4, 6), slice(6, 9)):
        regression_step(net, x[sl], y[sl], 0.1, do_step=False)
        parts.append(deltas(net))
    for name, value in whole.items():
        torch.testing.assert_close(sum(p[name] for p in parts), value, rtol=1e-10, atol=1e-15)


def test_float32_agrees_with_float64():
    """Same seed, same data: float32 forward and trained parameters track float64."""
    nets = {dt: _mlp(dt) for dt in (torch.float32, F64)}
    x, labels = _batch(32)
    for dt, net in nets.items():
        for _ in range(3):
            hrc_step(net, x.to(dt), labels)
        net.eval()
    out32, out64 = (nets[dt](x.to(dt)) for dt in (torch.float32, F64))
    torch.testing.assert_close(out32[0].double(), out64[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out32[1].double(), out64[1], rtol=1e-4, atol=1e-6)
    p32, p64 = nets[torch.float32].flat_params, nets[F64].flat_params
    assert (p32.double() - p64).abs().max().item() < 1e-5


def test_float32_forward_matches_float64_reference_on_same_parameters():
    net64 = _mlp(F64)
    net32 = _mlp(torch.float32)
    net32.load_state_dict(net64.state_dict())
    x, _ = _batch(64, dtype=F64)
    mu32, var32 = net32.eval()(x)
    mu64, var64 = net64.eval()(x)
    torch.testing.assert_close(mu32.double(), mu64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(var32.double(), var64, rtol=1e-5, atol=1e-7)


def test_determinism_for_a_fixed_seed():
    results = []
    for _ in range(2):
        net = _mlp(seed=5)
        x, labels = _batch(32, seed=6)
        for _ in range(3):
            hrc_step(net, x, labels)
        results.append(net.flat_params.clone())
    assert torch.equal(results[0], results[1])
    assert not torch.equal(_mlp(seed=5).flat_params, _mlp(seed=6).flat_params)


def test_dtype_independent_init():
    """A seed draws the same parameters in float32 and float64 (draws are made in float64)."""
    assert torch.equal(_mlp(torch.float32).flat_params, _mlp(F64).flat_params.float())


def test_named_tensors_are_live_storage():
    """In-place writes to parameters change the model; edits to deltas change the step."""
    net = _mlp(F64)
    x, labels = _batch(8, dtype=F64)
    hrc_step(net, x, labels, do_step=False)
    before = {n: t.clone() for n, t in net.named_parameter_tensors()}
    for _, t in net.named_delta_tensors():
        t.zero_()
    net.step()
    for name, t in net.named_parameter_tensors():
        assert torch.equal(t, before[name]), name
    dict(net.named_parameter_tensors())["4.mu_b"].fill_(3.0)
    assert bool((net.layers[4].mu_b == 3.0).all())
    assert bool((net.state_dict()["4.mu_b"] == 3.0).all())


def test_last_batch_size_and_eval_mode():
    """Eval forwards neither record the batch size nor change parameters (docs/tagi.md)."""
    net = _mlp()
    x, labels = _batch(32)
    hrc_step(net, x, labels, do_step=False)
    assert net.last_batch_size == 32
    net.eval()
    params = net.flat_params.clone()
    net(x[:1])
    assert net.last_batch_size == 32 and torch.equal(net.flat_params, params)
    net.train()
    net.step()
    assert not torch.equal(net.flat_params, params)


def test_nested_blocks_share_the_outer_buffers():
    """A Sequential inside a Sequential: same math as the flat network, one flat buffer."""
    manual_seed(3)
    flat = Sequential(Linear(6, 8), ReLU(), Linear(8, 8), MixtureTanh(), Linear(8, 11), dtype=F64)
    manual_seed(3)
    nested = Sequential(Linear(6, 8), ReLU(), Sequential(Linear(8, 8), MixtureTanh()),
                        Linear(8, 11), dtype=F64)
    names = [n for n, _ in nested.named_parameter_tensors()]
    assert names[4:6] == ["2.0.mu_w", "2.0.var_w"]
    assert nested.flat_params.shape == flat.flat_params.shape
    x, labels = _batch(16, dtype=F64)
    for net in (flat, nested):
        for _ in range(2):
            hrc_step(net, x, labels)
    torch.testing.assert_close(nested.flat_params, flat.flat_params, rtol=1e-13, atol=1e-15)
    with pytest.raises(RuntimeError, match="outermost"):
        nested.layers[2].step()


def test_to_dtype_and_device_keeps_values():
    net = _mlp()
    before = net.state_dict()
    assert net.to(F64) is net and net.dtype == F64
    assert net.to("cpu", torch.float32).dtype == torch.float32
    for name, t in net.named_parameter_tensors():
        torch.testing.assert_close(t, before[name])
    x, labels = _batch(4)
    hrc_step(net, x, labels)  # still trains after rebuilding the buffers


def test_state_dict_round_trip_and_save_load(tmp_path):
    net = _mlp()
    x, labels = _batch(16)
    hrc_step(net, x, labels)
    path = tmp_path / "net.pt"
    net.save(str(path))
    other = _mlp(seed=9)
    other.load(str(path))
    assert torch.equal(other.flat_params, net.flat_params)
    snapshot = net.state_dict()
    hrc_step(net, x, labels)  # state_dict holds copies, unaffected by training
    net.load_state_dict(snapshot)
    assert torch.equal(net.flat_params, other.flat_params)
    raw = torch.load(path, weights_only=True)  # plain tensors, loadable without pickled code
    assert raw["format"] == "dptrain.tagi.Sequential" and set(raw["state_dict"]) == set(snapshot)


# The HRC rows of classes 0 … 9 (docs/tagi.md, Hierarchical softmax): decision c of class r
# sits at output HRC_ROWS[r][c] (1-based) and is observed as +1 for bit 0 of r's code, else −1.
HRC_ROWS = [[1, 2, 4, 7], [1, 2, 4, 7], [1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 5, 9], [1, 2, 5, 9],
            [1, 2, 5, 10], [1, 2, 5, 10], [1, 3, 6, 11], [1, 3, 6, 11]]


def _mlp_input_innovations(net: Sequential, x: torch.Tensor, labels: torch.Tensor,
                           sigma_v: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(δm_x, δv_x) of `_mlp` (Linear, MixtureReLU, Linear, ReLU, Linear) for a deterministic
    input and HRC observations, written from the equations of docs/tagi.md in float64 without
    calling the engine: forward moments, J of each activation, output update, backward."""
    p = {k: v.double() for k, v in net.state_dict().items()}
    w1, w2, w3 = p["0.mu_w"], p["2.mu_w"], p["4.mu_w"]
    # Linear on a deterministic input, then MixtureReLU: rectified-Gaussian moments, J = Φ(α).
    m1 = x @ w1.T + p["0.mu_b"]
    v1 = (x * x) @ p["0.var_w"].T + p["0.var_b"]
    s1 = v1.sqrt()
    alpha = m1 / s1
    cdf, pdf = torch.special.ndtr(alpha), torch.exp(-0.5 * alpha**2) / math.sqrt(2 * math.pi)
    mean = m1 * cdf + s1 * pdf
    ma1 = mean.clamp_min(1e-6)
    va1 = ((m1**2 + v1) * cdf + m1 * s1 * pdf - mean**2).clamp_min(1e-6)
    j1 = cdf
    # Linear on an uncertain input, then ReLU linearised at the mean.
    m2 = ma1 @ w2.T + p["2.mu_b"]
    v2 = va1 @ (w2**2 + p["2.var_w"]).T + ma1**2 @ p["2.var_w"].T + p["2.var_b"]
    j2 = (m2 > 0).double()
    ma2, va2 = m2.clamp_min(0), j2 * v2
    m3 = ma2 @ w3.T + p["4.mu_b"]
    v3 = va2 @ (w3**2 + p["4.var_w"]).T + ma2**2 @ p["4.var_w"].T + p["4.var_b"]
    # Index update: δm = (y − m)/(v + σ²), δv = −1/(v + σ²) at the selected outputs only.
    d3, dv3 = torch.zeros_like(m3), torch.zeros_like(m3)
    for b, label in enumerate(labels.tolist()):
        for c, node in enumerate(HRC_ROWS[label]):
            y = 1.0 if (label >> (3 - c)) & 1 == 0 else -1.0
            d3[b, node - 1] += (y - m3[b, node - 1]) / (v3[b, node - 1] + sigma_v**2)
            dv3[b, node - 1] -= 1.0 / (v3[b, node - 1] + sigma_v**2)
    # Backward: δm_prev = J ⊙ (δm @ m_W), δv_prev = J² ⊙ (δv @ m_W²); x has J = 1.
    d2, dv2 = j2 * (d3 @ w3), j2**2 * (dv3 @ w3**2)
    d1, dv1 = j1 * (d2 @ w2), j1**2 * (dv2 @ w2**2)
    return d1 @ w1, dv1 @ w1**2


def test_input_state_update_gives_the_input_innovations_of_the_equations():
    """`input_state_update = True` puts the innovations of the network input into
    `input_delta_x`: on a three-layer network with HRC observations they equal a transcription
    of docs/tagi.md's equations to 1e-12. Mutations tried, each failing this test: δv_x built
    with m_W² + v_W instead of m_W² (`_weight_moments()[1]` in `Linear.backward`, the path a
    deterministic input takes), J instead of J² on δv (the non-ReLU case in
    `Linear.backward`), and `input_delta_x` set to the innovations of the first layer's output
    (the backward loop stopping one layer early)."""
    net = _mlp(F64)
    net.input_state_update = True
    x, labels = _batch(4, dtype=F64)
    hrc_step(net, x, labels, sigma_v=0.3, hrc=HRCSoftmax(10), do_step=False)
    want_mu, want_var = _mlp_input_innovations(net, x, labels, 0.3)
    got = net.input_delta_x
    assert got is not None
    torch.testing.assert_close(got.delta_mu, want_mu, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got.delta_var, want_var, rtol=1e-12, atol=1e-14)
    net.input_state_update = False  # off (pytagi's default): no input innovations
    hrc_step(net, x, labels, sigma_v=0.3, do_step=False)
    assert net.input_delta_x is None


def test_input_innovations_of_one_linear_output_are_the_exact_posterior_of_the_input():
    """One Linear output y = w·x + b + noise with known weights (v_W = v_B = 0) and a Gaussian
    input x ~ N(m_x, diag v_x) is a linear-Gaussian model, so the input's posterior is exact:
    m_x + v_x w (y − m_y)/S and v_x − v_x² w²/S with S = Σ w² v_x + σ². The innovations must
    give it through m_x + v_x δm_x, v_x + v_x² δv_x. Mutation tried: m_W for m_W² in δv
    (fails)."""
    net = Sequential(Linear(5, 1), dtype=F64)
    g = gen(3)
    w = torch.randn(1, 5, generator=g, dtype=F64)
    layer = net.layers[0]
    # In place: load_state_dict refuses variances of 0, which is what makes this model exact.
    layer.mu_w.copy_(w), layer.mu_b.fill_(0.3), layer.var_w.zero_(), layer.var_b.zero_()
    net.input_state_update = True
    m_x = torch.randn(3, 5, generator=g, dtype=F64)
    v_x = 0.2 + torch.rand(3, 5, generator=g, dtype=F64)
    y = torch.randn(3, 1, generator=g, dtype=F64)
    net(m_x, v_x)
    OutputUpdater(net.device).update(net.output_z_buffer, y, 0.5**2, net.input_delta_z_buffer)
    net.backward()
    s = v_x @ (w * w).T + 0.5**2  # (3, 1)
    residual = y - (m_x @ w.T + 0.3)
    delta = net.input_delta_x
    torch.testing.assert_close(m_x + v_x * delta.delta_mu, m_x + v_x * w * residual / s,
                               rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(v_x + v_x**2 * delta.delta_var, v_x - v_x**2 * w * w / s,
                               rtol=1e-12, atol=1e-14)


def test_package_docstring_example_runs():
    """The usage example in dptrain.tagi's docstring is kept runnable."""
    import textwrap

    import dptrain.tagi

    example = dptrain.tagi.__doc__.split("::", 1)[1].split("\nRegression")[0]
    namespace: dict = {}
    exec(textwrap.dedent(example), namespace)  # noqa: S102
    assert namespace["pred"].shape == (32,) and namespace["mu"].shape == (32, 11)


def _activation_closed_form(name: str, m: torch.Tensor, v: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m_A, v_A, J) of each activation from docs/tagi.md, Activations, written without the
    engine: linearised ones from f and f', mixtures from the moments of max(Z, 0) and of the
    clipped Gaussian clip(Z, −1, 1) (plain float64 forms; the engine uses cancellation-free
    ones)."""
    linearised = {
        "ReLU": (m.clamp_min(0), (m > 0).double()),
        "LeakyReLU": (torch.where(m > 0, m, 0.1 * m),
                      torch.where(m > 0, torch.ones_like(m), torch.full_like(m, 0.1))),
        "Sigmoid": (torch.sigmoid(m), torch.sigmoid(m) * (1 - torch.sigmoid(m))),
        "Tanh": (torch.tanh(m), 1 - torch.tanh(m) ** 2),
        "Softplus": (torch.log1p(torch.exp(m)), torch.sigmoid(m)),
    }
    if name in linearised:
        mean, jcb = linearised[name]
        return mean, jcb**2 * v, jcb
    s = v.sqrt()
    pdf = lambda u: torch.exp(-0.5 * u * u) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = torch.special.ndtr
    if name == "MixtureReLU":
        alpha = m / s
        mean = m * cdf(alpha) + s * pdf(alpha)
        second = (m * m + v) * cdf(alpha) + m * s * pdf(alpha)
        return mean.clamp_min(1e-6), (second - mean**2).clamp_min(1e-6), cdf(alpha)
    lo, hi = (-1 - m) / s, (1 - m) / s  # the clip points in standard units
    inside = cdf(hi) - cdf(lo)
    mean = -cdf(lo) + cdf(-hi) + m * inside + s * (pdf(lo) - pdf(hi))
    second = (cdf(lo) + cdf(-hi) + (m * m + v) * inside + 2 * m * s * (pdf(lo) - pdf(hi))
              + v * (lo * pdf(lo) - hi * pdf(hi)))
    var = second - mean**2
    if name == "MixtureTanh":
        return mean, var.clamp_min(1e-6), inside
    assert name == "MixtureSigmoid"
    return mean / 2 + 0.5, (var / 4).clamp_min(1e-6), inside / 2


# Test error on y = sin(2x) after 100 steps, measured (float64, fixed seeds, deterministic);
# the test allows twice that. Dropping the hidden J in Linear.backward gives 3-16 % of the
# initial error for every activation, which the old bound (25 %) let through.
ERROR_AFTER_100_STEPS = {"ReLU": 0.0036, "MixtureReLU": 0.00043, "Sigmoid": 0.023,
                         "MixtureSigmoid": 0.00016, "Tanh": 0.013, "MixtureTanh": 0.0094,
                         "LeakyReLU": 0.011, "Softplus": 0.144}


@pytest.mark.parametrize("activation", list(ERROR_AFTER_100_STEPS))
def test_every_activation_trains_a_regression(activation):
    """Each activation inside a network (Linear, activation, Linear): the deltas of both
    layers equal a transcription of docs/tagi.md (activation moments and J, output update,
    backward) to 1e-9, and 100 steps on y = sin(2x) bring the test error to within twice its
    measured value. Mutations tried, each failing the delta check: J for J² on δv in
    `Linear.backward` (all but ReLU), Linear dropping the stored J (all; it also fails the
    error bound of all but Softplus), Tanh's J = 1 − tanh, Sigmoid's J = σ."""
    import dptrain.tagi as tagi

    manual_seed(0)
    net = Sequential(Linear(1, 32), getattr(tagi, activation)(), Linear(32, 1), dtype=F64)
    g = gen(40)
    x_test = torch.linspace(-1.5, 1.5, 64, dtype=F64)[:, None]

    def error() -> float:
        return ((net.eval()(x_test)[0] - torch.sin(2 * x_test)) ** 2).mean().item()

    net.train()
    for _ in range(100):
        x = torch.rand(16, 1, generator=g, dtype=F64) * 3 - 1.5
        regression_step(net, x, torch.sin(2 * x), 0.01)
    assert error() < 2 * ERROR_AFTER_100_STEPS[activation]
    # One more batch, from the trained parameters, against the transcription.
    net.train()
    x = torch.rand(16, 1, generator=g, dtype=F64) * 3 - 1.5
    y = torch.sin(2 * x)
    regression_step(net, x, y, 0.01, do_step=False)
    p = {k: v.clone() for k, v in net.state_dict().items()}
    m1 = x @ p["0.mu_w"].T + p["0.mu_b"]
    v1 = (x * x) @ p["0.var_w"].T + p["0.var_b"]
    m_a, v_a, jcb = _activation_closed_form(activation, m1, v1)
    w2, var_w2 = p["2.mu_w"], p["2.var_w"]
    m2 = m_a @ w2.T + p["2.mu_b"]
    v2 = v_a @ (w2**2 + var_w2).T + m_a**2 @ var_w2.T + p["2.var_b"]
    d2, dv2 = (y - m2) / (v2 + 0.01), -1 / (v2 + 0.01)
    d1, dv1 = jcb * (d2 @ w2), jcb**2 * (dv2 @ w2**2)
    want = {}
    for i, (inp, dm, dv) in ((0, (x, d1, dv1)), (2, (m_a, d2, dv2))):
        vw, vb = p[f"{i}.var_w"], p[f"{i}.var_b"]
        want[f"{i}.delta_mu_w"] = vw * (dm.T @ inp)
        want[f"{i}.delta_var_w"] = vw**2 * (dv.T @ inp**2)
        want[f"{i}.delta_mu_b"] = vb * dm.sum(0)
        want[f"{i}.delta_var_b"] = vb**2 * dv.sum(0)
    got = deltas(net)
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-13, msg=name)
