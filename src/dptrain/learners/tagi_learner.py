"""TagiLearner: a TAGI `Sequential` trained data-parallel through `DDPSequential`."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from dptrain.dist import DDPConfig, Runtime
from dptrain.errors import ConfigError
from dptrain.learners.calibration import calibration_sums
from dptrain.learners.protocol import Batch, Metrics
from dptrain.tagi import HRCSoftmax, OutputUpdater, Sequential, split_heteros
from dptrain.tagi.ddp import DDPSequential

_LOG_2PI = math.log(2 * math.pi)


class TagiLearner:
    """Classification through the hierarchical softmax, or regression with observation noise.

    Args:
        model: the network; for classification its output width must be
            `HRCSoftmax(num_classes).num_outputs` (11 for 10 classes).
        sigma_v: observation noise standard deviation σ_v (in normalised target units).
        average: data-parallel mode, see `DDPSequential` (default: sum = large-batch update).
        y_scale: regression only: std of the target normalisation, so that metrics and
            predictions are reported in the data's own units.
        heteroscedastic: regression only: the model ends in `EvenExp` with (mean, noise) output
            pairs and learns the observation noise per input (`update_heteros`); `sigma_v` is
            then unused.

    Metrics (sums and counts): `error` (classification) or `mse` (regression, per target
    element), and `log_likelihood` of the targets under the predictive distribution; for
    regression the share of targets inside the 1σ, 2σ and 3σ predictive intervals
    (`coverage_1sigma`, ...), for classification (evaluation only) the calibration bins of
    `dptrain.learners.calibration`. Train metrics come from the forward pass *before* each
    update.
    """

    def __init__(self, model: Sequential, *, task: Literal["classification", "regression"],
                 num_classes: int | None = None, sigma_v: float = 0.05, average: bool = False,
                 y_scale: torch.Tensor | None = None, heteroscedastic: bool = False) -> None:
        if task not in ("classification", "regression"):
            raise ConfigError(f"task must be 'classification' or 'regression', got {task!r}")
        if heteroscedastic and task != "regression":
            raise ConfigError("heteroscedastic is for regression: it learns the noise of the "
                              "targets")
        if task == "classification" and num_classes is None:
            raise ConfigError("classification needs num_classes")
        if sigma_v <= 0:
            raise ConfigError(f"sigma_v must be > 0, got {sigma_v}")
        self.model, self.task, self.sigma_v, self.average = model, task, sigma_v, average
        self.heteroscedastic = heteroscedastic
        self.hrc = HRCSoftmax(num_classes) if task == "classification" else None
        self.y_scale = None if y_scale is None else torch.as_tensor(y_scale).reshape(-1)
        self.updater = OutputUpdater(model.device)
        self.net: DDPSequential | None = None

    def setup(self, runtime: Runtime) -> None:
        device = runtime.device
        config = DDPConfig(device_ids=[device.index] if device.type == "cuda" else [],
                           backend=runtime.backend or "gloo", rank=runtime.env.rank,
                           world_size=runtime.env.world_size, local_rank=0)
        self.net = DDPSequential(self.model, config, average=self.average)
        if self.y_scale is not None:
            self.y_scale = self.y_scale.to(self.model.device, self.model.dtype)

    def _ddp(self) -> DDPSequential:
        if self.net is None:
            raise RuntimeError("TagiLearner.setup(runtime) must run before training")
        return self.net

    def train_step(self, batch: Batch) -> Metrics:
        net = self._ddp()
        x, y = batch
        net.train()
        mu, var = net(x)
        metrics = self._metrics(mu, var, y)
        noise = self.sigma_v ** 2
        if self.hrc is not None:
            obs, idx = self.hrc.encode(y, dtype=mu.dtype)
            self.updater.update_using_indices(net.output_z_buffer, obs, noise, idx,
                                              net.input_delta_z_buffer)
        elif self.heteroscedastic:
            self.updater.update_heteros(net.output_z_buffer, y.to(mu.dtype),
                                        net.input_delta_z_buffer)
        else:
            self.updater.update(net.output_z_buffer, y.to(mu.dtype), noise,
                                net.input_delta_z_buffer)
        net.backward()
        net.step()
        return metrics

    def eval_step(self, batch: Batch) -> Metrics:
        net = self._ddp()
        x, y = batch
        net.eval()
        mu, var = net(x)
        net.train()
        metrics = self._metrics(mu, var, y)
        if self.hrc is not None:
            metrics.update(calibration_sums(self.hrc.probabilities(mu, var), y))
        return metrics

    def _metrics(self, mu: torch.Tensor, var: torch.Tensor, y: torch.Tensor) -> Metrics:
        n = float(y.shape[0])
        if self.hrc is not None:
            probs = self.hrc.probabilities(mu, var)
            wrong = (probs.argmax(1) != y).sum().item()
            true_p = probs.gather(1, y.long().reshape(-1, 1)).clamp_min(1e-12)
            return {"error": (float(wrong), n), "log_likelihood": (true_p.log().sum().item(), n)}
        y = y.to(mu.dtype)
        mean, epistemic_var, total_var = self._bands(mu, var, y.shape)
        err2 = (y - mean) ** 2
        log_lik = -0.5 * (_LOG_2PI + total_var.log() + err2 / total_var)
        # coverage is unit-free: |y − m| ≤ kσ holds in normalised and in data units alike
        z = (err2 / total_var).sqrt()
        coverage = {f"coverage_{k}sigma": ((z <= k).sum().item(), float(z.numel()))
                    for k in (1, 2, 3)}
        if self.y_scale is not None:  # back to the data's units
            err2 = err2 * self.y_scale ** 2
            log_lik = log_lik - self.y_scale.log()
        return {"mse": (err2.sum().item(), float(err2.numel())),
                "log_likelihood": (log_lik.sum().item(), float(err2.numel())), **coverage}

    def _bands(self, mu: torch.Tensor, var: torch.Tensor, target_shape: torch.Size | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean, epistemic variance, total predictive variance) in normalised units."""
        if not self.heteroscedastic:
            return mu, var, var + self.sigma_v ** 2
        if target_shape is not None and mu.shape[1] != 2 * target_shape[1]:
            raise ConfigError(f"heteroscedastic: the model's output has width {mu.shape[1]}, "
                              f"expected 2 x {target_shape[1]} targets as (mean, noise) pairs "
                              f"(end the model with EvenExp)")
        pred = split_heteros(mu, var)
        return pred.mean, pred.epistemic_var, pred.total_var

    def predict(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Regression: predictive mean and standard deviation (incl. observation noise), in the
        normalised units the model was trained in."""
        mean, _, total_std = self.predict_bands(x)
        return mean, total_std

    def predict_bands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Regression: predictive mean, epistemic standard deviation (the model's uncertainty)
        and total standard deviation (with the observation noise), in normalised units."""
        net = self._ddp()
        net.eval()
        mu, var = net(x)
        net.train()
        mean, epistemic_var, total_var = self._bands(mu, var)
        return mean, epistemic_var.sqrt(), total_var.sqrt()

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])


def tagi_mlp(input_dim: int, output_dim: int, *, hidden: int = 128, num_hidden: int = 2,
             heteroscedastic: bool = False, dtype: torch.dtype = torch.float32) -> Sequential:
    """The built-in TAGI network: `num_hidden` ReLU layers of width `hidden`; with
    `heteroscedastic`, 2 x `output_dim` outputs in (mean, noise) pairs through EvenExp."""
    from dptrain.tagi import EvenExp, Linear, ReLU

    layers: list[Any] = []
    width = input_dim
    for _ in range(num_hidden):
        layers += [Linear(width, hidden), ReLU()]
        width = hidden
    if heteroscedastic:
        return Sequential(*layers, Linear(width, 2 * output_dim), EvenExp(), dtype=dtype)
    return Sequential(*layers, Linear(width, output_dim), dtype=dtype)
