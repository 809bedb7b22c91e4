"""Parallel: branches on disjoint input columns, outputs side by side. Pinned against the same
network written by hand as one block-diagonal Linear (and an Embedding as a Linear on one-hot
ids), over several training steps, inside a network and first in it."""

from __future__ import annotations

import pytest
import torch

from dptrain.tagi import (Embedding, LayerBlock, Linear, MixtureReLU, Parallel, ReLU,
                          Sequential, manual_seed)
from dptrain.tagi.states import HiddenStates
from tests.unit.tagi.helpers import F64, deltas, gen, regression_step

ACTIVATIONS = {"none": None, "relu": ReLU, "mixture-relu": MixtureReLU}


class BlockDiagonal:
    """A hand-made Linear(Σ I_k, Σ O_k) equal to Linear_k side by side: block k of its weights
    and biases are Linear_k's, every other entry mean 0, variance 0, so it adds nothing to
    any output and gets no delta (Δ = v·g = 0)."""

    def __init__(self, hand: Linear, blocks: list[tuple[str, int, int, int, int]]) -> None:
        self.hand, self.blocks = hand, blocks  # (state_dict prefix, row, col, rows, cols)
        self.live_w = torch.zeros_like(hand.mu_w, dtype=torch.bool)
        self.live_b = torch.zeros_like(hand.mu_b, dtype=torch.bool)
        for _, row, col, rows, cols in blocks:
            self.live_w[row:row + rows, col:col + cols] = True

    def copy_from(self, state: dict[str, torch.Tensor]) -> None:
        for tensor in (self.hand.mu_w, self.hand.var_w, self.hand.mu_b, self.hand.var_b):
            tensor.zero_()
        for prefix, row, col, rows, cols in self.blocks:
            for p in ("mu", "var"):
                weight = state[f"{prefix}.{p}_w"]
                if weight.shape != (rows, cols):  # an Embedding's (K, E) table: Z = Wᵀ onehot
                    weight = weight.t()
                getattr(self.hand, f"{p}_w")[row:row + rows, col:col + cols] = weight
                if f"{prefix}.{p}_b" in state:
                    getattr(self.hand, f"{p}_b")[row:row + rows] = state[f"{prefix}.{p}_b"]
                    self.live_b[row:row + rows] = True

    def keep_dead_entries_inert(self) -> None:
        """The capped step floors a variance of 0 at 1e-5; put the dead entries back to 0."""
        self.hand.var_w[~self.live_w] = 0.0
        self.hand.var_b[~self.live_b] = 0.0

    def assert_equal(self, state: dict[str, torch.Tensor], what: str) -> None:
        for prefix, row, col, rows, cols in self.blocks:
            for p in ("mu", "var"):
                weight = state[f"{prefix}.{p}_w"]
                if weight.shape != (rows, cols):
                    weight = weight.t()
                got = getattr(self.hand, f"{p}_w")[row:row + rows, col:col + cols]
                torch.testing.assert_close(weight, got, rtol=1e-12, atol=1e-14,
                                           msg=f"{what}: {prefix}.{p}_w")
                if f"{prefix}.{p}_b" in state:
                    torch.testing.assert_close(state[f"{prefix}.{p}_b"],
                                               getattr(self.hand, f"{p}_b")[row:row + rows],
                                               rtol=1e-12, atol=1e-14,
                                               msg=f"{what}: {prefix}.{p}_b")


def _copy_layer(layer: Linear, state: dict[str, torch.Tensor], prefix: str) -> None:
    for name, tensor in layer.named_parameter_tensors():
        tensor.copy_(state[f"{prefix}.{name}"])


