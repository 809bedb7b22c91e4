"""Shared oracles for the TAGI unit tests: Monte-Carlo moments with their standard errors, a
seeded generator, small networks and one full training step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dptrain.tagi import HRCSoftmax, OutputUpdater, Sequential, manual_seed

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


@dataclass
class MonteCarlo:
    """Sample mean, variance and J = Cov(A, Z)/v_Z of A = f(Z), each with a standard error."""

    mean: torch.Tensor
    mean_se: torch.Tensor
    var: torch.Tensor
    var_se: torch.Tensor
    jcb: torch.Tensor
    jcb_se: torch.Tensor


def monte_carlo(a: torch.Tensor, z: torch.Tensor) -> MonteCarlo:
    """Moments over dim 0 of samples `a` (n, ...) of A and the matching samples `z` of Z."""
    n = a.shape[0]
    mean = a.mean(0)
    dev = a - mean
    var = (dev * dev).mean(0)
    dz = z - z.mean(0)
    vz = (dz * dz).mean(0)
    cross = dev * dz
    sd = lambda x: x.std(0) / n**0.5  # noqa: E731
    return MonteCarlo(mean, sd(a), var, sd(dev * dev), cross.mean(0) / vz, sd(cross) / vz)


def assert_close_mc(got: torch.Tensor, mc: torch.Tensor, se: torch.Tensor, what: str,
                    k: float = 6.0, atol: float = 1e-9) -> None:
    """|got − mc| ≤ k standard errors (+ atol): fails for any formula error above the noise."""
    err = (got - mc).abs()
    bound = k * se + atol
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"{what}: formula {got.flatten()[worst].item():.6g} vs Monte Carlo "
        f"{mc.flatten()[worst].item():.6g} ± {se.flatten()[worst].item():.2g} (index {worst})")


def hrc_step(net: Sequential, x: torch.Tensor, labels: torch.Tensor, sigma_v: float = 0.05,
             hrc: HRCSoftmax | None = None, do_step: bool = True) -> None:
    """forward, HRC update, backward (and step): one pytagi training iteration."""
    hrc = hrc or HRCSoftmax(10)
    net(x)
    y_obs, y_idx = hrc.encode(labels)
    OutputUpdater(net.device).update_using_indices(net.output_z_buffer, y_obs, sigma_v**2, y_idx,
                                                   net.input_delta_z_buffer)
    net.backward()
    if do_step:
        net.step()


def regression_step(net: Sequential, x: torch.Tensor, y: torch.Tensor, var_obs: float,
                    do_step: bool = True) -> None:
    net(x)
    OutputUpdater(net.device).update(net.output_z_buffer, y, var_obs, net.input_delta_z_buffer)
    net.backward()
    if do_step:
        net.step()


def deltas(net: Sequential) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in net.named_delta_tensors()}


def spread_conv(cls: type, seed: int, c: int, o: int, k: int, **kwargs):
    """A float64 convolution layer `cls` (Conv2d, ConvTranspose2d) with parameters of
    comparable magnitudes in every term of v_Z."""
    manual_seed(seed)
    layer = cls(c, o, k, dtype=F64, **kwargs)
    g = gen(seed + 100)
    layer.mu_w.copy_(torch.randn(layer.mu_w.shape, generator=g, dtype=F64))
    layer.var_w.copy_(0.1 + 0.4 * torch.rand(layer.var_w.shape, generator=g, dtype=F64))
    if layer.bias:
        layer.mu_b.copy_(torch.randn(o, generator=g, dtype=F64))
        layer.var_b.copy_(0.1 + 0.4 * torch.rand(o, generator=g, dtype=F64))
    return layer
