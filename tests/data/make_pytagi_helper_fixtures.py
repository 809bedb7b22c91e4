#!/usr/bin/env python3
"""Regenerate tests/data/pytagi_helpers.npz with the pytagi 0.2.1 wheel: what its C++ helpers
(`pytagi.Utils`, `HRCSoftmaxMetric`, the MNIST/CIFAR readers) and its `state_dict` return, for
`dptrain.pytagi`'s numpy versions to be checked against (tests/unit/pytagi/test_helpers.py).

Keys: `label_to_obs/<K>/{labels,obs,obs_idx,num_obs}`, `hrc/<K>/{obs,idx,num_obs,len}`,
`one_hot/{labels,out}`, `rolling/<case>/{data,output_col,args,x,y}`, `triu/{args,out}`,
`labels/{ma,sa,pred,prob}`, `obs_to_label_prob/{ma,sa,out}`, `error_rate/{labels,out}`,
`mnist/{images,labels,x,y}` (the bytes of a small idx pair and what the reader returns),
`cifar/{bytes,x,y}`, `state_dict/keys` (one key per line) and `state_dict/<key>/<k>`.

  bash bench/pytagi/setup_pytagi.sh
  LD_LIBRARY_PATH=$(ls -d bench/.venv-pytagi/lib/python3*/site-packages/nvidia/nccl/lib) \
      bench/.venv-pytagi/bin/python tests/data/make_pytagi_helper_fixtures.py
"""
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytagi
from pytagi import HRCSoftmaxMetric, Utils
from pytagi.nn import (AvgPool2d, BatchNorm2d, Conv2d, LayerBlock, LayerNorm, Linear, LSTM,
                       ReLU, ResNetBlock, Sequential)

OUT = Path(__file__).with_name("pytagi_helpers.npz")


def record() -> dict:
    rng = np.random.default_rng(0)
    utils, out = Utils(), {}
    for k in (3, 10, 11):
        labels = rng.integers(0, k, size=7).astype(np.int32)
        obs, idx, num = utils.label_to_obs(labels, k)
        out.update({f"label_to_obs/{k}/labels": labels, f"label_to_obs/{k}/obs": obs,
                    f"label_to_obs/{k}/obs_idx": idx, f"label_to_obs/{k}/num_obs": num})
        h = utils.get_hierarchical_softmax(k)
        out.update({f"hrc/{k}/obs": np.array(h.obs), f"hrc/{k}/idx": np.array(h.idx),
                    f"hrc/{k}/num_obs": h.num_obs, f"hrc/{k}/len": h.len})
    labels = np.array([0, 2, 1, 2], dtype=np.int32)
    out.update({"one_hot/labels": labels, "one_hot/out": np.array(
        utils.label_to_one_hot(labels, 3))})
    cases = {"one_feature": (np.arange(13, dtype=np.float32), [0], 4, 1, 1, 1),
             "stride2": (np.arange(13, dtype=np.float32), [0], 3, 2, 1, 2),
             "two_features": (rng.normal(size=(9, 2)).astype(np.float32), [1], 3, 2, 2, 1)}
    for name, (data, col, i, o, f, s) in cases.items():
        x, y = utils.create_rolling_window(data, np.array(col), i, o, f, s)
        out.update({f"rolling/{name}/data": data, f"rolling/{name}/output_col": np.array(col),
                    f"rolling/{name}/args": np.array([i, o, f, s]), f"rolling/{name}/x": x,
                    f"rolling/{name}/y": y})
    out.update({"triu/args": np.array([2.0, 3.0, 0.5]),
                "triu/out": utils.get_upper_triu_cov(2, 3, 0.5)})
    metric = HRCSoftmaxMetric(10)
    ma = rng.normal(size=3 * 11).astype(np.float32)
    sa = rng.uniform(0.01, 2.0, size=3 * 11).astype(np.float32)
    pred, prob = utils.get_labels(ma, sa, metric.hrc_softmax, 10, 3)
    truth = np.array([pred[0], (pred[1] + 1) % 10, pred[2]])
    out.update({"labels/ma": ma, "labels/sa": sa, "labels/pred": pred, "labels/prob": prob,
                "obs_to_label_prob/out": utils.obs_to_label_prob(ma[:11], sa[:11],
                                                                 metric.hrc_softmax, 10),
                "error_rate/labels": truth, "error_rate/out": metric.error_rate(ma, sa, truth),
                "predicted/out": metric.get_predicted_labels(ma, sa)})
    out.update(_readers(utils, rng))
    out.update(_state_dict())
    return out


def _readers(utils: Utils, rng: np.random.Generator) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        pixels = rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=5, dtype=np.uint8)
        images = struct.pack(">IIII", 2051, 5, 28, 28) + pixels.tobytes()
        label_bytes = struct.pack(">II", 2049, 5) + labels.tobytes()
        Path(tmp, "img").write_bytes(images)
        Path(tmp, "lab").write_bytes(label_bytes)
        x, y = utils.load_mnist_images(f"{tmp}/img", f"{tmp}/lab", 4)
        out.update({"mnist/images": np.frombuffer(images, np.uint8),
                    "mnist/labels": np.frombuffer(label_bytes, np.uint8), "mnist/x": x,
                    "mnist/y": y})
        records = np.concatenate([np.concatenate([[lab], img]) for lab, img in zip(
            rng.integers(0, 10, size=3, dtype=np.uint8),
            rng.integers(0, 256, size=(3, 3072), dtype=np.uint8))]).astype(np.uint8)
        Path(tmp, "cifar").write_bytes(records.tobytes())
        x, y = utils.load_cifar_images(f"{tmp}/cifar", 3)
        out.update({"cifar/bytes": records, "cifar/x": x, "cifar/y": y})
    return out


def _state_dict() -> dict:
    pytagi.manual_seed(1)
    net = Sequential(
        Conv2d(1, 2, 3, padding=1, in_width=4, in_height=4), BatchNorm2d(2), ReLU(),
        ResNetBlock(LayerBlock(Conv2d(2, 2, 3, padding=1), ReLU())), AvgPool2d(2, 2),
        Linear(8, 4), LayerNorm([4]), LSTM(2, 3, 2), Linear(6, 1))
    net.preinit_layer()
    state = net.state_dict()
    out = {"state_dict/keys": np.array("\n".join(state))}
    for key, params in state.items():
        for k, value in enumerate(params):
            out[f"state_dict/{key}/{k}"] = np.asarray(value)
    return out


if __name__ == "__main__":
    np.savez_compressed(OUT, **record())
    print(f"wrote {OUT}")
