"""Time series as windows: the CSV layouts, chronological splits, per-series normalisation from
the training part only, missing values, and one-line errors for bad input (issue 20)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dptrain.data import load_dataset
from dptrain.data.config import DataConfig, load_split
from dptrain.data.datasets.series import forward_fill, with_series_ids
from dptrain.errors import ConfigError, DataError


def _wide(path: Path, values: np.ndarray, names=("a", "b")) -> Path:
    lines = ["time," + ",".join(names)]
    for t in range(values.shape[1]):
        cells = ["" if math.isnan(v) else repr(float(v)) for v in values[:, t]]
        lines.append(f"{t}," + ",".join(cells))
    path.write_text("\n".join(lines) + "\n")
    return path


def _two_series(length: int = 40) -> np.ndarray:
    t = np.arange(length, dtype=np.float64)
    return np.stack([np.sin(t / 3) * 2 + 10, 100 + t])


def test_windows_belong_to_the_part_of_their_targets_and_never_look_ahead(tmp_path):
    values = _two_series(40)
    split = load_dataset(f"series:{_wide(tmp_path / 's.csv', values)}", lookback=4, horizon=2)
    series = split.series
    assert (series.train_end, series.val_end) == (28, 32)  # 70 % and 80 % of 40 steps
    assert split.input_shape == (4,) and split.output_dim == 2
    # the parts hold the (S, T) series once, not their L-fold overlapping windows
    assert split.train.inputs.data_ptr() == split.test.inputs.data_ptr()
    assert split.train.inputs.shape == (2, 40)
    x, y = split.train[torch.tensor([0, 5])]
    assert x.shape == (2, 4) and y.shape == (2, 2) and split.train[3][0].shape == (4,)
    for part, low, high in ((split.train, 4, 28), (split.validation, 28, 32),
                            (split.test, 32, 40)):
        starts = part.start
        assert starts.min() >= low and (starts + 2).max() <= high
        # every window of both series, in time order within each series: nothing shuffled
        assert len(part) == 2 * (high - 2 - max(low, 4) + 1)
        for w in (0, len(part) - 1):
            s, t = int(part.series[w]), int(starts[w])
            mean, std = series.norm.mean[s, 0], series.norm.std[s, 0]
            np.testing.assert_allclose(part.x[w].double() * std + mean, values[s, t - 4:t],
                                       rtol=1e-5)
            np.testing.assert_allclose(part.y[w].double() * std + mean, values[s, t:t + 2],
                                       rtol=1e-5)


def test_normalisation_is_fitted_per_series_on_the_training_part_only(tmp_path):
    values = _two_series(40)
    split = load_dataset(f"series:{_wide(tmp_path / 's.csv', values)}", lookback=4)
    train = values[:, :28]
    np.testing.assert_allclose(split.series.norm.mean[:, 0], train.mean(1))
    np.testing.assert_allclose(split.series.norm.std[:, 0], train.std(1))
    changed = values.copy()
    changed[:, 28:] *= 1000  # validation and test parts: the statistics must not move
    again = load_dataset(f"series:{_wide(tmp_path / 't.csv', changed)}", lookback=4)
    torch.testing.assert_close(again.series.norm.mean, split.series.norm.mean)
    torch.testing.assert_close(again.train.x, split.train.x)
    assert split.x_norm is None  # two series: no single affine map of every window


def test_long_format_reads_as_the_wide_one(tmp_path):
    values = _two_series(30)
    wide = load_dataset(f"series:{_wide(tmp_path / 'w.csv', values)}", lookback=3)
    rows = ["date,series,value"] + [f"{t},{name},{float(values[s, t])!r}" for t in range(30)
                                    for s, name in reversed(list(enumerate("ab")))]
    (tmp_path / "l.csv").write_text("\n".join(rows) + "\n")
    long = load_dataset(f"series:{tmp_path / 'l.csv'}", lookback=3)
    assert long.series.names == ["b", "a"]  # in order of first appearance
    torch.testing.assert_close(long.series.values.flip(0), wide.series.values)


def test_missing_values_are_nan_targets_and_filled_inputs(tmp_path):
    values = _two_series(40)
    values[0, 10] = np.nan       # a missing value inside the training part
    values[1, 30:32] = np.nan    # the whole validation part of series b, for horizon 2
    split = load_dataset(f"series:{_wide(tmp_path / 's.csv', values)}", lookback=4, horizon=2)
    train = split.train
    target_10 = (train.series == 0) & ((train.start == 9) | (train.start == 10))
    assert torch.isnan(train.y[target_10]).sum() == 2  # kept, as a missing observation
    shown_10 = (train.series == 0) & (train.start == 12)
    x = train.x[shown_10][0]  # inputs are steps 8..11: step 10 repeats step 9
    assert torch.isfinite(x).all() and x[2] == x[1]
    # a window of b whose two targets are both missing teaches nothing and is left out
    assert not ((split.validation.series == 1) & (split.validation.start == 30)).any()
    filled = forward_fill(torch.tensor([[math.nan, 1.0, math.nan, math.nan, 4.0]]))
    assert filled.tolist() == [[0.0, 1.0, 1.0, 1.0, 4.0]]


@pytest.mark.parametrize("content, options, message", [
    (None, {"lookback": 40}, "lookback 40 + horizon 1 need 41 time steps, but the training "
                             "part has 28"),
    ("time,a\n0,1\n1,2\n2,x\n", {}, "line 4, column 'a': not a number: 'x'"),
    ("time,a\n" + "".join(f"{t},{'3.5' if t == 5 else ''}\n" for t in range(40)),
     {"lookback": 3}, "no series has 2 observed values in its training part (28 time steps)"),
    ("time,a\n" + "".join(f"{t},{t}\n" for t in (0, 2, 1, 3)), {}, "line 4: time '1' does "
                                                                    "not come after '2'"),
    ("t,series,v,w\n0,a,1,2\n", {}, "exactly three columns"),
])
def test_bad_series_input_is_one_line_naming_it(tmp_path, content, options, message):
    path = tmp_path / "bad.csv"
    if content is None:
        _wide(path, _two_series(40))
    else:
        path.write_text(content)
    with pytest.raises((DataError, ConfigError)) as err:
        load_dataset(f"series:{path}", **options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_options_of_series_are_checked_where_they_are_given():
    with pytest.raises(ConfigError, match="horizon: expected an integer >= 1, got 0"):
        DataConfig(dataset="sine", horizon=0)
    with pytest.raises(ConfigError, match="lookback: for time series .*digits is not one"):
        load_split(DataConfig(dataset="digits", lookback=5), seed=0)
    split = load_split(DataConfig(dataset="sine", lookback=5, horizon=3), seed=0)
    assert split.input_shape == (5,) and split.output_dim == 3


def test_built_in_series_have_pytagi_s_sine_shape_and_several_seasonal_series():
    sine = load_dataset("sine")
    assert sine.series.values.shape == (1, 1156) and sine.series.times[0] == "2019-01-01"
    raw = sine.series.values[0]
    assert 4.5 < raw.mean() < 5.5 and raw.max() > 9.5 and raw.min() < 0.5  # 5·(1 + sin)
    seasonal = load_dataset("seasonal")
    assert len(seasonal.series.names) == 4
    assert set(seasonal.train.series.tolist()) == {0, 1, 2, 3}
    # each series standardised by its own training part, whatever its level
    assert torch.allclose(seasonal.series.normalised[:, :seasonal.series.train_end]
                          .mean(1), torch.zeros(4, dtype=torch.float64), atol=1e-9)


def test_with_series_ids_appends_each_window_s_series_id_to_its_inputs(tmp_path):
    """The id follows the window's values as a float, in every part, one sample or a batch;
    the values and targets are those of the split without ids. One series, or data that is
    not a time series, is refused in one line."""
    split = load_dataset(f"series:{_wide(tmp_path / 's.csv', _two_series(40))}", lookback=4,
                         horizon=2)
    with_ids = with_series_ids(split)
    assert with_ids.input_shape == (5,) and with_ids.series.with_ids
    assert not split.series.with_ids and split.input_shape == (4,)
    for plain, part in ((split.train, with_ids.train), (split.validation, with_ids.validation),
                        (split.test, with_ids.test)):
        torch.testing.assert_close(part.x[:, :4], plain.x)
        torch.testing.assert_close(part.y, plain.y)
        assert torch.equal(part.x[:, 4], plain.series.float())
        assert set(part.x[:, 4].tolist()) == {0.0, 1.0}
    last = len(with_ids.train) - 1
    assert with_ids.train[last][0].tolist()[-1] == 1.0 and with_ids.train[0][0][-1] == 0.0
    assert with_series_ids(with_ids) is with_ids
    with pytest.raises(ConfigError, match=r"sine: one series \('sine'\); a series id tells"):
        with_series_ids(load_dataset("sine", lookback=4))
    with pytest.raises(ConfigError, match="diabetes: series ids are for time series"):
        with_series_ids(load_dataset("diabetes"))
