"""Each window of a time series in units of its own level and spread, the model's output back.

    from dptrain.learners.window_scaling import WindowScaling

    scaling = WindowScaling(lookback=24, features=1)
    stats = scaling.stats(x)                       # (B, 1) mean and spread of each window
    x_w, var_w = scaling.inputs(x, var_x, stats)   # what the network sees
    mean, var = scaling.outputs(mean_w, var_w, stats)   # back in the series' standard units

A series is standardised once, by its training part (`dptrain.data.datasets.series`). A
series whose level or spread changes after that part (a meter that wakes up, a load that
triples) then feeds a network values far outside everything it was trained on, and a network
extrapolates badly: on the generated troubled load file (`write_load_csv`), three such meters
of 30 made the forecast's ND 0.155 against the seasonal naive's 0.057. Scaled by its own
window, every window looks like the training windows did, whatever the series has become:
ND 0.045 (bench/forecasting/forecast_defaults.py --multi-series, docs/results.md). This is
reversible instance normalisation (Kim et al., ICLR 2022) on TAGI's moments: the window's mean and
spread are computed from the input means and taken as known constants, so the inputs' and
outputs' moments transform exactly (a shift and a scale).

The spread has a floor, `FLOOR` of the series' training standard deviation: a flat window
(a dead meter's zeros) would otherwise divide by zero, and the targets that follow it by a
number near zero.

It is not free where the series keep to their training range: a window's own spread no
longer tells a weekday's cycle from a Sunday's, and `hourly`'s whole-test-part ND rose from
0.090 to 0.103 with it. So `--window-scaling auto` (the default) turns it on only where the
data show the need: a series whose validation part leaves its training range
(`shifted_series`); on the four `seasonal` series, whose amplitudes differ, `on` was better
still (MASE 0.84 against 1.04, tests/unit/forecasting/test_forecast.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dptrain.data.datasets.series import SeriesData
from dptrain.runtime.collectives import get_rank

log = logging.getLogger(__name__)

FLOOR = 0.1
"""The least spread a window is scaled by, in its series' standard units. The troubled
file's forecast moves by under 0.001 ND for floors from 0.03 to 1."""


@dataclass(frozen=True)
class WindowStats:
    """Each window's mean and spread (B, 1), in the series' standard units."""

    mean: torch.Tensor
    spread: torch.Tensor


@dataclass(frozen=True)
class WindowScaling:
    """Where a window's values are in a flat input: `lookback` steps of `features` values
    each (the series' value first, then its known covariates), then anything else (a series
    id), which is left as it is, as the covariates are."""

    lookback: int
    features: int = 1

    def _values(self) -> slice:
        return slice(0, self.lookback * self.features, self.features)

    def stats(self, x: torch.Tensor) -> WindowStats:
        values = x[:, self._values()]
        mean = values.mean(1, keepdim=True)
        spread = values.std(1, unbiased=False, keepdim=True).clamp_min(FLOOR)
        return WindowStats(mean, spread)

    def inputs(self, x: torch.Tensor, var_x: torch.Tensor | None, stats: WindowStats
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The input means (and variances, if given) with each window's values scaled."""
        values = self._values()
        x = x.clone()
        x[:, values] = (x[:, values] - stats.mean.to(x.dtype)) / stats.spread.to(x.dtype)
        if var_x is not None:
            var_x = var_x.clone()
            var_x[:, values] = var_x[:, values] / stats.spread.to(var_x.dtype) ** 2
        return x, var_x

    @staticmethod
    def targets(y: torch.Tensor, stats: WindowStats) -> torch.Tensor:
        """The targets in their window's units (a missing one stays NaN)."""
        return (y - stats.mean.to(y.dtype)) / stats.spread.to(y.dtype)

    @staticmethod
    def outputs(mean: torch.Tensor, var: torch.Tensor, stats: WindowStats
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """A prediction's mean and variance back in the series' standard units."""
        spread = stats.spread.to(mean.device, mean.dtype)
        return mean * spread + stats.mean.to(mean.device, mean.dtype), var * spread ** 2


SHIFT = 3.0
"""`--window-scaling auto` turns it on for a series whose validation values' mean lies more
than SHIFT of its training standard deviations from its training mean, or whose spread is
more than SHIFT times its training one."""


def shifted_series(series: SeriesData) -> list[str]:
    """The series (as "name (mean m σ, spread s×)") whose validation part leaves what their
    training part describes: a level shift, a meter that woke up or died, a spread that grew
    (`SHIFT`). Only the validation part is looked at: nothing of the test part chooses."""
    z = series.normalised[:, series.train_end:series.val_end]
    seen = torch.isfinite(z)
    count = seen.sum(1)
    mean = torch.where(seen, z, 0.0).sum(1) / count.clamp_min(1)
    spread = ((torch.where(seen, z - mean[:, None], 0.0) ** 2).sum(1)
              / count.clamp_min(1)).sqrt()
    shifted = (count >= 2) & ((mean.abs() > SHIFT) | (spread > SHIFT))
    return [f"{series.names[s]} (mean {mean[s]:+.1f} σ, spread {spread[s]:.1f}×)"
            for s in torch.nonzero(shifted).flatten().tolist()]


def choose(series: SeriesData, mode: str, where: str) -> WindowScaling | None:
    """The window scaling of `--window-scaling` `mode` (on, off, auto) for `series`: auto
    turns it on where a series' validation part leaves its training range (`shifted_series`),
    said in one line that names them."""
    if mode == "off":
        return None
    if mode == "auto":
        shifted = shifted_series(series)
        if not shifted:
            return None
        if get_rank() == 0:  # every rank decides the same from the same file
            more = f" and {len(shifted) - 5} more" if len(shifted) > 5 else ""
            log.warning("%s: %d series leave their training range in the validation part: "
                        "%s%s; each window is scaled by its own mean and spread "
                        "(--window-scaling auto; off: --window-scaling off)", where,
                        len(shifted), ", ".join(shifted[:5]), more)
    return WindowScaling(series.lookback, series.num_features)
