"""Sequential: the properties of docs/tagi.md on whole networks, and the DDP-facing API."""

from __future__ import annotations

import pytest
import torch

from dptrain.tagi import (HRCSoftmax, Linear, MixtureReLU, MixtureTanh, ReLU, Remax, Sequential,
                          Sigmoid, cap_factor, manual_seed)
from dptrain.tagi.base import VAR_FLOOR
from tests.unit.tagi_helpers import F64, deltas, gen, hrc_step, regression_step


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
        capped += int((want.abs() > bar).sum())
        unclipped = (want.abs() <= bar) & ~floored
        torch.testing.assert_close(new[unclipped], old[name][unclipped] + want[unclipped])
    assert capped > 0 or batch == 1  # the test exercises the cap (c(1) = 0.1 rarely binds)


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


def test_input_state_update_gives_input_innovations():
    net = _mlp(F64)
    net.input_state_update = True
    x, labels = _batch(4, dtype=F64)
    hrc_step(net, x, labels, hrc=HRCSoftmax(10), do_step=False)
    assert net.input_delta_x is not None and net.input_delta_x.delta_mu.shape == (4, 6)
    assert bool((net.input_delta_x.delta_var <= 0).all())


def test_package_docstring_example_runs():
    """The usage example in dptrain.tagi's docstring is kept runnable."""
    import textwrap

    import dptrain.tagi

    example = dptrain.tagi.__doc__.split("::", 1)[1].split("\nRegression")[0]
    namespace: dict = {}
    exec(textwrap.dedent(example), namespace)  # noqa: S102
    assert namespace["pred"].shape == (32,) and namespace["mu"].shape == (32, 11)


@pytest.mark.parametrize("activation", ["ReLU", "MixtureReLU", "Sigmoid", "MixtureSigmoid",
                                        "Tanh", "MixtureTanh", "LeakyReLU", "Softplus"])
def test_every_activation_trains_a_regression(activation):
    """Each activation in a network: 100 steps on y = sin(2x) reduce the test error."""
    import dptrain.tagi as tagi

    manual_seed(0)
    net = Sequential(Linear(1, 32), getattr(tagi, activation)(), Linear(32, 1), dtype=F64)
    g = gen(40)
    x_test = torch.linspace(-1.5, 1.5, 64, dtype=F64)[:, None]

    def error() -> float:
        return ((net.eval()(x_test)[0] - torch.sin(2 * x_test)) ** 2).mean().item()

    before = error()
    net.train()
    for _ in range(100):
        x = torch.rand(16, 1, generator=g, dtype=F64) * 3 - 1.5
        regression_step(net, x, torch.sin(2 * x), 0.01)
    assert error() < 0.25 * before
