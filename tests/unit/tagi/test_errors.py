"""Bad input fails loudly, naming the layer or argument and the value (docs/design.md, 6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dptrain.errors import CheckpointError
from dptrain.tagi import (HRCSoftmax, Linear, OutputUpdater, ReLU, Sequential, Softplus,
                          manual_seed)
from tests.unit.tagi.helpers import hrc_step


@pytest.fixture
def net() -> Sequential:
    manual_seed(0)
    return Sequential(Linear(4, 8), ReLU(), Linear(8, 11))


def _update(net: Sequential, batch: int) -> None:
    y_obs, y_idx = HRCSoftmax(10).encode(torch.zeros(batch, dtype=torch.long))
    OutputUpdater().update_using_indices(net.output_z_buffer, y_obs, 0.01, y_idx,
                                         net.input_delta_z_buffer)


def test_wrong_input_width_names_the_layer(net):
    with pytest.raises(ValueError, match=r"layer 0 \(Linear\(4, 8.*\(batch, 4\), got \(3, 5\)"):
        net(torch.zeros(3, 5))
    deep = Sequential(Linear(4, 8), ReLU(), Linear(7, 2))
    with pytest.raises(ValueError, match=r"layer 2 \(Linear\(7, 2.*got \(3, 8\)"):
        deep(torch.zeros(3, 4))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_inputs(net, bad):
    x = torch.zeros(3, 4)
    x[2, 1] = bad
    with pytest.raises(ValueError, match=rf"mu_x contains {bad} at index \(2, 1\)"):
        net(x)
    with pytest.raises(ValueError, match=r"var_x contains nan at index \(0, 0\)"):
        net(torch.zeros(3, 4), np.full((3, 4), np.nan))


def test_bad_input_variance_and_shapes(net):
    with pytest.raises(ValueError, match=r"var_x must be >= 0, got min -1"):
        net(torch.zeros(2, 4), -torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"shape of mu_x \(2, 4\), got \(2, 3\)"):
        net(torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"mu_x has shape \(6,\): a flat input must hold whole "
                       r"samples of 4 = 4 values"):
        net(torch.zeros(6))  # (4,) is one flat sample (pytagi's convention), (6,) is none
    with pytest.raises(ValueError, match=r"mu_x must be numeric"):
        net(np.array([["a"] * 4]))


def test_batch_mismatch_between_forward_and_update(net):
    net(torch.zeros(32, 4))
    with pytest.raises(ValueError, match=r"selected_idx has shape \(16, 4\).*batch of 32"):
        _update(net, 16)
    with pytest.raises(ValueError, match=r"mu_obs has shape \(16, 11\).*batch of 32"):
        OutputUpdater().update(net.output_z_buffer, torch.zeros(16, 11), 0.1,
                               net.input_delta_z_buffer)
    with pytest.raises(ValueError, match=r"selected_idx has shape \(5, 3\)"):
        OutputUpdater().update_using_indices(net.output_z_buffer, torch.zeros(5, 3), 0.1,
                                             torch.ones(5, 3, dtype=torch.long),
                                             net.input_delta_z_buffer)


def test_backward_with_delta_from_another_batch(net):
    net(torch.zeros(4, 4))
    net.input_delta_z_buffer.delta_mu = torch.zeros(8, 11)  # innovations of another batch
    net.input_delta_z_buffer.delta_var = torch.zeros(8, 11)
    with pytest.raises(ValueError, match=r"delta_mu has shape \(8, 11\).*output has \(4, 11\)"):
        net.backward()


def test_labels_out_of_range_and_of_wrong_type():
    hrc = HRCSoftmax(10)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\), got 12 at index 2"):
        hrc.encode(torch.tensor([1, 3, 12, 4]))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\), got -1 at index 0"):
        hrc.encode(np.array([-1, 3]))
    with pytest.raises(ValueError, match=r"labels must be integers, got dtype torch.float32"):
        hrc.encode(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"num_classes must be an int >= 2, got 1"):
        HRCSoftmax(1)


def test_bad_indices_and_noise(net):
    net(torch.zeros(2, 4))
    updater = OutputUpdater()
    with pytest.raises(ValueError, match=r"in \[1, 11\], got 12 at sample 1, position 0"):
        updater.update_using_indices(net.output_z_buffer, torch.zeros(2, 1), 0.1,
                                     torch.tensor([[1], [12]]), net.input_delta_z_buffer)
    with pytest.raises(ValueError, match=r"in \[1, 11\], got 0 at sample 0"):
        updater.update_using_indices(net.output_z_buffer, torch.zeros(2, 1), 0.1,
                                     torch.tensor([[0], [1]]), net.input_delta_z_buffer)
    with pytest.raises(ValueError, match=r"selected_idx must hold integers"):
        updater.update_using_indices(net.output_z_buffer, torch.zeros(2, 1), 0.1,
                                     torch.tensor([[1.0], [2.0]]), net.input_delta_z_buffer)
    with pytest.raises(ValueError, match=r"var_obs must be >= 0, got -0.1"):
        updater.update(net.output_z_buffer, torch.zeros(2, 11), -0.1, net.input_delta_z_buffer)
    with pytest.raises(ValueError, match=r"var_obs must be >= 0 everywhere"):
        updater.update(net.output_z_buffer, torch.zeros(2, 11), torch.full((2, 11), float("nan")),
                       net.input_delta_z_buffer)
    with pytest.raises(ValueError, match=r"output_states must be net.output_z_buffer"):
        updater.update(None, torch.zeros(2, 11), 0.1, net.input_delta_z_buffer)


def test_call_order_errors(net):
    with pytest.raises(RuntimeError, match=r"backward\(\) needs forward\(\)"):
        net.backward()
    with pytest.raises(RuntimeError, match=r"step\(\) needs a forward in training mode"):
        net.step()
    net(torch.zeros(2, 4))
    _update(net, 2)
    net.backward()
    net(torch.ones(2, 4))  # a new batch: the old innovations must not be reused silently
    with pytest.raises(RuntimeError, match=r"backward\(\) needs forward\(\) and an OutputUpdater"):
        net.backward()
    net.eval()
    net(torch.zeros(2, 4))
    _update(net, 2)
    with pytest.raises(RuntimeError, match=r"needs the last forward in training mode"):
        net.backward()
    fresh = Sequential(Linear(4, 2))
    fresh.layers[0].training = False  # a layer never run in training mode has nothing stored
    fresh(torch.zeros(1, 4))
    OutputUpdater().update(fresh.output_z_buffer, torch.zeros(1, 2), 0.1,
                           fresh.input_delta_z_buffer)
    with pytest.raises(RuntimeError, match=r"layer 0 .*needs a forward in training mode"):
        fresh.backward()


def test_bad_construction():
    with pytest.raises(ValueError, match=r"input_size must be a positive int, got 0"):
        Linear(0, 3)
    with pytest.raises(ValueError, match=r"init_method must be 'He' or 'Xavier', got 'Kaiming'"):
        Linear(2, 3, init_method="Kaiming")
    with pytest.raises(TypeError, match=r"argument 1 must be a dptrain.tagi layer, got Linear"):
        Sequential(Linear(2, 3), torch.nn.Linear(3, 3))
    layer = Linear(2, 2)
    with pytest.raises(ValueError, match=r"appears twice"):
        Sequential(layer, Softplus(), layer)
    with pytest.raises(ValueError, match=r"dtype must be torch.float32 or torch.float64"):
        Sequential(Linear(2, 2), dtype=torch.int64)


def test_bad_state_dicts_and_files(net, tmp_path):
    state = net.state_dict()
    with pytest.raises(ValueError, match=r"missing keys \['2.var_b'\], unexpected keys \[\]"):
        net.load_state_dict({k: v for k, v in state.items() if k != "2.var_b"})
    with pytest.raises(ValueError, match=r"state_dict\['0.mu_w'\] has shape \(4, 8\).*\(8, 4\)"):
        net.load_state_dict({**state, "0.mu_w": state["0.mu_w"].t()})
    with pytest.raises(ValueError, match=r"state_dict\['0.var_w'\] holds variances <= 0"):
        net.load_state_dict({**state, "0.var_w": torch.zeros(8, 4)})
    before = net.flat_params.clone()
    with pytest.raises(ValueError, match=r"state_dict\['2.mu_b'\] must hold finite"):
        net.load_state_dict({**state, "0.mu_w": state["0.mu_w"] + 1,
                             "2.mu_b": torch.full((11,), float("nan"))})
    assert torch.equal(net.flat_params, before)  # validated completely before any write

    with pytest.raises(CheckpointError, match=r"no such parameter file"):
        net.load(str(tmp_path / "missing.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"not a readable"):
        net.load(str(tmp_path / "junk.pt"))
    torch.save({"anything": 1}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match=r"not a dptrain.tagi.Sequential file"):
        net.load(str(tmp_path / "other.pt"))
    net.save(str(tmp_path / "net.pt"))
    small = Sequential(Linear(4, 8), ReLU(), Linear(8, 10))
    with pytest.raises(CheckpointError, match=r"does not fit.*'2.mu_w'\] has shape \(11, 8\)"):
        small.load(str(tmp_path / "net.pt"))


def test_pickled_code_is_never_executed(net, tmp_path):
    """A file carrying a pickled object that would run code on load is refused."""
    path = tmp_path / "evil.pt"
    marker = tmp_path / "pwned"
    torch.save({"format": "dptrain.tagi.Sequential", "version": 1, "state_dict": {},
                "payload": _Evil(str(marker))}, path)
    with pytest.raises(CheckpointError, match=r"not a readable"):
        net.load(str(path))
    assert not marker.exists()
    hrc_step(net, torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))  # still usable


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
