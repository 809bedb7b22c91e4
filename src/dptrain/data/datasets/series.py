"""Time series as sliding windows: `load_series(PATH.csv)`, and the `SeriesData` a forecast needs.

One CSV file with a header row, in one of two layouts:
  - wide: a time column first, then one column per series (`date,sales_a,sales_b`);
  - long: exactly three columns, the time, a series id (a column named `series`, `series_id`
    or `id`) and the value (`date,series,value`), one row per (time, series), and the known
    covariates named in `covariates`, shared by the series (`date,series,value,temp`).
Times are labels: numbers (sorted as numbers) or anything else sorted as text, so ISO dates
(2024-01-31) sort right. A wide file's rows must be in time order. An empty cell, `nan` or
`NA` is a missing value.

Each series is split by time, never shuffled across the split: its first `train_fraction`
of time steps train, the next `val_fraction` validate, the rest test (or the last `test_size`
steps test and the `val_size` before them validate, each a count of time steps or a fraction
of the series: `dptrain.data.datasets.sizes`). It is standardised
with the mean and std of its own training part (a series constant there is kept with a safe
scale, one with fewer than 2 observed training values left out, each named in one warning
line). A window holds `lookback` values as input and
the `horizon` values that follow as targets; it belongs to the part its targets lie in (its
inputs may reach back into the part before: they are observed past). Missing targets stay
NaN (TAGI leaves them out of the update); missing inputs are filled with the last value
observed before them, or with the training mean (0 once standardised) before the first one.

`with_series_ids(split)` appends each window's series id (0, 1, ... in the order of
`SeriesData.names`) to its inputs as a last column, for a global model that embeds it.
Columns named in `covariates` are known covariates, paired with the values at every input
step (`dptrain.data.datasets.covariates`).
"""

from __future__ import annotations

import csv
import io
import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dptrain.data.datasets._files import read_bytes
from dptrain.data.datasets.base import ArrayDataset, Normalisation, Split
from dptrain.data.datasets.covariates import with_covariates
from dptrain.data.datasets.sizes import series_ends
from dptrain.data.datasets.spacing import season_candidates
from dptrain.runtime.collectives import get_rank
from dptrain.errors import ConfigError, DataError

log = logging.getLogger(__name__)

ID_COLUMNS = ("series", "series_id", "id")
MISSING = ("", "nan", "na", "n/a", "null")


@dataclass(frozen=True, eq=False)  # tensors: == would be ambiguous
class SeriesData:
    """The series of a split as a whole, for forecasts and plots: raw values (S, T) with NaN
    where missing, on one time axis `times` (T labels), split at `train_end` and `val_end`
    (time indices: train [0, train_end), validation [train_end, val_end), test [val_end, T)).
    `norm.mean` and `norm.std` are (S, 1): series s is standardised by its training part.
    `with_ids`: a model's input is a window followed by its series' id (`with_series_ids`)."""

    names: list[str]
    times: list[str]
    values: torch.Tensor
    train_end: int
    val_end: int
    norm: Normalisation
    lookback: int
    horizon: int
    with_ids: bool = False
    season: int = 0
    """The seasonal period m in time steps for the seasonal naive baseline and the seasonal
    MASE (0: inferred from the time spacing, `season_candidates`)."""
    forecast_every: int = 0
    """Rolling-origin evaluation: forecast this many steps from an origin, then reveal them and
    move the origin on (0: one recursive forecast of the whole test part)."""
    covariates: torch.Tensor | None = None
    """(T, C) known covariates of every time step, standardised, shared by the series
    (`dptrain.data.datasets.covariates`); None: none."""
    covariate_names: list[str] = dataclasses.field(default_factory=list)

    @property
    def num_features(self) -> int:
        """Values per input time step: the series' value, then its C covariates."""
        return 1 + (0 if self.covariates is None else self.covariates.shape[1])

    @property
    def normalised(self) -> torch.Tensor:
        """(S, T) standardised values, NaN where missing."""
        return self.norm.apply(self.values)

    @property
    def seasons(self) -> tuple[int, ...]:
        """The seasonal periods the naive baseline tries: `season` if set, else those of the
        time spacing (`season_candidates`), else (1,): the last value."""
        if self.season:
            return (self.season,)
        return season_candidates(self.times) or (1,)

    def inputs(self) -> torch.Tensor:
        """(S, T) standardised values with missing ones filled as inputs are (module doc)."""
        return forward_fill(self.normalised)


