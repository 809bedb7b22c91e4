"""pytagi's `Utils`, `Normalizer`, `exponential_scheduler` and its `HRCSoftmax` record, in numpy.

pytagi implements `Utils` in C++; here each helper is numpy (the label coding comes from
`dptrain.tagi.HRCSoftmax`), with the wheel's dtypes and flat layouts, checked against what the
wheel returns (tests/unit/pytagi/test_helpers.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dptrain.tagi import hrc_softmax as _hrc

MNIST_IMAGES_MAGIC, MNIST_LABELS_MAGIC = 2051, 2049
CIFAR_RECORD = 1 + 3 * 32 * 32  # a label byte, then 3 channel planes of 32x32


class HRCSoftmax:
    """pytagi.nn.HRCSoftmax: the class code tables, flat per class.

    `obs` (K·L,) of ±1, `idx` (K·L,) 1-based output indices, `num_obs` L observations per class,
    `len` the number of network outputs.
    """

    def __init__(self, num_classes: int = 2) -> None:
        self._engine = _hrc.HRCSoftmax(num_classes)
        self.obs: list[float] = self._engine.obs.reshape(-1).tolist()
        self.idx: list[int] = self._engine.idx.reshape(-1).tolist()
        self.num_obs: int = self._engine.num_obs
        self.len: int = self._engine.num_outputs


class Utils:
    """pytagi.Utils: label coding, class probabilities, rolling windows, data readers."""

    def label_to_obs(self, labels: np.ndarray, num_classes: int
                     ) -> tuple[np.ndarray, np.ndarray, int]:
        """(obs (B·L,) float64 ±1, obs_idx (B·L,) int64 1-based output indices, L)."""
        hrc = _hrc.HRCSoftmax(num_classes)
        obs, idx = hrc.encode(torch.as_tensor(np.asarray(labels).astype(np.int64)),
                              dtype=torch.float64)
        return obs.reshape(-1).numpy(), idx.reshape(-1).numpy(), hrc.num_obs

    def label_to_one_hot(self, labels: np.ndarray, num_classes: int) -> np.ndarray:
        """(B·K,) float32."""
        labels = np.asarray(labels).astype(np.int64).ravel()
        _check_labels(labels, num_classes)
        return np.eye(num_classes, dtype=np.float32)[labels].ravel()

    def get_hierarchical_softmax(self, num_classes: int) -> HRCSoftmax:
        return HRCSoftmax(num_classes)

    def get_labels(self, ma: np.ndarray, Sa: np.ndarray, hr_softmax: HRCSoftmax,
                   num_classes: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(pred (B,) int32 most probable class, prob (B·K,) float32 class probabilities) from
        the flat output moments of B samples."""
        prob = self._probabilities(ma, Sa, hr_softmax, batch_size)
        return prob.argmax(1).astype(np.int32), prob.astype(np.float32).ravel()

    def get_errors(self, ma: np.ndarray, Sa: np.ndarray, labels: np.ndarray,
                   hr_softmax: HRCSoftmax, num_classes: int, batch_size: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        """(errors (B,) int32, 1 where the most probable class is not the label; prob (B·K,))."""
        pred, prob = self.get_labels(ma, Sa, hr_softmax, num_classes, batch_size)
        labels = np.asarray(labels).ravel()[:batch_size]
        return (pred != labels).astype(np.int32), prob

    def obs_to_label_prob(self, ma: np.ndarray, Sa: np.ndarray, hr_softmax: HRCSoftmax,
                          num_classes: int) -> np.ndarray:
        """(K,) float64 class probabilities of one sample."""
        return self._probabilities(ma, Sa, hr_softmax, 1)[0].astype(np.float64)

    @staticmethod
    def _probabilities(ma: np.ndarray, Sa: np.ndarray, hr_softmax: HRCSoftmax,
                       batch_size: int) -> np.ndarray:
        width = hr_softmax.len
        ma = np.asarray(ma, dtype=np.float64).ravel()
        Sa = np.asarray(Sa, dtype=np.float64).ravel()
        if ma.size < batch_size * width or Sa.size != ma.size:
            raise ValueError(f"ma and Sa must hold {batch_size} samples x {width} outputs = "
                             f"{batch_size * width} values each, got {ma.size} and {Sa.size}")
        mu = torch.from_numpy(ma[:batch_size * width].reshape(batch_size, width))
        var = torch.from_numpy(Sa[:batch_size * width].reshape(batch_size, width))
        return hr_softmax._engine.probabilities(mu, var).numpy()

    def create_rolling_window(self, data: np.ndarray, output_col: np.ndarray,
                              input_seq_len: int, output_seq_len: int, num_features: int,
                              stride: int) -> tuple[np.ndarray, np.ndarray]:
        """Windows over a series of `num_features` columns: x (n, input_seq_len·F) float32,
        every feature of `input_seq_len` consecutive steps; y (n, output_seq_len·len(
        output_col)) the `output_col` columns of the next `output_seq_len` steps; one window
        every `stride` steps, n = (len(data) - input_seq_len - output_seq_len) // stride + 1."""
        rows = np.asarray(data, dtype=np.float32).reshape(-1, num_features)
        cols = np.asarray(output_col, dtype=np.int64).ravel()
        num = int((len(data) - input_seq_len - output_seq_len) / stride + 1)
        span = input_seq_len + output_seq_len
        if num < 1 or (num - 1) * stride + span > len(rows):
            raise ValueError(f"create_rolling_window: {len(rows)} steps of {num_features} "
                             f"features hold no window of {input_seq_len} + {output_seq_len} "
                             f"steps (data of shape {np.shape(data)})")
        starts = np.arange(num) * stride
        x = rows[starts[:, None] + np.arange(input_seq_len)]  # (n, in, F)
        y = rows[starts[:, None] + input_seq_len + np.arange(output_seq_len)][:, :, cols]
        return x.reshape(num, -1), y.reshape(num, -1)

    def get_upper_triu_cov(self, batch_size: int, num_data: int, sigma: float) -> np.ndarray:
        """The upper triangle (row-major) of σ²·I of size num_data, once per sample."""
        rows, cols = np.triu_indices(num_data)
        block = np.where(rows == cols, float(sigma) ** 2, 0.0)
        return np.tile(block, batch_size)

    def load_mnist_images(self, image_file: str, label_file: str, num_images: int
                          ) -> tuple[np.ndarray, np.ndarray]:
        """The first `num_images` of an MNIST idx pair: images (n·784,) float32 in [0, 1],
        labels (n,) int32. Raises ValueError naming the file for a wrong magic or size."""
        images = _idx(image_file, MNIST_IMAGES_MAGIC, 16, num_images)
        labels = _idx(label_file, MNIST_LABELS_MAGIC, 8, num_images)
        pixels = images[16:].reshape(_count(images), -1)[:num_images]
        return (pixels.astype(np.float32) / 255.0).ravel(), \
            labels[8:8 + num_images].astype(np.int32)

    def load_cifar_images(self, image_file: str, num: int) -> tuple[np.ndarray, np.ndarray]:
        """The first `num` records of a CIFAR-10 binary batch: images (n·3072,) float32 in
        [0, 1], channel planes as stored; labels (n,) int32."""
        raw = np.fromfile(image_file, dtype=np.uint8)
        if raw.size % CIFAR_RECORD or raw.size // CIFAR_RECORD < num:
            raise ValueError(f"{image_file}: {raw.size} bytes is not {num} or more CIFAR-10 "
                             f"records of {CIFAR_RECORD} bytes")
        records = raw.reshape(-1, CIFAR_RECORD)[:num]
        return (records[:, 1:].astype(np.float32) / 255.0).ravel(), \
            records[:, 0].astype(np.int32)


def _idx(path: str, magic: int, header: int, num: int) -> np.ndarray:
    raw = np.fromfile(Path(path), dtype=np.uint8)
    if raw.size < header or int.from_bytes(raw[:4].tobytes(), "big") != magic:
        raise ValueError(f"{path}: not an MNIST idx file (magic {magic} expected)")
    count = _count(raw)
    item = int(np.prod([int.from_bytes(raw[4 * k:4 * k + 4].tobytes(), "big")
                        for k in range(2, header // 4)])) if header > 8 else 1
    if raw.size != header + count * item or count < num:
        raise ValueError(f"{path}: {raw.size} bytes do not hold {count} items of {item} bytes "
                         f"after the header, or fewer than the {num} asked for")
    return raw


def _count(raw: np.ndarray) -> int:
    return int.from_bytes(raw[4:8].tobytes(), "big")


def _check_labels(labels: np.ndarray, num_classes: int) -> None:
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if bad.size:
        raise ValueError(f"labels must be in [0, {num_classes}), got {labels[bad[0]]} at "
                         f"index {bad[0]}")


def exponential_scheduler(curr_v: float, min_v: float, decaying_factor: float,
                          curr_iter: int) -> float:
    """max(curr_v · decaying_factor^curr_iter, min_v), e.g. σ_v decayed per epoch."""
    return np.maximum(curr_v * decaying_factor**curr_iter, min_v)


class Normalizer:
    """Standardisation and min-max scaling of numpy arrays (statistics along axis 0)."""

    EPS = 1e-10  # pytagi's guard against a constant column

    def __init__(self, method: str | None = None) -> None:
        self.method = method

    @staticmethod
    def standardize(data: np.ndarray, mu: np.ndarray, std: np.ndarray) -> np.ndarray:
        return (data - mu) / (std + Normalizer.EPS)

    @staticmethod
    def unstandardize(norm_data: np.ndarray, mu: np.ndarray, std: np.ndarray) -> np.ndarray:
        return norm_data * (std + Normalizer.EPS) + mu

    @staticmethod
    def unstandardize_std(norm_std: np.ndarray, std: np.ndarray) -> np.ndarray:
        return norm_std * (std + Normalizer.EPS)

    def max_min_norm(self, data: np.ndarray, max_value: np.ndarray,
                     min_value: np.ndarray) -> np.ndarray:
        if not np.all(max_value >= min_value):
            raise ValueError("max_min_norm: max_value must be >= min_value everywhere")
        return (data - min_value) / (max_value - min_value + Normalizer.EPS)

    @staticmethod
    def max_min_unnorm(norm_data: np.ndarray, max_value: np.ndarray,
                       min_value: np.ndarray) -> np.ndarray:
        return norm_data * (max_value - min_value + Normalizer.EPS) + min_value

    @staticmethod
    def max_min_unnorm_std(norm_std: np.ndarray, max_value: np.ndarray,
                           min_value: np.ndarray) -> np.ndarray:
        return norm_std * (max_value - min_value + Normalizer.EPS)

    @staticmethod
    def compute_mean_std(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.nanmean(data, axis=0), np.nanstd(data, axis=0)

    @staticmethod
    def compute_max_min(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.nanmax(data, axis=0), np.nanmin(data, axis=0)
