"""LayerBlock and ResNetBlock: composition of the branches (forward sums, backward adds),
identity and projection shortcuts on flat and image states, nesting, paths, additivity."""

from __future__ import annotations

import pytest
import torch

from dptrain.tagi import (AvgPool2d, BatchNorm2d, Conv2d, LayerBlock, LayerNorm, Linear,
                          MixtureReLU, ReLU, ResNetBlock, Sequential, cap_factor, manual_seed)
from dptrain.tagi.base import VAR_FLOOR
from dptrain.tagi.states import DeltaStates, HiddenStates
from tests.unit.tagi.helpers import F64, deltas, gen, regression_step


def _copy_params(src: Sequential, dst: Sequential, prefix: str) -> None:
    """dst's parameters from src's entries under `prefix` (e.g. "0.main.")."""
    state = {k[len(prefix):]: v for k, v in src.state_dict().items() if k.startswith(prefix)}
    dst.load_state_dict(state)


@pytest.mark.parametrize("projection", [False, True])
def test_resnet_block_is_the_sum_of_its_branches(projection):
    """Forward: means and variances of the branches add; backward: both branches get the
    block's innovations and their input innovations add; the identity passes J ⊙ δ, J² ⊙ δv."""
    manual_seed(0)
    short = LayerBlock(Linear(5, 4)) if projection else None
    block = ResNetBlock(LayerBlock(Linear(5, 6), MixtureReLU(), Linear(6, 5 if not projection
                                                                       else 4)), short)
    net = Sequential(block, dtype=F64)
    manual_seed(1)
    main = Sequential(Linear(5, 6), MixtureReLU(), Linear(6, 5 if not projection else 4),
                      dtype=F64)
    _copy_params(net, main, "0.main.")
    g = gen(2)
    mu, var = torch.randn(7, 5, generator=g, dtype=F64), torch.rand(7, 5, generator=g, dtype=F64)
    jcb = torch.rand(7, 5, generator=g, dtype=F64)
    out = block.forward(HiddenStates(mu, var, jcb))
    main_out = main.forward(HiddenStates(mu, var, jcb))
    width = out.mu_a.shape[1]
    dmu = torch.randn(7, width, generator=g, dtype=F64)
    dvar = -torch.rand(7, width, generator=g, dtype=F64)
    back = block.backward(DeltaStates(dmu, dvar), True)
    main_back = main.backward(DeltaStates(dmu, dvar), True)
    if projection:
        side = Sequential(Linear(5, 4), dtype=F64)
        _copy_params(net, side, "0.short.")
        side_out = side.forward(HiddenStates(mu, var, jcb))
        side_back = side.backward(DeltaStates(dmu, dvar), True)
        s_mu, s_var = side_out.mu_a, side_out.var_a
        b_mu, b_var = side_back.delta_mu, side_back.delta_var
    else:
        s_mu, s_var, b_mu, b_var = mu, var, jcb * dmu, jcb * jcb * dvar
    torch.testing.assert_close(out.mu_a, main_out.mu_a + s_mu, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(out.var_a, main_out.var_a + s_var, rtol=1e-14, atol=1e-15)
    assert out.jcb is None  # no activation after the sum
    torch.testing.assert_close(back.delta_mu, main_back.delta_mu + b_mu, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(back.delta_var, main_back.delta_var + b_var, rtol=1e-14,
                               atol=1e-15)
    for leaf in net.parametric_leaves():  # called as a layer: g → Δ is the owner's job
        leaf.scale_deltas_()
    net_deltas = dict(net.named_delta_tensors())
    for name, value in main.named_delta_tensors():  # main scaled its own (it owns its pack)
        torch.testing.assert_close(net_deltas[f"0.main.{name}"], value, rtol=1e-14, atol=0)


def test_branch_ending_in_an_activation_passes_its_jacobian():
    """A main branch Linear → ReLU: the block multiplies the innovations by the ReLU's J before
    they reach the Linear, exactly what a Linear → ReLU network does with its output update."""
    manual_seed(0)
    net = Sequential(ResNetBlock(LayerBlock(Linear(3, 3), ReLU()), Linear(3, 3)), dtype=F64)
    block = net.layers[0]
    g = gen(3)
    mu = torch.randn(6, 3, generator=g, dtype=F64)
    out_main = block.main.forward(HiddenStates(mu, None, None))
    block.forward(HiddenStates(mu, None, None))
    dmu, dvar = torch.randn(6, 3, generator=g, dtype=F64), -torch.rand(6, 3, generator=g,
                                                                         dtype=F64)
    block.backward(DeltaStates(dmu, dvar), False)
    lin = block.main.layers[0]
    got = lin.delta_mu_w.clone()
    lin.backward(DeltaStates(dmu * out_main.jcb, dvar * out_main.jcb ** 2), False)
    assert torch.equal(got, lin.delta_mu_w)
    assert not torch.equal(out_main.jcb, torch.ones_like(out_main.jcb))  # J matters here


def _resnet(image: bool, bn: bool = False):
    manual_seed(0)
    if image:
        norm = [BatchNorm2d(4)] if bn else []
        inner = ResNetBlock(LayerBlock(Conv2d(4, 4, 3, padding=1), ReLU(),
                                       Conv2d(4, 4, 3, padding=1), *norm))
        return Sequential(
            Conv2d(2, 4, 3, padding=1), ReLU(),
            ResNetBlock(LayerBlock(inner, ReLU(), Conv2d(4, 6, 3, stride=2, padding=1)),
                        Conv2d(4, 6, 1, stride=2)),
            ReLU(), AvgPool2d(3), Linear(6, 3), dtype=F64)
    norm = [LayerNorm(8)] if not bn else [BatchNorm2d(8)]
    inner = ResNetBlock(LayerBlock(Linear(8, 8), MixtureReLU(), Linear(8, 8), *norm))
    return Sequential(Linear(5, 8), ReLU(),
                      ResNetBlock(LayerBlock(inner, ReLU(), Linear(8, 6)), Linear(8, 6)),
                      ReLU(), Linear(6, 3), dtype=F64)


def test_nested_blocks_paths():
    net = _resnet(image=True, bn=True)
    names = [n for n, _ in net.named_parameter_tensors()]
    assert "2.main.0.main.0.mu_w" in names and "2.main.0.main.3.mu_w" in names
    assert "2.main.2.mu_w" in names and "2.short.0.mu_w" in names and "5.mu_w" in names
    assert [n for n, _ in net.named_state_tensors()] == [
        "2.main.0.main.3.mu_ra", "2.main.0.main.3.var_ra", "2.main.0.main.3.num_batches_tracked"]
    assert net.layers[2].main.layers[0].label.startswith("layer 2.main.0 (ResNetBlock(")


@pytest.mark.parametrize("image", [False, True])
def test_nested_resnet_deltas_add_over_batch_splits(image):
    """Without BatchNorm, residual networks (flat and image, nested blocks, projection and
    identity shortcuts, LayerNorm inside) keep batch additivity, the basis of sum-mode DDP."""
    net = _resnet(image)
    g = gen(5)
    x = torch.randn((9, 2, 5, 5) if image else (9, 5), generator=g, dtype=F64)
    y = torch.randn(9, 3, generator=g, dtype=F64)
    regression_step(net, x, y, 0.1, do_step=False)
    whole = deltas(net)
    assert all(bool(v.abs().sum() > 0) for v in whole.values())
    parts = []
    for sl in (slice(0, 4), slice(4, 5), slice(5, 9)):
        regression_step(net, x[sl], y[sl], 0.1, do_step=False)
        parts.append(deltas(net))
    for name, value in whole.items():
        torch.testing.assert_close(sum(p[name] for p in parts), value, rtol=1e-10, atol=1e-15)


def _by_hand_forward(layer, states: HiddenStates, branch_jcb: dict) -> HiddenStates:
    """The composition rules of docs/tagi.md (LayerBlock, ResNetBlock) written out over the
    leaf layers: a block runs its layers in order; a residual block adds the moments of its two
    branches (the identity if no shortcut) and remembers the J each branch ends with."""
    if isinstance(layer, ResNetBlock):
        main = _by_hand_forward(layer.main, states, branch_jcb)
        short = states if layer.short is None else _by_hand_forward(layer.short, states,
                                                                   branch_jcb)
        branch_jcb[id(layer)] = (main.jcb, short.jcb)
        var = [v for v in (main.var_a, short.var_a) if v is not None]
        return HiddenStates(main.mu_a + short.mu_a, sum(var) if var else None, None)
    if isinstance(layer, Sequential):
        for inner in layer.layers:
            states = _by_hand_forward(inner, states, branch_jcb)
        return states
    return layer.forward(states)


def _by_hand_backward(layer, delta: DeltaStates, branch_jcb: dict) -> DeltaStates:
    """Innovations of the layer's input from those of its output: activations are skipped (the
    next layer applies their J), a residual block feeds its innovations, times each branch's
    final J, to both branches and adds what they return."""
    def scaled(d: DeltaStates, jcb) -> DeltaStates:
        return d if jcb is None else DeltaStates(d.delta_mu * jcb, d.delta_var * jcb * jcb)

    if isinstance(layer, ResNetBlock):
        j_main, j_short = branch_jcb[id(layer)]
        main = _by_hand_backward(layer.main, scaled(delta, j_main), branch_jcb)
        short = scaled(delta, j_short)
        if layer.short is not None:
            short = _by_hand_backward(layer.short, short, branch_jcb)
        return DeltaStates(main.delta_mu + short.delta_mu, main.delta_var + short.delta_var)
    if isinstance(layer, Sequential):
        for inner in reversed(layer.layers):
            if not inner.is_activation:
                delta = _by_hand_backward(inner, delta, branch_jcb)
        return delta
    return layer.backward(delta, True)


@pytest.mark.parametrize("image", [False, True])
def test_nested_resnet_steps_every_layer_by_the_rules_and_round_trips(image, tmp_path):
    """A residual block nested in another, BatchNorm inside, flat and image states, three
    training steps. Each step: every delta, however deep, equals the composition rules run by
    hand over a twin's leaf layers (to 1e-12); the step moves every parameter by its capped
    delta, sqrt(v_old)/c(B) (docs/tagi.md, Capped step); in evaluation the nested BatchNorm
    uses its running statistics, so a sample's output does not depend on the rest of the batch.
    Then save/load reproduces parameters, state and outputs exactly.

    Mutations tried, each failing this test: the identity shortcut without the J of the
    block's input, a ResNetBlock backward that drops the shortcut's innovations, and
    `Layer.train` not recursing into children (the nested BatchNorm keeps batch statistics in
    evaluation). The old version checked only that the parameters stayed finite."""
    net = _resnet(image, bn=True)
    twin = _resnet(image, bn=True)
    g = gen(6)
    for _ in range(3):
        x = torch.randn((8, 2, 5, 5) if image else (8, 5), generator=g, dtype=F64)
        y = torch.randn(8, 3, generator=g, dtype=F64)
        twin.load_state_dict(net.state_dict())
        regression_step(net, x, y, 0.1, do_step=False)
        branch_jcb: dict = {}
        out = _by_hand_forward(twin, HiddenStates(x, None), branch_jcb)
        inv_s = 1.0 / (out.var_a + 0.1)
        _by_hand_backward(twin, DeltaStates((y - out.mu_a) * inv_s, -inv_s), branch_jcb)
        for leaf in twin.parametric_leaves():
            leaf.scale_deltas_()
        want = deltas(twin)
        assert all(bool(v.abs().sum() > 0) for v in want.values())  # every layer is reached
        for name, value in deltas(net).items():
            torch.testing.assert_close(value, want[name], rtol=1e-12, atol=1e-15, msg=name)
        before = {k: v.clone() for k, v in net.named_parameter_tensors()}
        net.step()
        for name, value in net.named_parameter_tensors():
            layer, kind = name.rsplit(".", 1)  # e.g. "2.main.0.main.3", "var_w"
            bar = before[f"{layer}.var_{kind[-1]}"].sqrt() / cap_factor(8)
            delta = want[f"{layer}.delta_{kind}"]
            expected = before[name] + torch.maximum(torch.minimum(delta, bar), -bar)
            if kind.startswith("var"):
                expected = torch.where(expected > 0, expected, VAR_FLOOR)
            torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-15, msg=name)
    net.eval()
    x = torch.randn((4, 2, 5, 5) if image else (4, 5), generator=g, dtype=F64)
    torch.testing.assert_close(net(x[:1])[0], net(x)[0][:1], rtol=1e-12, atol=1e-15)
    net.save(str(tmp_path / "r.pt"))
    other = _resnet(image, bn=True)
    other.load(str(tmp_path / "r.pt"))
    assert torch.equal(other.flat_params, net.flat_params)
    assert torch.equal(other.flat_state, net.flat_state)
    other.eval()
    assert torch.equal(net(x)[0], other(x)[0])


def test_shape_mismatch_names_the_block_and_both_shapes():
    net = Sequential(Linear(3, 4), ResNetBlock(LayerBlock(Linear(4, 5))), dtype=F64)
    with pytest.raises(ValueError, match=r"layer 1 \(ResNetBlock\(.*\)\): the main block gives "
                                         r"\(2, 5\), the identity shortcut \(2, 4\)"):
        net(torch.randn(2, 3, dtype=F64))
    with pytest.raises(TypeError, match="main_block must be a dptrain.tagi layer"):
        ResNetBlock("conv")


def test_network_starting_with_a_block_takes_pytagi_flat_inputs():
    manual_seed(0)
    net = Sequential(ResNetBlock(LayerBlock(Conv2d(2, 2, 3, padding=1, in_width=4,
                                                   in_height=4))), Linear(32, 2), dtype=F64)
    x = torch.randn(3, 2, 4, 4, generator=gen(7), dtype=F64)
    assert torch.equal(net(x)[0], net(x.reshape(-1))[0])