def _branch(linear: Linear, activation) -> LayerBlock:
    return LayerBlock(linear) if activation is None else LayerBlock(linear, activation())


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_parallel_equals_its_block_diagonal_network(name):
    """Behind a Linear and an activation (so the block's input has variances and a J):
    Parallel(Linear(2, 3)+act, Linear(1, 2)+act) == Linear(3, 5) block-diagonal + act, for the
    outputs, the deltas, the input innovations and three steps of parameters."""
    act = ACTIVATIONS[name]
    manual_seed(0)
    net = Sequential(Linear(3, 3), MixtureReLU(),
                     Parallel(_branch(Linear(2, 3), act), _branch(Linear(1, 2), act),
                              input_sizes=(2, 1)),
                     Linear(5, 2), dtype=F64)
    manual_seed(1)
    tail = [] if act is None else [act()]
    hand = Sequential(Linear(3, 3), MixtureReLU(), Linear(3, 5), *tail, Linear(5, 2), dtype=F64)
    net.input_state_update = hand.input_state_update = True
    state = net.state_dict()
    diagonal = BlockDiagonal(hand.layers[2], [("2.0.0", 0, 0, 3, 2), ("2.1.0", 3, 2, 2, 1)])
    diagonal.copy_from(state)
    _copy_layer(hand.layers[0], state, "0")
    _copy_layer(hand.layers[-1], state, "3")
    g = gen(3)
    for step in range(3):
        x, y = torch.randn(6, 3, generator=g, dtype=F64), torch.randn(6, 2, generator=g, dtype=F64)
        regression_step(net, x, y, 0.1, do_step=False)
        regression_step(hand, x, y, 0.1, do_step=False)
        torch.testing.assert_close(net.output_z_buffer.mu_a, hand.output_z_buffer.mu_a,
                                   rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(net.output_z_buffer.var_a, hand.output_z_buffer.var_a,
                                   rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(net.input_delta_x.delta_mu, hand.input_delta_x.delta_mu,
                                   rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(net.input_delta_x.delta_var, hand.input_delta_x.delta_var,
                                   rtol=1e-12, atol=1e-14)
        got, want = deltas(net), deltas(hand)
        torch.testing.assert_close(got["0.delta_mu_w"], want["0.delta_mu_w"], rtol=1e-12,
                                   atol=1e-14)
        torch.testing.assert_close(got["3.delta_var_w"], want[f"{len(hand.layers) - 1}"
                                                              ".delta_var_w"],
                                   rtol=1e-12, atol=1e-14)
        net.step()
        hand.step()
        diagonal.keep_dead_entries_inert()
        diagonal.assert_equal(net.state_dict(), f"{name}, step {step}")


def test_parallel_routes_ids_to_an_embedding_as_a_linear_on_one_hot_ids():
    """First in the network, on (values, id) inputs: Parallel(Linear(2, 3), Embedding(4, 2)) then
    Linear(5, 1) == Linear(2 + 4, 5) on (values, one-hot id), block-diagonal, then Linear(5, 1):
    a lookup is a Linear of a one-hot vector, exactly, in moments and in deltas."""
    manual_seed(0)
    net = Sequential(Parallel(Linear(2, 3), Embedding(4, 2), input_sizes=(2, 1)), Linear(5, 1),
                     dtype=F64)
    hand = Sequential(Linear(6, 5), Linear(5, 1), dtype=F64)
    diagonal = BlockDiagonal(hand.layers[0], [("0.0.0", 0, 0, 3, 2), ("0.1.0", 3, 2, 2, 4)])
    diagonal.copy_from(net.state_dict())
    _copy_layer(hand.layers[1], net.state_dict(), "1")
    g = gen(4)
    for step in range(3):
        values = torch.randn(7, 2, generator=g, dtype=F64)
        ids = torch.randint(0, 3, (7, 1), generator=g).to(F64)  # id 3 never seen: no delta
        y = torch.randn(7, 1, generator=g, dtype=F64)
        regression_step(net, torch.cat([values, ids], 1), y, 0.2, do_step=False)
        one_hot = torch.nn.functional.one_hot(ids[:, 0].long(), 4).to(F64)
        regression_step(hand, torch.cat([values, one_hot], 1), y, 0.2, do_step=False)
        torch.testing.assert_close(net.output_z_buffer.mu_a, hand.output_z_buffer.mu_a,
                                   rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(net.output_z_buffer.var_a, hand.output_z_buffer.var_a,
                                   rtol=1e-12, atol=1e-14)
        assert bool((net.layers[0].branches[1].layers[0].delta_mu_w[3] == 0).all())
        net.step()
        hand.step()
        diagonal.keep_dead_entries_inert()
        diagonal.assert_equal(net.state_dict(), f"step {step}")


def test_parallel_joins_the_branches_jacobians_and_variances():
    """A branch without J (an Embedding, J = 1) beside one ending in ReLU (a 0/1 mask): the
    joined J is the ReLU's then ones and stays a mask; a deterministic branch adds zeros."""
    manual_seed(0)
    block = Parallel(LayerBlock(Linear(2, 3), ReLU()), Embedding(3, 2), input_sizes=(2, 1))
    Sequential(block, dtype=F64)
    x = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.3, 0.0]], dtype=F64)
    out = block.forward(HiddenStates(x, None))
    relu = block.branches[0].forward(HiddenStates(x[:, :2].contiguous(), None))
    assert out.mu_a.shape == (2, 5) and out.jcb_is_mask
    torch.testing.assert_close(out.jcb, torch.cat([relu.jcb, torch.ones(2, 2, dtype=F64)], 1))
    torch.testing.assert_close(out.mu_a[:, :3], relu.mu_a)
    torch.testing.assert_close(out.mu_a[:, 3:], block.branches[1].layers[0].mu_w[[2, 0]])


def _id_net(seed: int) -> Sequential:
    manual_seed(seed)
    return Sequential(Parallel(LayerBlock(Linear(2, 3), ReLU()), Embedding(3, 2),
                               input_sizes=[2, 1]), Linear(5, 1))


def test_parallel_saves_loads_and_moves_with_its_network(tmp_path):
    """Branch k's layer j is "<i>.<k>.<j>"; save/load gives another network the same
    predictions, and a cast to float64 keeps every branch in the flat buffers."""
    net, other = _id_net(0), _id_net(1)
    assert {"0.0.0.mu_w", "0.0.0.var_b", "0.1.0.mu_w", "1.mu_w"} <= set(net.state_dict())
    x = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.3, 0.0]])
    assert not torch.equal(net(x)[0], other(x)[0])
    net.save(tmp_path / "net.bin")
    other.load(tmp_path / "net.bin")
    assert torch.equal(net(x)[0], other(x)[0])
    other.to(torch.float64)
    regression_step(other, x, torch.ones(2, 1), 0.1)
    assert other.flat_params.dtype == torch.float64
    assert not torch.equal(other.state_dict()["0.1.0.mu_w"].float(),
                           net.state_dict()["0.1.0.mu_w"])  # the embedding row was stepped


def test_parallel_errors_are_one_line():
    """A wrong input width, a missing size and one branch."""
    net = _id_net(0)
    with pytest.raises(ValueError, match=r"layer 0 \(Parallel.*expected input of shape "
                                         r"\(batch, 3\).*got \(4, 4\)"):
        net(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="input_sizes must give a positive int per branch"):
        Parallel(Linear(2, 3), Linear(1, 2), input_sizes=(2,))
    with pytest.raises(ValueError, match="at least 2 branches"):
        Parallel(Linear(2, 3), input_sizes=(2,))
