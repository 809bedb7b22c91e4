"""pytagi.metric: regression and classification figures on flat numpy arrays."""

from __future__ import annotations

import numpy as np

from dptrain.pytagi.tagi_utils import Utils


class HRCSoftmaxMetric:
    """Error rate and predicted labels from a hierarchical-softmax output (flat (B·N,) arrays)."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.utils = Utils()
        self.hrc_softmax = self.utils.get_hierarchical_softmax(num_classes)

    def error_rate(self, m_pred: np.ndarray, v_pred: np.ndarray, label: np.ndarray) -> float:
        return classification_error(self.get_predicted_labels(m_pred, v_pred), label)

    def get_predicted_labels(self, m_pred: np.ndarray, v_pred: np.ndarray) -> np.ndarray:
        batch = np.asarray(m_pred).size // self.hrc_softmax.len
        pred, _ = self.utils.get_labels(m_pred, v_pred, self.hrc_softmax, self.num_classes,
                                        batch)
        return pred


def mse(prediction: np.ndarray, observation: np.ndarray) -> float:
    return np.nanmean((prediction - observation) ** 2)


def rmse(prediction: np.ndarray, observation: np.ndarray) -> float:
    return mse(prediction, observation) ** 0.5


def log_likelihood(prediction: np.ndarray, observation: np.ndarray, std: np.ndarray) -> float:
    """Mean Gaussian log density of the observations."""
    log_lik = -0.5 * np.log(2 * np.pi * std**2) - 0.5 * ((observation - prediction) / std) ** 2
    return np.nanmean(log_lik)


def classification_error(prediction: np.ndarray, label: np.ndarray) -> float:
    """Mismatches over the pairs, divided by the number of predictions (pytagi's count)."""
    prediction, label = np.asarray(prediction).ravel(), np.asarray(label).ravel()
    pairs = min(len(prediction), len(label))
    return int(np.count_nonzero(prediction[:pairs] != label[:pairs])) / len(prediction)