class WindowDataset(ArrayDataset):
    """The windows of some series, gathered when a batch asks for them: sample i is the
    `lookback` inputs before time step `start[i]` of series `series[i]` and the `horizon`
    targets from it on, standardised. Only the (S, T) series are held, once for every part,
    not the windows, whose inputs overlap L-fold.

    `x` (N, lookback) and `y` (N, horizon), every window at once, are computed on demand for
    code that wants them; `series` and `start` ((N,) int64 each) tell the windows apart. With
    `with_ids` a window's input ends with its series id as a float: x is (N, lookback + 1).
    With `covariates` (T, C) each input step is the value then the C covariates of the time
    `horizon` steps later, flattened step by step: x is (N, lookback · (1 + C)) (+ 1 with ids).
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, series: torch.Tensor,
                 start: torch.Tensor, lookback: int, horizon: int, with_ids: bool = False,
                 covariates: torch.Tensor | None = None) -> None:
        # no ArrayDataset.__init__: there is no x or y to store
        self.inputs, self.targets = inputs, targets  # (S, T) float32 each
        self.series, self.start = series, start
        self.x_offsets = torch.arange(-lookback, 0)
        self.y_offsets = torch.arange(horizon)
        self.with_ids = with_ids
        self.covariates = covariates  # (T, C) float32 or None

    def _copy(self, **changes) -> WindowDataset:
        kept = {"with_ids": self.with_ids, "covariates": self.covariates, **changes}
        return WindowDataset(self.inputs, self.targets, self.series, self.start,
                             len(self.x_offsets), len(self.y_offsets), **kept)

    def with_series_ids(self) -> WindowDataset:
        """The same windows, each input followed by its series id."""
        return self._copy(with_ids=True)

    def with_covariates(self, covariates: torch.Tensor) -> WindowDataset:
        """The same windows, each input step with the (T, C) `covariates` of its time plus
        the horizon."""
        return self._copy(covariates=covariates)

    @property
    def x(self) -> torch.Tensor:  # type: ignore[override]
        return self[torch.arange(len(self))][0]

    @property
    def y(self) -> torch.Tensor:  # type: ignore[override]
        return self[torch.arange(len(self))][1]

    @property
    def sample_shape(self) -> tuple[int, ...]:
        features = 1 if self.covariates is None else 1 + self.covariates.shape[1]
        return (len(self.x_offsets) * features + self.with_ids,)

    def __len__(self) -> int:
        return len(self.start)

    def series_of(self, indices: torch.Tensor) -> torch.Tensor | None:
        """The series of windows `indices`, when there are several series: a learner's
        per-series validation metrics (`dptrain.learners.series_metrics`) need them."""
        return self.series[indices] if self.inputs.shape[0] > 1 else None

    def __getitem__(self, idx):
        series, start = self.series[idx], self.start[idx]  # () or (B,)
        rows = series[..., None]
        x = self.inputs[rows, start[..., None] + self.x_offsets]
        if self.covariates is not None:  # (..., L, C) of the times H steps on
            known = self.covariates[start[..., None] + self.x_offsets + len(self.y_offsets)]
            x = torch.cat([x[..., None], known], -1).flatten(-2)
        if self.with_ids:
            x = torch.cat([x, rows.to(x.dtype)], -1)
        return x, self.targets[rows, start[..., None] + self.y_offsets]

    def __repr__(self) -> str:
        ids = " and series ids" if self.with_ids else ""
        if self.covariates is not None:
            ids = f" with {self.covariates.shape[1]} covariates{ids}"
        return (f"WindowDataset({len(self)} windows of {len(self.x_offsets)}{ids} -> "
                f"{len(self.y_offsets)} from {self.inputs.shape[0]} series)")


def with_series_ids(split: Split) -> Split:
    """A time series split whose windows carry their series' id after their values (x is
    (lookback + 1,)), as its forecasts do: the input of a global model that embeds the id.

    Raises:
        ConfigError: the split is not a time series, or holds a single series (its id would
            tell the model nothing).
    """
    series = split.series
    if not isinstance(series, SeriesData):
        raise ConfigError(f"{split.name}: series ids are for time series (sine, seasonal, "
                          f"series:PATH.csv), and this dataset is not one")
    if len(series.names) < 2:
        raise ConfigError(f"{split.name}: one series ({series.names[0]!r}); a series id "
                          f"tells a model something only when there are several")
    if series.with_ids:
        return split
    parts = {name: getattr(split, name).with_series_ids()
             for name in ("train", "test", "validation")}
    return dataclasses.replace(split, **parts,
                               series=dataclasses.replace(series, with_ids=True))


def load_series(path: str, *, lookback: int = 24, horizon: int = 1,
                train_fraction: float = 0.7, val_fraction: float = 0.1,
                val_size: str | int | float | None = None,
                test_size: str | int | float | None = None, covariates: str = "") -> Split:
    """Windows of the series in a CSV file (layouts in the module docstring); the columns
    named in `covariates` (comma-separated) are known covariates, not series
    (`dptrain.data.datasets.covariates`).

    Raises:
        DataError: unreadable file, a cell that is not a number, times out of order, no series
            with 2 observed training values, or too short for one window. (A constant series
            is kept, an empty one left out, each with a warning line: `series_split`.)
        ConfigError: lookback, horizon or fractions out of range.
    """
    known = [c.strip() for c in covariates.split(",") if c.strip()]
    names, times, values = read_series_csv(path, known)
    for column in known:
        if column not in names:
            raise DataError(f"{path}: covariate column {column!r} is not in the file; its "
                            f"columns: {', '.join(names)}")
    if known and len(known) == len(names):
        raise DataError(f"{path}: every column is a covariate; no series is left to forecast")
    keep = [j for j, n in enumerate(names) if n not in known]
    split = series_split(Path(path).stem, [names[j] for j in keep], times, values[keep],
                         lookback=lookback, horizon=horizon, train_fraction=train_fraction,
                         val_fraction=val_fraction, val_size=val_size,
                         test_size=test_size, dataset=str(path))
    index = [names.index(c) for c in known]
    return with_covariates(split, values[index].T, known)


def series_split(name: str, names: list[str], times: list[str], values: np.ndarray, *,
                 lookback: int, horizon: int, train_fraction: float = 0.7,
                 val_fraction: float = 0.1, val_size: str | int | float | None = None,
                 test_size: str | int | float | None = None, dataset: str | None = None
                 ) -> Split:
    """The train/test windows of raw `values` (S, T) (NaN: missing), with their `SeriesData`
    on `split.series` and the validation windows on `split.validation`; errors name `dataset`
    (default: `name`)."""
    where = dataset or name
    _check_sizes(where, lookback, horizon, train_fraction, val_fraction)
    num_steps = values.shape[1]
    train_end, val_end = series_ends(num_steps, val_size=val_size, test_size=test_size,
                                     where=where, train_fraction=train_fraction,
                                     val_fraction=val_fraction)
    if lookback + horizon > train_end:
        raise DataError(f"{where}: lookback {lookback} + horizon {horizon} need "
                        f"{lookback + horizon} time steps, but the training part has "
                        f"{train_end} of {num_steps}")
    if num_steps - val_end < horizon:
        raise DataError(f"{where}: the test part has {num_steps - val_end} time steps, fewer "
                        f"than the horizon {horizon}")
    names, values = _drop_empty(where, names, values, train_end)
    raw = torch.from_numpy(values.astype(np.float64))
    norm = _fit_per_series(where, names, raw[:, :train_end])
    series = SeriesData(names, times, raw, train_end, val_end, norm, lookback, horizon)
    inputs, targets = series.inputs().float(), series.normalised.float()
    parts = [_windows(series, inputs, targets, low, high) for low, high in
             ((lookback, train_end), (train_end, val_end), (val_end, num_steps))]
    one = len(names) == 1  # then the per-series map is one affine map of every window
    scalar = Normalisation(norm.mean.reshape(()).float(), norm.std.reshape(()).float()) \
        if one else None
    return Split(name=name, task="regression", num_classes=None, train=parts[0],
                 test=parts[2], x_norm=scalar, y_norm=scalar, series=series,
                 validation=parts[1])


def _check_sizes(where: str, lookback: int, horizon: int, train_fraction: float,
                 val_fraction: float) -> None:
    if lookback < 1:
        raise ConfigError(f"{where}: lookback must be >= 1 time step, got {lookback}")
    if horizon < 1:
        raise ConfigError(f"{where}: horizon must be >= 1 time step, got {horizon}")
    if not (0 < train_fraction < 1 and 0 <= val_fraction and train_fraction + val_fraction < 1):
        raise ConfigError(f"{where}: train_fraction in (0, 1) and val_fraction >= 0 with a sum "
                          f"below 1 needed, got {train_fraction} and {val_fraction}")


def _fit_per_series(where: str, names: list[str], train: torch.Tensor) -> Normalisation:
    """Mean and std of each series' observed training values, (S, 1) each. A series constant
    over its training part has no std: it is kept with a safe scale, |mean| (1 for zeros), so
    that its values stay of order 1, and named in one warning line."""
    observed = torch.isfinite(train)
    count = observed.sum(1, keepdim=True)
    filled = torch.where(observed, train, 0.0)
    mean = filled.sum(1, keepdim=True) / count
    var = (torch.where(observed, train - mean, 0.0) ** 2).sum(1, keepdim=True) / count
    std = var.sqrt()
    # A series (almost) constant over its training part has no scale of its own. Divided by
    # its tiny std (or by an arbitrary 1 where it is 0), the values it takes once it changes
    # (a dead meter that wakes up) become huge inputs; a recursive forecast feeds its own
    # mean and variance back, and TAGI's variance of w·x grows with x², so the fed-back
    # variance grew geometrically to inf within a 24-step forecast. Such a series is scaled
    # like a typical one: by the median std of the others (training part only), or, with no
    # other, by |mean| (1 where 0).
    typical = std[std > 0].median() if (std > 0).any() else torch.tensor(0.0, dtype=std.dtype)
    degenerate = [s for s in range(len(names)) if not std[s] > _DEGENERATE * typical]
    if degenerate and get_rank() == 0:  # every rank reads the same file: one line is enough
        log.warning("%s: %d series constant over their training part (or almost: a std below "
                    "1 %% of the median series'), scaled like the typical series: %s", where,
                    len(degenerate), ", ".join(f"{names[s]!r} ({mean[s].item():g})" for s in degenerate))
    safe = typical if typical > 0 else torch.where(mean.abs() > 0, mean.abs(), 1.0)
    return Normalisation(mean, torch.where(std > _DEGENERATE * typical, std, safe))


_DEGENERATE = 1e-2  # a training std below 1 % of the median series' is no scale of its own


def _drop_empty(where: str, names: list[str], values: np.ndarray, train_end: int
                ) -> tuple[list[str], np.ndarray]:
    """The series with at least 2 observed training values; the others cannot be scaled or
    forecast, and are left out with one warning line (an error if none is left)."""
    count = np.isfinite(values[:, :train_end]).sum(1)
    keep = count >= 2
    if keep.all():
        return names, values
    if not keep.any():
        raise DataError(f"{where}: no series has 2 observed values in its training part "
                        f"({train_end} time steps); nothing to learn from")
    if get_rank() == 0:
        log.warning("%s: %d series left out, fewer than 2 observed values in their training "
                    "part: %s", where, int((~keep).sum()),
                    ", ".join(f"{names[s]!r} ({int(count[s])})"
                              for s in np.flatnonzero(~keep)))
    return [n for n, k in zip(names, keep) if k], values[keep]


def forward_fill(values: torch.Tensor) -> torch.Tensor:
    """(S, T) with each NaN replaced by the last finite value before it in its row, or by 0
    where the row has none yet."""
    observed = torch.isfinite(values)
    steps = torch.arange(values.shape[1]).expand_as(values)
    last = torch.where(observed, steps, -1).cummax(1).values
    filled = values.gather(1, last.clamp_min(0))
    return torch.where(last >= 0, filled, 0.0)


def _windows(series: SeriesData, inputs: torch.Tensor, targets: torch.Tensor, low: int,
             high: int) -> WindowDataset:
    """Every window whose targets lie in time steps [low, high), of every series; windows
    with no observed target are left out (they teach nothing)."""
    lookback, horizon = series.lookback, series.horizon
    starts = torch.arange(max(low, lookback), high - horizon + 1)
    num_series = inputs.shape[0]
    ids = torch.arange(num_series).repeat_interleave(len(starts))
    start = starts.repeat(num_series)
    observed = torch.isfinite(targets[ids[:, None], start[:, None] + torch.arange(horizon)])
    keep = observed.any(1)
    return WindowDataset(inputs, targets, ids[keep], start[keep], lookback, horizon)


# ------------------------------------------------------------------------------- reading
def read_series_csv(path: str, covariates: list[str] | tuple[str, ...] = ()
                    ) -> tuple[list[str], list[str], np.ndarray]:
    """(column names, time labels, values (S, T) float64 with NaN where missing): one row per
    series, then, in a long file, one per column named in `covariates` (a wide file's are
    among its series columns)."""
    try:
        text = read_bytes(path).decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not a UTF-8 text file: {err}") from None
    rows = [(n, [c.strip() for c in row]) for n, row in
            enumerate(csv.reader(io.StringIO(text)), start=1) if any(c.strip() for c in row)]
    if len(rows) < 2:
        raise DataError(f"{path}: a series CSV needs a header row and data rows")
    header = rows[0][1]
    for line, row in rows[1:]:
        if len(row) != len(header):
            raise DataError(f"{path}: line {line} has {len(row)} columns, the header "
                            f"{len(header)}")
    if len(header) < 2:
        raise DataError(f"{path}: a series CSV needs a time column and at least one series "
                        f"column, got the header {header}")
    ids = [j for j, h in enumerate(header) if h.lower() in ID_COLUMNS]
    if ids:
        return _read_long(path, header, rows[1:], ids[0], covariates)
    return _read_wide(path, header, rows[1:])


def _number(path: str, line: int, column: str, cell: str) -> float:
    if cell.lower() in MISSING:
        return math.nan
    try:
        value = float(cell)
    except ValueError:
        raise DataError(f"{path}: line {line}, column {column!r}: not a number: "
                        f"{cell!r}") from None
    if math.isinf(value):
        raise DataError(f"{path}: line {line}, column {column!r}: {cell} (infinite)")
    return value


def _time_key(times: list[str]) -> list:
    """Sort keys: numbers sort as numbers, anything else as text."""
    try:
        return [float(t) for t in times]
    except ValueError:
        return list(times)


def _read_wide(path: str, header: list[str], rows: list) -> tuple[list[str], list[str],
                                                                  np.ndarray]:
    times = [row[0] for _, row in rows]
    keys = _time_key(times)
    for i in range(1, len(rows)):
        if not keys[i] > keys[i - 1]:
            raise DataError(f"{path}: line {rows[i][0]}: time {times[i]!r} does not come after "
                            f"{times[i - 1]!r}; rows must be in time order")
    values = np.array([[_number(path, line, header[j], row[j])
                        for j in range(1, len(header))] for line, row in rows])
    return header[1:], times, values.T.copy()


def _long_columns(path: str, header: list[str], id_col: int,
                  covariates: list[str] | tuple[str, ...]) -> tuple[int, int, list[int]]:
    """(time, value, covariate) column indices of a long file: the time first, the id, then
    the value and the covariates in any order."""
    time_col, *others = (j for j in range(len(header)) if j != id_col)
    for column in covariates:
        if column not in header[time_col + 1:] or header.index(column) == id_col:
            raise DataError(f"{path}: covariate column {column!r} is not in the file; its "
                            f"columns: {', '.join(header)}")
    cov_cols = [header.index(c) for c in covariates]
    value_cols = [j for j in others if j not in cov_cols]
    if len(value_cols) != 1:
        raise DataError(f"{path}: a long-format series CSV has exactly three columns (time, "
                        f"{header[id_col]}, value) besides the known covariates named by "
                        f"--covariates, got {header}"
                        + (f": name {', '.join(header[j] for j in value_cols[1:])} in "
                           f"--covariates, or leave it out" if len(value_cols) > 1 else ""))
    return time_col, value_cols[0], cov_cols


def _read_long(path: str, header: list[str], rows: list, id_col: int,
               covariates: list[str] | tuple[str, ...] = ()
               ) -> tuple[list[str], list[str], np.ndarray]:
    """A long file: the time, the id, the value, and the known covariates named in
    `covariates`, which the series share: at one time every row that gives one gives the
    same value. Returns the series, then the covariates as rows of their own."""
    time_col, value_col, cov_cols = _long_columns(path, header, id_col, covariates)
    names = list(dict.fromkeys(row[id_col] for _, row in rows))
    clash = set(names) & set(covariates)
    if clash:
        raise DataError(f"{path}: series {sorted(clash)[0]!r} has a covariate's name")
    index = {name: s for s, name in enumerate(names)}
    keys = _time_key([row[time_col] for _, row in rows])
    times = sorted(set(zip(keys, (row[time_col] for _, row in rows))))
    position = {label: i for i, (_, label) in enumerate(times)}
    values = np.full((len(names) + len(cov_cols), len(times)), np.nan)
    seen: dict[tuple[int, int], int] = {}
    given: dict[tuple[int, int], int] = {}  # (covariate, time) -> the line that gave it
    for line, row in rows:
        s, t = index[row[id_col]], position[row[time_col]]
        if (s, t) in seen:
            raise DataError(f"{path}: line {line}: series {row[id_col]!r} has a second value "
                            f"at time {row[time_col]!r} (first on line {seen[s, t]})")
        seen[s, t] = line
        values[s, t] = _number(path, line, header[value_col], row[value_col])
        for c, j in enumerate(cov_cols):
            value = _number(path, line, header[j], row[j])
            if math.isnan(value):
                continue
            first = values[len(names) + c, t]
            if (c, t) in given and value != first:
                raise DataError(f"{path}: line {line}: covariate {header[j]!r} is {row[j]} at "
                                f"time {row[time_col]!r}, {first:g} on line {given[c, t]}; a "
                                f"known covariate is shared by every series")
            given.setdefault((c, t), line)
            values[len(names) + c, t] = value
    return [*names, *covariates], [label for _, label in times], values
