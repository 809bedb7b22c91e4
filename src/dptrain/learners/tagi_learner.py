"""TagiLearner: a TAGI `Sequential` trained data-parallel through `DDPSequential`."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from dptrain.runtime import DDPConfig, Runtime
from dptrain.errors import ConfigError
from dptrain.data.loader import fetch_batch
from dptrain.learners import calibration, collapse
from dptrain.learners.calibration import calibration_sums, confidence_gap
from dptrain.learners.forecast import forecast_report
from dptrain.learners.plots import plot_regression_band
from dptrain.learners.protocol import Batch, Metrics
from dptrain.learners.series_metrics import pop_series_nrmse, series_sums
from dptrain.learners.window_scaling import WindowScaling, WindowStats
from dptrain.tagi import BatchNorm2d, HRCSoftmax, OutputUpdater, Sequential, native, split_heteros
from dptrain.tagi.ddp import DDPSequential
from dptrain.tagi.compiled import CompiledStep
from dptrain.tagi.hrc_softmax import LINKS, Link

if TYPE_CHECKING:
    from dptrain.data import Split

log = logging.getLogger(__name__)

_LOG_2PI = math.log(2 * math.pi)


def check_sigma_v_schedule(sigma_v: float, sigma_v_min: float, sigma_v_decay: float) -> None:
    """σ_v > 0, a floor >= 0 and a decay in (0, 1]; the one check of them, for the learner and
    for `LearnerConfig`."""
    if sigma_v <= 0:
        raise ConfigError(f"sigma-v must be > 0, got {sigma_v}")
    if sigma_v_min < 0 or not 0 < sigma_v_decay <= 1:
        raise ConfigError(f"sigma-v-min must be >= 0 and sigma-v-decay in (0, 1], got "
                          f"{sigma_v_min} and {sigma_v_decay}")


class TagiLearner:
    """Classification through the hierarchical softmax, or regression with observation noise.

    Args:
        model: the network; for classification its output width must be
            `HRCSoftmax(num_classes).num_outputs` (11 for 10 classes).
        sigma_v: observation noise standard deviation σ_v (in normalised target units) of the
            first epoch.
        sigma_v_min, sigma_v_decay: the σ_v schedule: at epoch e (counted from 0, set by
            `set_epoch`) σ_v is max(sigma_v_min, sigma_v · sigma_v_decay^e). pytagi's examples
            feed the running σ_v back into `exponential_scheduler(curr_v, min_v, decay,
            curr_iter=epoch)`, which compounds to decay^(e(e+1)/2); to follow such a loop
            exactly, pass the σ_v it reaches at each epoch to `set_sigma_v`.
        average: data-parallel mode, see `DDPSequential` (default: sum = large-batch update).
            Average mode divides by the world size the run started on, also after a resume on
            another one (`average_over`, kept in the state; docs/tagi.md, Data-parallel TAGI).
        y_scale: regression only: std of the target normalisation, so that metrics and
            predictions are reported in the data's own units.
        heteroscedastic: regression only: the model ends in `EvenExp` with (mean, noise) output
            pairs and learns the observation noise per input (`update_heteros`); `sigma_v` is
            then unused.
        stop_on_collapse: raise `TrainingCollapsed` after the evaluation that finds the run
            collapsed (`dptrain.learners.collapse`) instead of warning and going on.
        hrc_link: classification only: how the hierarchical softmax turns output moments into
            class probabilities (`HRCSoftmax`'s `link`, docs/tagi.md, Calibration): "mean" (for
            noisy labels), "probit" (pytagi's, for clean ones) or "auto" (the default): after
            each training epoch, the link whose mean confidence is nearer the validation
            accuracy (`end_evaluation` of the "val" part); in a run without a validation part,
            the one under which that epoch's training labels were likelier, each scored by the
            forward pass before its update; pytagi's probit until the first epoch ends. It
            changes no update, only the probabilities, and with them the predicted class.
        per_position: classification only: the targets are one class per position of the
            input window (a language model's next tokens): (B, T) labels for a (B, T·N) output,
            position t's N outputs at columns [t·N, (t+1)·N), each position observed, scored
            and calibrated as a sample of its own (`encode_positions`).

    Metrics (sums and counts): `error` (classification) or `mse` (regression, per target
    element), and `log_likelihood` of the targets under the predictive distribution; for
    regression the share of targets inside the 1σ, 2σ and 3σ predictive intervals
    (`coverage_1sigma`, ...), for classification (evaluation only) the calibration bins of
    `dptrain.learners.calibration`; on the validation windows of several time series (a
    batch with `series`) also `series_nrmse`, the per-series-balanced RMSE of
    `dptrain.learners.series_metrics`. Train metrics come from the forward pass *before* each
    update. Each evaluation also checks whether the run has collapsed (its predictions no
    longer depend on the input): the first time, one warning line, and `collapse` in the
    report (None for a healthy run).
    """

    eval_is_collective = False
    """Evaluation is a forward of this rank's replica alone."""

    def __init__(self, model: Sequential, *, task: Literal["classification", "regression"],
                 num_classes: int | None = None, sigma_v: float = 0.05,
                 sigma_v_min: float = 0.0, sigma_v_decay: float = 1.0, average: bool = False,
                 y_scale: torch.Tensor | None = None, heteroscedastic: bool = False,
                 stop_on_collapse: bool = False, hrc_link: Link | Literal["auto"] = "auto",
                 compile: bool | Literal["auto"] = False,
                 window_scaling: WindowScaling | None = None, per_position: bool = False) -> None:
        if task not in ("classification", "regression"):
            raise ConfigError(f"task must be 'classification' or 'regression', got {task!r}")
        if heteroscedastic and task != "regression":
            raise ConfigError("heteroscedastic is for regression: it learns the noise of the "
                              "targets")
        if task == "classification" and num_classes is None:
            raise ConfigError("classification needs num_classes")
        if per_position and task != "classification":
            raise ConfigError("per_position: one class per position is classification, not "
                              "regression")
        self.per_position = per_position
        check_sigma_v_schedule(sigma_v, sigma_v_min, sigma_v_decay)
        self.model, self.task, self.sigma_v, self.average = model, task, sigma_v, average
        self.schedule = {"sigma_v": sigma_v, "sigma_v_min": sigma_v_min,
                         "sigma_v_decay": sigma_v_decay}
        self.epoch = 0
        self.heteroscedastic = heteroscedastic
        if hrc_link not in ("auto", *LINKS):
            raise ConfigError(f"hrc-link must be auto, {' or '.join(LINKS)}, got {hrc_link!r}")
        self.hrc_link = hrc_link
        self.hrc: HRCSoftmax | None = None
        """The decoder in use (its `link`: the chosen one when `hrc_link` is auto)."""
        if task == "classification":
            self._decoders = {link: HRCSoftmax(num_classes, link=link) for link in LINKS}
            self.hrc = self._decoders["probit" if hrc_link == "auto" else hrc_link]
        self.y_scale = None if y_scale is None else torch.as_tensor(y_scale).reshape(-1)
        self.updater = OutputUpdater(model.device)
        self.net: DDPSequential | None = None
        self.average_over: int | None = None
        """Average mode's N: the world size of `setup`, or the run's from `load_state_dict`."""
        self.calibration: list[dict[str, float]] | None = None  # of the last evaluation
        self._train_scores: dict[str, float] | None = None
        """Each link's log-likelihood of the last epoch's training labels, until an evaluation
        has used or passed them over (`_choose_link`)."""
        self.stop_on_collapse = stop_on_collapse
        self.compile = compile
        self.compiled: CompiledStep | None = None
        """`compile`'s training step (`DDPSequential.compile`), made by `setup`."""
        self.collapse: dict[str, Any] | None = None
        """The first evaluation's collapse record (`dptrain.learners.collapse.verdict`)."""
        if window_scaling is not None and task != "regression":
            raise ConfigError("window scaling is for time series (regression): it scales a "
                              "window's values and the targets that follow them")
        self.window_scaling = window_scaling

    def setup(self, runtime: Runtime) -> None:
        device = runtime.device
        config = DDPConfig(device_ids=[device.index] if device.type == "cuda" else [],
                           backend=runtime.backend or "gloo", rank=runtime.env.rank,
                           world_size=runtime.env.world_size, local_rank=0)
        self.net = DDPSequential(self.model, config, average=self.average,
                                 average_over=self.average_over)
        self.average_over = self.net.average_over
        update = "indices" if self.hrc else "heteros" if self.heteroscedastic else "plain"
        if self.compile == "auto":  # the native step where it applies, else eager
            why = native.not_native(self.model, update)
            if why is None:
                self.compiled = self.net.compile(update, native=True)
            else:
                log.debug("compile auto: eager steps (%s)", why)
        elif self.compile:
            self.compiled = self.net.compile(update)
        if self.y_scale is not None:
            self.y_scale = self.y_scale.to(self.model.device, self.model.dtype)

    @property
    def uneven_last_batch(self) -> bool:
        """True unless average mode meets BatchNorm. Sum mode's step is that of the global
        batch however it is split (additive deltas, BatchNorm statistics of the global batch),
        and so is average mode's without BatchNorm (1/N of it); average mode normalises each
        rank's shard with its own statistics (pytagi), which an empty shard does not have."""
        return not (self.average and self._has_batchnorm())

    def _has_batchnorm(self) -> bool:
        return any(isinstance(layer, BatchNorm2d) for layer in self.model.descendants())

    def sigma_v_at(self, epoch: int) -> float:
        """σ_v of epoch `epoch` (from 0): max(σ_v_min, σ_v · decay^epoch)."""
        s = self.schedule
        return max(s["sigma_v_min"], s["sigma_v"] * s["sigma_v_decay"] ** epoch)

    def step_scalars(self) -> dict[str, float]:
        """TAGI has no learning rate; σ_v changes per epoch and is in the run's record."""
        return {}

    def set_epoch(self, epoch: int) -> None:
        """Called by the Trainer before each epoch: σ_v follows the schedule."""
        self.epoch = epoch
        self.sigma_v = self.sigma_v_at(epoch)

    def set_sigma_v(self, sigma_v: float) -> None:
        check_sigma_v_schedule(sigma_v, 0.0, 1.0)
        self.sigma_v = sigma_v

    def _ddp(self) -> DDPSequential:
        if self.net is None:
            raise RuntimeError("TagiLearner.setup(runtime) must run before training")
        return self.net

    def _scaled(self, x: torch.Tensor, y: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, WindowStats | None]:
        """The network's input and target: each window in its own units under window
        scaling (`dptrain.learners.window_scaling`), the batch's as they are otherwise."""
        if self.window_scaling is None:
            return x, y, None
        stats = self.window_scaling.stats(x)
        x = self.window_scaling.inputs(x, None, stats)[0]
        return x, None if y is None else self.window_scaling.targets(y, stats), stats

    def train_step(self, batch: Batch) -> Metrics:
        net = self._ddp()
        x, y = batch
        net.train()
        x, target, stats = self._scaled(x, y)
        if self.compiled is not None:
            return self._compiled_step(x, target, y, stats)
        mu, var = net(x)
        metrics = self._metrics(mu, var, y, stats)
        if self.hrc is not None and self.hrc_link == "auto":
            metrics.update(_link_scores(self._decoders, mu, var, y, self.per_position))
        noise = self.sigma_v ** 2
        if self.hrc is not None:
            obs, idx = self._encode(y, mu.dtype)
            self.updater.update_using_indices(net.output_z_buffer, obs, noise, idx,
                                              net.input_delta_z_buffer)
        elif self.heteroscedastic:
            self.updater.update_heteros(net.output_z_buffer, target.to(mu.dtype),
                                        net.input_delta_z_buffer)
        else:
            self.updater.update(net.output_z_buffer, target.to(mu.dtype), noise,
                                net.input_delta_z_buffer)
        net.backward()
        net.step()
        return metrics

    def end_training(self, means: dict[str, float]) -> dict[str, float]:
        """Takes out the links' training scores: with `hrc_link` auto and no validation part,
        the epoch's first evaluation chooses the link from them (`end_evaluation`)."""
        scores = {link: means.pop(f"{_LINK_PREFIX}{link}", math.nan) for link in LINKS}
        self._train_scores = scores if self.hrc is not None and self.hrc_link == "auto" else None
        return means

    def _compiled_step(self, x: torch.Tensor, target: torch.Tensor, y: torch.Tensor,
                       stats: WindowStats | None) -> Metrics:
        """`train_step` as one compiled call: the same update, the same metrics."""
        assert self.compiled is not None
        dtype, noise = self.model.dtype, self.sigma_v ** 2
        if self.hrc is not None:
            obs, idx = self._encode(y, dtype)
            mu, var = self.compiled(x, obs, noise, idx)
        else:
            mu, var = self.compiled(x, target.to(dtype), noise)
        metrics = self._metrics(mu, var, y, stats)
        if self.hrc is not None and self.hrc_link == "auto":
            metrics.update(_link_scores(self._decoders, mu, var, y, self.per_position))
        return metrics

    def _encode(self, y: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The hierarchical softmax's observations and their 1-based output indices for the
        labels: per position (`per_position`), or one per sample."""
        assert self.hrc is not None
        if self.per_position:
            return encode_positions(self.hrc, y, dtype)
        return self.hrc.encode(y, dtype=dtype)

    def eval_step(self, batch: Batch) -> Metrics:
        net = self._ddp()
        x, y = batch
        x, _, stats = self._scaled(x)
        if self.compiled is not None:  # the native library's forward where it steps natively
            mu, var = self.compiled.predict(x)
        else:
            net.eval()
            mu, var = net(x)
            net.train()
        if self.hrc is None:
            metrics = self._metrics(mu, var, y, stats)
            metrics.update(self._series_sums(mu, var, y, getattr(batch, "series", None),
                                             stats))
        else:
            metrics = _class_metrics(self.hrc, mu, var, y, self.per_position)
            if self.hrc_link == "auto":  # and the other link's: `end_evaluation` chooses
                metrics.update({f"{_EVAL_LINK_PREFIX}{link}:{name}": value
                                for link, hrc in self._decoders.items() if hrc is not self.hrc
                                for name, value in
                                _class_metrics(hrc, mu, var, y, self.per_position).items()})
        metrics.update(collapse.output_sums(self._bands(mu, var, stats=stats)[0]))
        return metrics

    def _metrics(self, mu: torch.Tensor, var: torch.Tensor, y: torch.Tensor,
                 stats: WindowStats | None = None) -> Metrics:
        if self.hrc is not None:
            return _class_scores(self.hrc, mu, var, y, self.per_position)[2]
        y = y.to(mu.dtype)
        mean, epistemic_var, total_var = self._bands(mu, var, y.shape, stats)
        # a missing target (NaN, in time series) counts nowhere, as it updates nothing
        seen = torch.isfinite(y)
        count = float(seen.sum().item())
        err2 = torch.where(seen, (y - mean) ** 2, 0.0)
        log_lik = -0.5 * (_LOG_2PI + total_var.log() + err2 / total_var)
        # coverage is unit-free: |y − m| ≤ kσ holds in normalised and in data units alike
        z = (err2 / total_var).sqrt()
        coverage = {f"coverage_{k}sigma": ((seen & (z <= k)).sum().item(), count)
                    for k in (1, 2, 3)}
        if self.y_scale is not None:  # back to the data's units
            err2 = err2 * self.y_scale ** 2
            log_lik = log_lik - self.y_scale.log()
        return {"mse": (err2.sum().item(), count),
                "log_likelihood": (torch.where(seen, log_lik, 0.0).sum().item(), count),
                **coverage}

    def _series_sums(self, mu: torch.Tensor, var: torch.Tensor, y: torch.Tensor,
                     series: torch.Tensor | None, stats: WindowStats | None) -> Metrics:
        """Squared errors per series, in each series' standard units, and the targets inside
        their ±2σ intervals (`series_metrics`)."""
        if series is None:
            return {}
        y = y.to(mu.dtype)
        mean, _, total_var = self._bands(mu, var, y.shape, stats)
        seen = torch.isfinite(y)
        err2 = torch.where(seen, (y - mean) ** 2, 0.0)
        return series_sums(err2, seen, series, inside=err2 <= 4 * total_var)

    def _bands(self, mu: torch.Tensor, var: torch.Tensor, target_shape: torch.Size | None = None,
               stats: WindowStats | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean, epistemic variance, total predictive variance) in normalised units: a
        window-scaled network's back in its series' units (`stats` of its inputs)."""
        if not self.heteroscedastic:
            mean, epistemic_var, total_var = mu, var, var + self.sigma_v ** 2
        elif target_shape is not None and mu.shape[1] != 2 * target_shape[1]:
            raise ConfigError(f"heteroscedastic: the model's output has width {mu.shape[1]}, "
                              f"expected 2 x {target_shape[1]} targets as (mean, noise) pairs "
                              f"(end the model with EvenExp)")
        else:
            pred = split_heteros(mu, var)
            mean, epistemic_var, total_var = pred.mean, pred.epistemic_var, pred.total_var
        if stats is None:
            return mean, epistemic_var, total_var
        mean, epistemic_var = WindowScaling.outputs(mean, epistemic_var, stats)
        return mean, epistemic_var, WindowScaling.outputs(mean, total_var, stats)[1]

    def predict(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Regression: predictive mean and standard deviation (incl. observation noise), in the
        normalised units the model was trained in."""
        mean, _, total_std = self.predict_bands(x)
        return mean, total_std

    def predict_bands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Regression: predictive mean, epistemic standard deviation (the model's uncertainty)
        and total standard deviation (with the observation noise), in normalised units."""
        net = self._ddp()
        x, _, stats = self._scaled(x)
        net.eval()
        mu, var = net(x)
        net.train()
        mean, epistemic_var, total_var = self._bands(mu, var, stats=stats)
        return mean, epistemic_var.sqrt(), total_var.sqrt()

    @torch.no_grad()
    def predict_moments(self, mu_x: torch.Tensor, var_x: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Regression: predictive mean and total variance (with the observation noise) for
        inputs with variances (a forecast feeding its predictions back), normalised units."""
        net = self._ddp()
        stats = None
        if self.window_scaling is not None:
            stats = self.window_scaling.stats(mu_x)
            mu_x, var_x = self.window_scaling.inputs(mu_x, var_x, stats)
        net.eval()
        mu, var = net(mu_x.to(self.model.device, self.model.dtype),
                      var_x.to(self.model.device, self.model.dtype))
        net.train()
        mean, _, total_var = self._bands(mu, var, stats=stats)
        return mean, total_var

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(),
                "sigma_v": {**self.schedule, "epoch": self.epoch, "current": self.sigma_v},
                "average_over": self.average_over,
                "hrc_link": None if self.hrc is None else self.hrc.link}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        saved = state.get("sigma_v")
        if saved is not None:  # the run's schedule continues where it was
            self.schedule = {k: saved[k] for k in ("sigma_v", "sigma_v_min", "sigma_v_decay")}
            self.epoch, self.sigma_v = saved["epoch"], saved["current"]
        self._restore_average_over(state.get("average_over"))
        if self.hrc is not None and state.get("hrc_link") in LINKS:  # the link chosen so far
            self.hrc = self._decoders[state["hrc_link"]]

    def _restore_average_over(self, saved: int | None) -> None:
        """Average mode continues dividing by the world size the run started on."""
        if saved is None:  # saved before setup, or by an older version: this world's
            return
        self.average_over = saved
        if self.net is None:
            return
        self.net.average_over = saved
        if self.average and saved != self.net.world_size and self._has_batchnorm():
            log.warning("average mode resumed on %d rank(s), started on %d: the deltas are "
                        "still averaged over %d, but BatchNorm's local statistics now come "
                        "from the new shards, so the steps differ from the %d-rank run's",
                        self.net.world_size, saved, saved, saved)


    # -- the Trainer's hooks ------------------------------------------------------------------

    def end_evaluation(self, means: dict[str, float], part: str = "test") -> dict[str, float]:
        """With `hrc_link` auto, the link is chosen here: from the validation evaluation's
        labels, or, in a run without a validation part, from the epoch's training labels at its
        first evaluation; the evaluation reports the metrics under the link chosen."""
        if self.hrc is not None and self.hrc_link == "auto":
            means = self._choose_link(means, part)
        means, self.calibration = calibration.end_evaluation(means)
        means = pop_series_nrmse(means, part)
        spread = collapse.pop_output_spread(means)
        top_share = _pop_top_class_share(means)
        if self.collapse is None:  # named once, at the first evaluation that finds it
            self.collapse = collapse.verdict(spread, self.epoch + 1, top_share)
            if self.collapse is not None:
                collapse.check(self.collapse, self.stop_on_collapse)
                log.warning(collapse.message(self.collapse))
        return means

    def _choose_link(self, means: dict[str, float], part: str) -> dict[str, float]:
        """`eval_step`'s metrics under each link split apart; those of the link chosen stay.

        The validation part ("val") chooses the link whose mean confidence is nearer its
        accuracy there; a run without one, the link under which the epoch's training labels
        were likelier (at the epoch's first evaluation, before any test one reports). The same
        on every rank: the means are over all of them; a tie keeps the probit link. Why the
        confidence gap and not the validation log-likelihood: a validation part of a few
        hundred samples leaves the likelihood to a few labels the mean link gives a
        probability near 0 (docs/tagi.md, Calibration)."""
        per_link: dict[str, dict[str, float]] = {link: {} for link in LINKS}
        rest = {}
        for name, value in means.items():
            link, _, metric = name.removeprefix(_EVAL_LINK_PREFIX).partition(":")
            if name.startswith(_EVAL_LINK_PREFIX) and link in per_link:
                per_link[link][metric] = value
            else:
                rest[name] = value
        # The link in use reported its metrics under their own names, the other one prefixed.
        other = next(iter(m for link, m in per_link.items() if link != self.hrc.link))
        per_link[self.hrc.link] = {name: rest.pop(name) for name in other if name in rest}
        scores = None
        if part == "val":
            scores = {link: -confidence_gap(per_link[link]) for link in LINKS}
        elif self._train_scores is not None:
            scores = self._train_scores
        self._train_scores = None  # the training labels choose once, and only without "val"
        if scores is not None and all(math.isfinite(v) for v in scores.values()):
            self.hrc = self._decoders[max(LINKS, key=lambda link: (scores[link], link))]
        return {**per_link[self.hrc.link], **rest}

    def save_checkpoint(self, directory: Path, *, background: bool = False) -> dict[str, Any]:
        """Rank 0's state file holds it all (replicas are identical): no files of its own."""
        return self.state_dict()

    def checkpoint_written(self) -> None:
        """Nothing to wait for: this learner writes no files of its own."""

    def load_checkpoint(self, state: dict[str, Any], directory: Path) -> None:
        self.load_state_dict(state)

    @property
    def run_record(self) -> dict[str, Any]:
        return {"sharded_checkpoint": False}

    def flops_per_token(self) -> tuple[float, torch.dtype] | None:
        """TAGI networks declare no FLOPs per token."""
        return None

    def report(self, out_dir: Path | None, split: Split) -> dict[str, Any]:
        """The calibration bins (classification), a time series' forecast metrics
        (`forecast_*`: dptrain.learners.forecast); rank 0 draws reliability.png, forecast.png,
        and for 1-D regression predictions.png: the predictive mean with its epistemic ±2σ
        band inside the total one (with the observation noise), in the data's own units."""
        summary = {**calibration.report(out_dir, self.calibration), "collapse": self.collapse}
        if self.hrc is not None:
            summary["hrc_link"] = self.hrc.link
        if split.series is not None:
            summary.update(forecast_report(self.predict_moments, split.series, out_dir))
        if out_dir is not None and self.task == "regression" and split.input_shape == (1,):
            self._plot_bands(out_dir / "predictions.png", split)
        return summary

    def _plot_bands(self, path: Path, split: Split) -> None:
        (x_train, y_train), (x_test, y_test) = (
            fetch_batch(part, 0, torch.arange(len(part))) for part in (split.train, split.test))
        mean, epistemic_std, total_std = (
            t.cpu() for t in self.predict_bands(x_test.to(self.model.device, self.model.dtype)))
        x_of = split.x_norm.invert if split.x_norm is not None else (lambda t: t)
        y_of = split.y_norm.invert if split.y_norm is not None else (lambda t: t)
        y_std = split.y_norm.std if split.y_norm is not None else 1.0
        plot_regression_band(path, x_of(x_train), y_of(y_train), x_of(x_test), y_of(y_test),
                             y_of(mean), epistemic_std * y_std, total_std * y_std)


_CLASS_PREFIX = "pred_class"
_LINK_PREFIX = "_hrc_link_log_likelihood_"
"""Train metrics for `end_training` alone (the leading "_": not shown by the progress bar)."""
_EVAL_LINK_PREFIX = "_hrc_link_"
"""With `hrc_link` auto, `eval_step`'s metrics under the link not in use, as
`_hrc_link_{link}:{name}`."""


def encode_positions(hrc: HRCSoftmax, labels: torch.Tensor, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`hrc.encode` of a language model's (B, T) next tokens for its (B, T·N) output,
    position t's N outputs at columns [t·N, (t+1)·N): (B, T·L) observations and 1-based
    indices into the whole row, so the update sees one sample per row."""
    if labels.dim() != 2:
        raise ValueError(f"encode_positions: labels (batch, positions) expected, got shape "
                         f"{tuple(labels.shape)}")
    if labels.numel() and labels.min().item() < 0:
        raise ValueError("a TAGI language model observes every position: targets below 0 "
                         "(ignored positions, -100) are not supported")
    batch, steps = labels.shape
    obs, idx = hrc.encode(labels.reshape(-1), dtype=dtype)  # (B·T, L)
    offsets = torch.arange(steps, device=idx.device).repeat(batch) * hrc.num_outputs
    return obs.reshape(batch, -1), (idx + offsets[:, None]).reshape(batch, -1)


def hrc_probabilities(hrc: HRCSoftmax, mu: torch.Tensor, var: torch.Tensor,
                      per_token: bool = False) -> torch.Tensor:
    """(B, K) probabilities of `hrc`; a language model's (`per_token`) scaled to sum to 1 over
    the K tokens. The tree of a K that is not a power of two has leaves for no token, whose
    share would otherwise be lost; scaled, the loss in nats per token is a proper one, as
    torch's cross-entropy, and the argmax is unchanged."""
    probs = hrc.probabilities(mu, var)
    return probs / probs.sum(1, keepdim=True).clamp_min(1e-30) if per_token else probs


def by_position(mu: torch.Tensor, var: torch.Tensor, labels: torch.Tensor, per_position: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """With `per_position`, a language model's (B, T·N) output moments and (B, T) labels as
    B·T samples of N outputs and one label each; else all as they are."""
    if not per_position:
        return mu, var, labels
    rows = labels.numel()
    return mu.reshape(rows, -1), var.reshape(rows, -1), labels.reshape(-1)


def _link_scores(decoders: dict[str, HRCSoftmax], mu: torch.Tensor, var: torch.Tensor,
                 labels: torch.Tensor, per_position: bool) -> Metrics:
    """Per link, the log-likelihood of the batch's labels under its class probabilities."""
    mu, var, labels = by_position(mu, var, labels, per_position)
    n = float(labels.shape[0])
    at = labels.long().reshape(-1, 1)
    sums = torch.stack([hrc_probabilities(hrc, mu, var, per_position).gather(1, at)
                        .clamp_min(1e-12).log().sum()
                        for hrc in decoders.values()]).tolist()  # one device sync for both
    return {f"{_LINK_PREFIX}{link}": (total, n) for link, total in zip(decoders, sums)}


def _class_metrics(hrc: HRCSoftmax, mu: torch.Tensor, var: torch.Tensor, labels: torch.Tensor,
                   per_position: bool) -> Metrics:
    """A classification evaluation's metrics with `hrc`'s class probabilities: error,
    log-likelihood, calibration bins, predicted class counts; for a language model per token,
    and the loss in nats per token (minus the log-likelihood)."""
    probs, labels, scores = _class_scores(hrc, mu, var, labels, per_position)
    return {**scores, **calibration_sums(probs, labels), **_class_counts(probs)}


def _class_scores(hrc: HRCSoftmax, mu: torch.Tensor, var: torch.Tensor, labels: torch.Tensor,
                  per_position: bool) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
    """(class probabilities, labels, error and log-likelihood sums) of a batch, per token for a
    language model's (B, T) labels (`per_position`), with its loss in nats per token (minus
    the log-likelihood)."""
    mu, var, labels = by_position(mu, var, labels, per_position)
    probs = hrc_probabilities(hrc, mu, var, per_position)
    n = float(labels.shape[0])
    wrong = (probs.argmax(1) != labels).sum().item()
    log_lik = probs.gather(1, labels.long().reshape(-1, 1)).clamp_min(1e-12).log().sum().item()
    scores = {"error": (float(wrong), n), "log_likelihood": (log_lik, n)}
    if per_position:
        scores["loss"] = (-log_lik, n)
    return probs, labels, scores


def _class_counts(probs: torch.Tensor) -> Metrics:
    """How many of the (B, K) batch's samples are predicted in each class, over B."""
    counts = torch.bincount(probs.argmax(1).cpu(), minlength=probs.shape[1]).tolist()
    n = float(probs.shape[0])
    return {f"{_CLASS_PREFIX}{c}": (float(count), n) for c, count in enumerate(counts)}


def _pop_top_class_share(means: dict[str, float]) -> float | None:
    """Remove `_class_counts`' entries; the share of the most predicted class (None: none)."""
    shares = [means.pop(k) for k in [k for k in means if k.startswith(_CLASS_PREFIX)]]
    return max(shares) if shares else None
