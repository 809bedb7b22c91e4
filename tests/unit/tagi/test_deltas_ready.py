"""Sequential.backward announcing each layer's finished deltas (the hook DDPSequential uses to
start all-reducing them early): same deltas, bit for bit, and the announced columns are the
layer's own."""

from __future__ import annotations

import torch

from dptrain.tagi import (AvgPool2d, BatchNorm2d, Conv2d, LayerBlock, Linear, OutputUpdater,
                          ReLU, ResNetBlock, Sequential, manual_seed)


def _net() -> Sequential:
    manual_seed(3)
    return Sequential(
        Conv2d(2, 4, 3, padding=1), BatchNorm2d(4), ReLU(),
        ResNetBlock(LayerBlock(Conv2d(4, 4, 3, padding=1), BatchNorm2d(4), ReLU())),
        AvgPool2d(5), Linear(4, 6), ReLU(), LayerBlock(Linear(6, 6), ReLU()), Linear(6, 3))


def _backward(net: Sequential, hook=None) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 2, 5, 5, generator=g), torch.randn(4, 3, generator=g)
    net(x)
    OutputUpdater().update(net.output_z_buffer, y, 0.2, net.input_delta_z_buffer)
    net.deltas_ready = hook
    net.backward()
    return net.flat_deltas.clone()


def test_announced_deltas_are_final_and_bitwise_the_same():
    plain = _backward(_net())
    seen: list[tuple[int, torch.Tensor]] = []
    net = _net()
    announced = _backward(net, lambda start: seen.append(
        (start, net.flat_deltas[:, start:].clone())))
    assert torch.equal(announced, plain)
    columns = net.layer_delta_columns()
    parametric = [(s, e) for s, e in columns if e > s]
    # One call per parametric top-level layer, from the output side, with its own start;
    # at each call the columns from there on already hold their final deltas.
    assert [start for start, _ in seen] == [s for s, _ in reversed(parametric)]
    for start, snapshot in seen:
        assert torch.equal(snapshot, plain[:, start:])
    # The columns tile the flat buffer in layer order, a block's leaves together.
    assert columns[0][0] == 0 and columns[-1][1] == net.flat_deltas.shape[1]
    assert all(a[1] == b[0] for a, b in zip(columns, columns[1:]))
    sizes = {name.split(".")[0]: 0 for name, _ in net.named_parameter_tensors()}
    for name, tensor in net.named_parameter_tensors():
        if name.split(".")[-1].startswith("mu_"):
            sizes[name.split(".")[0]] += tensor.numel()
    assert {str(i): e - s for i, (s, e) in enumerate(columns) if e > s} == sizes
