"""The LSTMs: tagi-lstm, pytagi's forecasting network, on windows of a time series (flat
`(lookback,)` or `(lookback, features)`), with an embedding of the series id for several
series."""

from __future__ import annotations

from dptrain.errors import ConfigError
from dptrain.models.shapes import gains
from dptrain.models.spec import Family, ModelOptions, ModelSpec
from dptrain.tagi import LSTM, Embedding, EvenExp, LayerBlock, Linear, Parallel, Sequential


def tagi_lstm(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions):
    """pytagi's forecasting network: LSTM(1, hidden, L) - LSTM(hidden, hidden, L) -
    Linear(hidden·L, num_outputs), for windows of L values of one series (flat (L,) inputs,
    or (L, features) for several values per time step).

    With `series_embedding` E, the input is the L values then the series id, (L + 1,): a
    Parallel block sends the values through the LSTMs and the id through
    Embedding(num_series, E), and the head reads both, Linear(hidden·L + E, num_outputs)
    (docs/tutorials/forecasting.md, Series embedding, says why there)."""
    if options.series_embedding:
        return _tagi_lstm_with_embedding(input_shape, num_outputs, options)
    seq_len, features = input_shape[0], (input_shape[1] if len(input_shape) == 2 else 1)
    if len(input_shape) == 1 and options.num_features > 1:
        seq_len, features = input_shape[0] // options.num_features, options.num_features
    return Sequential(*_lstm_pair(features, seq_len, options),
                      *_head(options.hidden * seq_len, num_outputs, options),
                      dtype=options.dtype)


def _head(width: int, num_outputs: int, options: ModelOptions) -> list:
    """The Linear head; heteroscedastic: a (mean, noise) pair per output through EvenExp,
    the noise variance learned per input by AGVI (docs/tagi.md)."""
    gw, gb = gains(options)
    if options.heteroscedastic:
        return [Linear(width, 2 * num_outputs, gain_weight=gw, gain_bias=gb), EvenExp()]
    return [Linear(width, num_outputs, gain_weight=gw, gain_bias=gb)]


def _lstm_pair(features: int, seq_len: int, options: ModelOptions) -> list[LSTM]:
    gw, gb = gains(options)
    return [LSTM(features, options.hidden, seq_len, gain_weight=gw, gain_bias=gb),
            LSTM(options.hidden, options.hidden, seq_len, gain_weight=gw, gain_bias=gb)]


def _tagi_lstm_with_embedding(input_shape: tuple[int, ...], num_outputs: int,
                              options: ModelOptions) -> Sequential:
    if len(input_shape) != 1 or input_shape[0] < 2 or options.num_series < 1:
        raise ConfigError(f"tagi-lstm with a series embedding takes windows of values followed "
                          f"by their series id, (lookback + 1,), of num_series >= 1 series; "
                          f"got inputs {tuple(input_shape)} and num_series "
                          f"{options.num_series}")
    features = options.num_features
    seq_len, width = (input_shape[0] - 1) // features, options.series_embedding
    # The Embedding's own scale, not the gains: its rows are the whole signal it passes on.
    ids = Embedding(options.num_series, width)
    return Sequential(Parallel(LayerBlock(*_lstm_pair(features, seq_len, options)), ids,
                               input_sizes=(seq_len * features, 1)),
                      *_head(options.hidden * seq_len + width, num_outputs, options),
                      dtype=options.dtype)



def check_input(spec: ModelSpec, input_shape: tuple[int, ...]) -> None:
    if len(input_shape) > 2:
        raise ConfigError(f"model {spec.name} takes windows of a time series, (lookback,) or "
                          f"(lookback, features); the dataset's inputs have shape "
                          f"{tuple(input_shape)} (use a time series: sine, seasonal, "
                          f"series:PATH.csv)")


# heteroscedastic: the observation noise is learned per input (AGVI), so that forecast
# intervals are calibrated on data whose noise no one knows (docs/tutorials/forecasting.md); sigma_v
# serves the --no-heteroscedastic network. time_features auto: the calendar features the
# time column gives (none without dates), as forecasters of the DeepAR line add them by
# default: a lookback cannot see the weekday that shapes hourly load (on `hourly` rolled
# daily, ND 6 % below the seasonal naive's without them, 19 % with them). lookback 48 (on a
# series only: model_defaults): two days; over the whole test part of `hourly` its ND is
# 36-37 % below the naive's for seeds 0-2, a day's 9-29 % (docs/tutorials/forecasting.md)
_LSTM_DEFAULTS = {"hidden": 8, "batch_size": 16, "sigma_v": 0.1, "heteroscedastic": True,
                  "time_features": "auto", "lookback": 48}
FAMILY = Family(
    name="lstm",
    models=(ModelSpec("tagi-lstm", "tagi", tagi_lstm, "TAGI LSTM for time series (pytagi's "
                      "forecasting network: 2 LSTM layers of --hidden units, a Linear head)",
                      defaults=_LSTM_DEFAULTS),),
    data=frozenset({"series", "features"}),
    options=("hidden", "gain_weight", "gain_bias", "heteroscedastic", "series_embedding",
             "num_series", "num_features"),
    check_input=check_input)
