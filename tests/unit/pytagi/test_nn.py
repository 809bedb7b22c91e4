"""dptrain.pytagi.nn keeps pytagi's conventions over the engine (issue 29): flat float32 numpy
in and out, a full batch's var_obs on a short last batch, set_delta_z, LSTM states, the
encoder-decoder hand-over, pytagi's DDPSequential default (average)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dptrain.pytagi as pytagi
from dptrain import tagi
from dptrain.pytagi.nn import (LSTM, DDPConfig, DDPSequential, Linear, OutputUpdater, ReLU,
                               Sequential)


def _pair() -> tuple[Sequential, tagi.Sequential]:
    pytagi.manual_seed(0)
    ours = Sequential(Linear(2, 8), ReLU(), Linear(8, 1))
    engine = tagi.Sequential(tagi.Linear(2, 8), tagi.ReLU(), tagi.Linear(8, 1))
    engine.load_state_dict(ours.model.state_dict())
    return ours, engine


def test_a_step_equals_the_engines_with_flat_arrays_and_a_full_batch_var_obs():
    ours, engine = _pair()
    x, y = np.random.default_rng(0).normal(size=(2, 3, 2)).astype(np.float32), \
        np.arange(3, dtype=np.float32)
    var_full = np.full(5, 0.25, dtype=np.float32)  # the loop's array for a batch of 5
    mu, var = ours(x[0].ravel())
    assert mu.shape == var.shape == (3,) and mu.dtype == np.float32
    OutputUpdater(ours.device).update(ours.output_z_buffer, mu_obs=y, var_obs=var_full,
                                      delta_states=ours.input_delta_z_buffer)
    ours.backward()
    ours.step()
    engine(torch.from_numpy(x[0]))
    tagi.OutputUpdater().update(engine.output_z_buffer, torch.from_numpy(y)[:, None], 0.25,
                                engine.input_delta_z_buffer)
    engine.backward()
    engine.step()
    assert torch.equal(ours.model.flat_params, engine.flat_params)
    np.testing.assert_array_equal(ours.get_outputs()[0], mu)


def test_a_var_obs_shorter_than_the_batch_is_refused():
    ours, _ = _pair()
    ours(np.zeros(6, dtype=np.float32))
    with pytest.raises(ValueError, match=r"var_obs has 2 values, the last forward needs 3"):
        OutputUpdater().update(ours.output_z_buffer, np.zeros(3), np.ones(2),
                               ours.input_delta_z_buffer)


def test_set_delta_z_is_an_update_written_by_hand():
    ours, twin = _pair()[0], _pair()[0]
    y = np.array([0.5, -1.0], dtype=np.float32)
    for net in (ours, twin):
        net(np.ones(4, dtype=np.float32))
    OutputUpdater().update(ours.output_z_buffer, y, np.full(2, 0.1), ours.input_delta_z_buffer)
    delta = ours.input_delta_z_buffer
    twin.set_delta_z(delta.delta_mu.numpy().ravel(), delta.delta_var.numpy().ravel())
    for net in (ours, twin):
        net.backward()
        net.step()
    assert ours.state_dict() == twin.state_dict()


def test_encoder_decoder_hand_over():
    """pytagi's autoencoder loop: decoder(encoder.output_z_buffer), then the decoder's input
    innovations (output_delta_z_buffer) go to the encoder."""
    pytagi.manual_seed(1)
    encoder = Sequential(Linear(3, 4), ReLU(), Linear(4, 2))
    decoder = Sequential(Linear(2, 4), ReLU(), Linear(4, 3))
    x = np.random.default_rng(1).normal(size=6).astype(np.float32)
    encoder(x)
    decoder(encoder.output_z_buffer)
    OutputUpdater().update(decoder.output_z_buffer, x, np.full(6, 0.1),
                           decoder.input_delta_z_buffer)
    decoder.backward()
    decoder.step()
    handed = decoder.output_delta_z_buffer
    assert handed.delta_mu.shape == (2, 2)
    encoder.input_delta_z_buffer.copy_from(handed)  # pytagi's line
    before = encoder.model.flat_params.clone()
    encoder.backward()
    encoder.step()
    assert not torch.equal(before, encoder.model.flat_params)


def test_lstm_states_round_trip():
    pytagi.manual_seed(2)
    net = Sequential(LSTM(1, 3, 2), Linear(6, 1))
    net(np.ones(2, dtype=np.float32))
    states = net.get_lstm_states()
    assert list(states) == [0] and [s.shape for s in states[0]] == [(6,)] * 4
    net.reset_lstm_states()
    net.set_lstm_states(states)
    again = net.get_lstm_states()
    for a, b in zip(states[0], again[0]):
        np.testing.assert_array_equal(a, b)


def test_devices_threads_and_no_ops():
    net, _ = _pair()
    net.preinit_layer()
    threads = torch.get_num_threads()
    try:
        net.set_threads(4096)  # capped at this process's cores
        assert torch.get_num_threads() <= len(__import__("os").sched_getaffinity(0))
    finally:
        torch.set_num_threads(threads)
    net.num_samples = 12
    assert net.num_samples == 12 and net.device == "cpu"
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match=r"to_device\('cuda'\): CUDA is not available "
                                             r"in this process; the network stays on the CPU"):
            net.to_device("cuda")
        assert net.device == "cpu"


def test_ddp_averages_by_default_like_pytagi():
    net = DDPSequential(Sequential(Linear(2, 1)), DDPConfig(backend="gloo"))
    assert net.average is True
    mu, _ = net(np.ones(4, dtype=np.float32))
    assert mu.shape == (2,)
