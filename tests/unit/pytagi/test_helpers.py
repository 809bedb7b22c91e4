"""dptrain.pytagi's numpy versions of pytagi's C++ helpers return what the 0.2.1 wheel returns
(tests/data/make_pytagi_helper_fixtures.py records it), and its `state_dict` has the wheel's
format both ways (issue 29; docs/tutorials/from_pytagi.md)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

import dptrain.pytagi as pytagi
from dptrain.pytagi import HRCSoftmaxMetric, Utils
from dptrain.pytagi.nn import (AvgPool2d, BatchNorm2d, Conv2d, LayerBlock, LayerNorm, Linear,
                               LSTM, ReLU, ResNetBlock, Sequential)

#: Every test here compares what this machine computes with the wheel's outputs recorded on
#: another machine (tests/data/pytagi_helpers.npz): exactly where nothing is rounded (labels,
#: indices, copied windows), else at a tolerance its kernels cannot break: docs/design.md,
#: contract 12.
pytestmark = pytest.mark.recorded

WHEEL = np.load(Path(__file__).parents[2] / "data" / "pytagi_helpers.npz")


@pytest.mark.parametrize("k", [3, 10, 11])
def test_label_coding_and_hrc_tables(k):
    obs, idx, num = Utils().label_to_obs(WHEEL[f"label_to_obs/{k}/labels"], k)
    assert obs.dtype == WHEEL[f"label_to_obs/{k}/obs"].dtype
    np.testing.assert_array_equal(obs, WHEEL[f"label_to_obs/{k}/obs"])
    np.testing.assert_array_equal(idx, WHEEL[f"label_to_obs/{k}/obs_idx"])
    assert num == WHEEL[f"label_to_obs/{k}/num_obs"]
    hrc = Utils().get_hierarchical_softmax(k)
    np.testing.assert_array_equal(hrc.obs, WHEEL[f"hrc/{k}/obs"])
    np.testing.assert_array_equal(hrc.idx, WHEEL[f"hrc/{k}/idx"])
    assert (hrc.num_obs, hrc.len) == (WHEEL[f"hrc/{k}/num_obs"], WHEEL[f"hrc/{k}/len"])


def test_one_hot_and_covariance():
    np.testing.assert_array_equal(Utils().label_to_one_hot(WHEEL["one_hot/labels"], 3),
                                  WHEEL["one_hot/out"])
    batch, num, sigma = WHEEL["triu/args"]
    np.testing.assert_allclose(Utils().get_upper_triu_cov(int(batch), int(num), sigma),
                               WHEEL["triu/out"])


@pytest.mark.parametrize("case", ["one_feature", "stride2", "two_features"])
def test_rolling_windows(case):
    i, o, f, s = (int(v) for v in WHEEL[f"rolling/{case}/args"])
    x, y = Utils().create_rolling_window(WHEEL[f"rolling/{case}/data"],
                                         WHEEL[f"rolling/{case}/output_col"], i, o, f, s)
    assert x.dtype == np.float32 and x.shape == WHEEL[f"rolling/{case}/x"].shape
    np.testing.assert_array_equal(x, WHEEL[f"rolling/{case}/x"])
    np.testing.assert_array_equal(y, WHEEL[f"rolling/{case}/y"])


def test_class_probabilities_labels_and_error_rate():
    ma, sa = WHEEL["labels/ma"], WHEEL["labels/sa"]
    metric = HRCSoftmaxMetric(10)
    pred, prob = Utils().get_labels(ma, sa, metric.hrc_softmax, 10, 3)
    np.testing.assert_array_equal(pred, WHEEL["labels/pred"])
    np.testing.assert_allclose(prob, WHEEL["labels/prob"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(Utils().obs_to_label_prob(ma[:11], sa[:11], metric.hrc_softmax,
                                                         10),
                               WHEEL["obs_to_label_prob/out"], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(metric.get_predicted_labels(ma, sa), WHEEL["predicted/out"])
    assert metric.error_rate(ma, sa, WHEEL["error_rate/labels"]) == \
        pytest.approx(float(WHEEL["error_rate/out"]))


def test_readers(tmp_path):
    (tmp_path / "img").write_bytes(WHEEL["mnist/images"].tobytes())
    (tmp_path / "lab").write_bytes(WHEEL["mnist/labels"].tobytes())
    x, y = Utils().load_mnist_images(str(tmp_path / "img"), str(tmp_path / "lab"), 4)
    assert x.dtype == np.float32 and y.dtype == WHEEL["mnist/y"].dtype
    np.testing.assert_allclose(x, WHEEL["mnist/x"], rtol=1e-6)
    np.testing.assert_array_equal(y, WHEEL["mnist/y"])
    (tmp_path / "cifar").write_bytes(WHEEL["cifar/bytes"].tobytes())
    x, y = Utils().load_cifar_images(str(tmp_path / "cifar"), 3)
    np.testing.assert_allclose(x, WHEEL["cifar/x"], rtol=1e-6)
    np.testing.assert_array_equal(y, WHEEL["cifar/y"])


def test_a_truncated_mnist_file_is_refused_naming_it(tmp_path):
    (tmp_path / "img").write_bytes(struct.pack(">IIII", 2051, 5, 28, 28) + bytes(100))
    (tmp_path / "lab").write_bytes(WHEEL["mnist/labels"].tobytes())
    with pytest.raises(ValueError, match=r"img: 116 bytes do not hold 5 items of 784 bytes"):
        Utils().load_mnist_images(str(tmp_path / "img"), str(tmp_path / "lab"), 4)


def _network() -> Sequential:
    """The network the recorder built (same layers, same order)."""
    return Sequential(
        Conv2d(1, 2, 3, padding=1, in_width=4, in_height=4), BatchNorm2d(2), ReLU(),
        ResNetBlock(LayerBlock(Conv2d(2, 2, 3, padding=1), ReLU())), AvgPool2d(2, 2),
        Linear(8, 4), LayerNorm([4]), LSTM(2, 3, 2), Linear(6, 1))


def test_state_dict_in_the_wheels_format_both_ways():
    keys = str(WHEEL["state_dict/keys"]).split("\n")
    wheel = {key: tuple(WHEEL[f"state_dict/{key}/{k}"].tolist() for k in range(4))
             for key in keys}
    net = _network()
    assert set(net.state_dict()) == set(keys)
    net.load_state_dict(wheel)  # pytagi's parameters into dptrain's network
    ours = net.state_dict()
    for key in keys:
        for k in range(4):
            np.testing.assert_allclose(ours[key][k], wheel[key][k], rtol=1e-6, err_msg=key)
    twin = _network()
    twin.load_state_dict(ours)
    assert twin.state_dict() == ours  # pytagi's own test compares the dicts with ==


def test_a_state_dict_of_another_network_is_refused_naming_the_keys():
    with pytest.raises(ValueError, match=r"missing \['Linear.0'\], unknown \['Linear.9'\]"):
        Sequential(Linear(2, 1)).load_state_dict({"Linear.9": ([0.0] * 2, [1.0] * 2, [0.0],
                                                               [1.0])})


def test_scheduler_normalizer_and_metrics():
    assert pytagi.exponential_scheduler(1.0, 0.3, 0.5, 3) == pytest.approx(0.3)
    assert pytagi.exponential_scheduler(1.0, 0.1, 0.5, 2) == pytest.approx(0.25)
    data = np.array([[1.0, 2.0], [3.0, np.nan]])
    mu, std = pytagi.Normalizer.compute_mean_std(data)
    back = pytagi.Normalizer.unstandardize(pytagi.Normalizer.standardize(data, mu, std), mu, std)
    np.testing.assert_allclose(back, data)
    assert pytagi.metric.mse(np.array([1.0, 2.0]), np.array([1.0, 4.0])) == 2.0
    assert pytagi.metric.classification_error(np.array([1, 2, 3]), np.array([1, 0, 3])) == \
        pytest.approx(1 / 3)
