#!/usr/bin/env python3
"""Regenerate tests/data/pytagi_fixtures.npz with the pytagi 0.2.1 wheel: what pytagi computes on
small TAGI networks, as numbers the engine's parity tests (tests/unit/pytagi/test_parity*.py,
through tests/unit/pytagi/parity.py) are checked against.

For each case (a `Spec`: network, batch size, observation noise) a small network is built in
pytagi, then two training steps (forward, output update, backward, step) and one eval forward
run on fixed inputs, all at the case's batch size (the wheel's CPU buffers do not survive a
larger batch than the first). Everything is written to one
.npz (float64 copies of pytagi's float32 values), keys `<case>/<what>`:

  <case>/x{k}, y{k}, var_y{k}             inputs and observations of training step k (0, 1)
  <case>/x_eval                           input of the eval forward after the two steps
  <case>/init/<layer>.<mu_w|var_w|mu_b|var_b>          parameters right after the first forward
  <case>/step{k}/out_mu, out_var          network output of step k's forward
  <case>/step{k}/<layer>.<delta_mu_w|...> parameter deltas after step k's backward
  <case>/step{k}/after/<layer>.<mu_w|...> parameters after step k's step()
  <case>/step{k}/norm/<name>.<running_mean|running_var|batch_mean|batch_var>  (BatchNorm cases;
      <name> is pytagi's display name, e.g. "BatchNorm2d()_1" for net.layers[1]; a ResNetBlock's
      entry, e.g. "ResNetBlock(48,64)_3", holds its BatchNorm layers concatenated: main block
      first, then shortcut, in layer order)
  <case>/eval/out_mu, out_var             eval-mode output after the two steps

Case fnn_heteros uses `update_heteros` with one observation per sample (y{k} has one column);
its var_y{k} is not used. The wheel's EvenExp Jacobian (J = v_Z m_A) differs from cuTAGI's later
fix (J = m_A).

<layer> is the layer's path in the pytagi network: "3" for net.layers[3], "2.main.0" for the
first layer of a ResNetBlock's main block, "2.short.0" for its shortcut. Shapes are pytagi's flat
buffers; the layouts are torch's (Linear (out, in), Conv2d (out, in, k, k), ConvTranspose2d
(in, out, k, k), NCHW states).
Parameters are copied into the engine from `init/…` (pytagi draws its own initial values), then
the same steps must reproduce `step*/…` and `eval/…`. Cases where pytagi has a known bug (see
docs/tagi.md) are recorded as pytagi computes them: the tests compare them deliberately.
Each case prints how hard its steps pushed the cap (largest |Δm|/bar, |Δv|/bar, variances
floored); tests/unit/pytagi/test_parity_branches.py asserts the same for the cases meant to.

Families of cases go to separate files (`--family`, default "base"): "base" (the layers above)
to tests/data/pytagi_fixtures.npz, "lstm" (stacked LSTM layers with a Linear head; inputs
x{k} are (B, T, D) windows, passed flat as pytagi's loops do) to
tests/data/pytagi_fixtures_lstm.npz, "seq" (Embedding, and SLSTM with pytagi's smoother; see
`seq_cases`) to tests/data/pytagi_fixtures_seq.npz, "layers" (ConvTranspose2d, Softmax and
ClosedFormSoftmax; see `layer_cases`) to tests/data/pytagi_fixtures_layers.npz.

  bash bench/pytagi/setup_pytagi.sh      # a venv with the pytagi 0.2.1 wheel
  LD_LIBRARY_PATH=$PWD/bench/.venv-pytagi/lib/python3.11/site-packages/nvidia/nccl/lib \
      bench/.venv-pytagi/bin/python tests/data/make_pytagi_fixtures.py \
      tests/data/pytagi_fixtures.npz
  (same) ... make_pytagi_fixtures.py --family lstm tests/data/pytagi_fixtures_lstm.npz
  (same) ... make_pytagi_fixtures.py --family seq tests/data/pytagi_fixtures_seq.npz
  (same) ... make_pytagi_fixtures.py --family layers tests/data/pytagi_fixtures_layers.npz
"""
import argparse
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytagi
from pytagi.nn import (LSTM, SLSTM, AvgPool2d, BatchNorm2d, ClosedFormSoftmax, Conv2d,
                       ConvTranspose2d, Embedding, EvenExp, LayerBlock, LayerNorm, Linear,
                       MaxPool2d, MixtureReLU, MixtureTanh, OutputUpdater, ReLU, ResNetBlock,
                       Sequential, SLinear, Softmax, Tanh)

@dataclass(frozen=True)
class Spec:
    """One recorded case: its network, and how its data are drawn.

    `batch` sets the step cap c(B) (0.1 for 1, 2 below 256, 3 from 256); `var_y` is the
    observation noise and `y_scale` the spread of the targets: a small noise and far targets
    give large innovations, which is what makes the cap bind and the variance floor fire.
    `norm_stats` records BatchNorm statistics, `heteros` uses `update_heteros`.
    """

    name: str
    in_shape: tuple[int, ...]
    n_out: int
    build: Callable[[], Sequential]
    batch: int = 4
    var_y: float = 0.3
    y_scale: float = 1.0
    norm_stats: bool = False
    heteros: bool = False
    #: the inputs of a step from (rng, shape), instead of standard normal draws (ids)
    draw_x: Callable[[np.random.Generator, tuple[int, ...]], np.ndarray] | None = None
    #: the observations of a step from (rng, (batch, n_out)), instead of y_scale · normal
    #: draws (one-hot labels for the softmax heads)
    draw_y: Callable[[np.random.Generator, tuple[int, int]], np.ndarray] | None = None
    #: called on the network before each backward and before each step() (see emb_cases)
    before_backward: Callable[[Sequential], None] | None = None
    before_step: Callable[[Sequential], None] | None = None
    #: a case with a loop of its own (seq_cases); `record` otherwise
    recorder: Callable[["Spec", dict], None] | None = None


def cases():
    yield Spec("fnn", (5,), 3, lambda: Sequential(Linear(5, 6), ReLU(), Linear(6, 6), MixtureReLU(),
                                                  Linear(6, 3)))
    yield Spec("cnn", (2, 6, 6), 4, lambda: Sequential(
        Conv2d(2, 3, 3, padding=1, in_width=6, in_height=6), ReLU(), AvgPool2d(2, 2),
        Linear(27, 4)))
    yield Spec("cnn_stride_pad2", (2, 6, 6), 3, lambda: Sequential(
        Conv2d(2, 4, 3, stride=2, padding=1, padding_type=2, in_width=6, in_height=6),
        MixtureReLU(), Linear(36, 3)))
    yield Spec("cnn_bn", (2, 6, 6), 4, lambda: Sequential(
        Conv2d(2, 3, 3, padding=1, in_width=6, in_height=6), BatchNorm2d(3), ReLU(),
        AvgPool2d(2, 2), Linear(27, 4)), norm_stats=True)
    yield Spec("fnn_bn", (5,), 3, lambda: Sequential(Linear(5, 6), BatchNorm2d(6), ReLU(),
                                                     Linear(6, 3)), norm_stats=True)
    yield Spec("fnn_ln", (5,), 3, lambda: Sequential(Linear(5, 6), LayerNorm([6]), ReLU(),
                                                     Linear(6, 3)))
    # heteroscedastic head: outputs (mean, noise variance) pairs, OutputUpdater.update_heteros
    yield Spec("fnn_heteros", (2,), 2, lambda: Sequential(Linear(2, 8), ReLU(), Linear(8, 2),
                                                          EvenExp()), heteros=True)
    yield Spec("resnet_identity", (2, 4, 4), 2, lambda: Sequential(
        Conv2d(2, 3, 3, padding=1, in_width=4, in_height=4), ReLU(),
        ResNetBlock(LayerBlock(Conv2d(3, 3, 3, padding=1), ReLU(), Conv2d(3, 3, 3, padding=1))),
        ReLU(), Linear(48, 2)))
    yield Spec("resnet_projection_bn", (2, 4, 4), 2, lambda: Sequential(
        Conv2d(2, 3, 3, padding=1, in_width=4, in_height=4), BatchNorm2d(3), ReLU(),
        ResNetBlock(LayerBlock(Conv2d(3, 4, 3, padding=1), BatchNorm2d(4), ReLU(),
                               Conv2d(4, 4, 3, padding=1), BatchNorm2d(4)),
                    LayerBlock(Conv2d(3, 4, 1), BatchNorm2d(4))), ReLU(),
        Linear(64, 2)), norm_stats=True)
    # The cases below reach what the ones above cannot (tests/unit/pytagi/test_parity_branches.py
    # checks that each still does): batches of 16 and 256 (cap factors 2 and 3) with the
    # variance cap binding and the floor firing; smooth activations (J neither 1 nor a 0/1
    # mask) entering Conv2d, pooling, BatchNorm, LayerNorm and a residual shortcut; MaxPool2d
    # with overlapping windows; a first Conv2d on one deterministic channel; layers without
    # bias; LayerNorm on images.
    yield Spec("fnn_cap_b16", (4,), 2, lambda: Sequential(
        Linear(4, 8, gain_weight=2.0, gain_bias=2.0), MixtureTanh(),
        Linear(8, 8, bias=False, gain_weight=0.6), Tanh(), Linear(8, 2, gain_bias=1.2)),
        batch=16, var_y=1e-3, y_scale=3.0)
    yield Spec("fnn_cap_b256", (3,), 2, lambda: Sequential(
        Linear(3, 6, gain_weight=2.0, gain_bias=2.0), MixtureReLU(), Linear(6, 2)),
        batch=256, var_y=1e-3, y_scale=3.0)
    yield Spec("cnn_mixture_bn", (2, 6, 6), 3, lambda: Sequential(
        Conv2d(2, 4, 3, padding=1, in_width=6, in_height=6), MixtureReLU(),
        Conv2d(4, 4, 3, padding=1, bias=False), MixtureTanh(), BatchNorm2d(4), MixtureReLU(),
        AvgPool2d(2, 2), Linear(36, 3)), batch=16, norm_stats=True)
    yield Spec("cnn_maxpool_1ch", (1, 7, 7), 3, lambda: Sequential(
        Conv2d(1, 4, 3, bias=False, padding=1, in_width=7, in_height=7), Tanh(),
        MaxPool2d(3, 2), Conv2d(4, 4, 2, padding=1), MixtureReLU(), MaxPool2d(2, 1),
        Linear(36, 3, bias=False)), batch=16)
    yield Spec("cnn_ln", (2, 5, 5), 2, lambda: Sequential(
        Conv2d(2, 3, 3, padding=1, in_width=5, in_height=5), LayerNorm([3, 5, 5]), MixtureReLU(),
        Conv2d(3, 3, 3, padding=1, bias=False), MixtureTanh(), LayerNorm([3, 5, 5], bias=False),
        Linear(75, 2)), batch=16)
    yield Spec("resnet_mixture_bn", (2, 4, 4), 2, lambda: Sequential(
        Conv2d(2, 3, 3, padding=1, bias=False, in_width=4, in_height=4), BatchNorm2d(3),
        MixtureReLU(),
        ResNetBlock(LayerBlock(Conv2d(3, 3, 3, padding=1, bias=False), MixtureReLU(),
                               BatchNorm2d(3), Conv2d(3, 3, 3, padding=1, bias=False),
                               MixtureReLU(), BatchNorm2d(3))),
        MixtureTanh(),
        ResNetBlock(LayerBlock(Conv2d(3, 4, 3, stride=2, padding=1, padding_type=2, bias=False),
                               MixtureReLU(), BatchNorm2d(4),
                               Conv2d(4, 4, 3, padding=1, bias=False), MixtureReLU(),
                               BatchNorm2d(4)),
                    LayerBlock(Conv2d(3, 4, 2, stride=2, bias=False), BatchNorm2d(4))),
        AvgPool2d(2), Linear(4, 2)), batch=16, norm_stats=True)


def lstm_cases():
    """Stacked LSTMs with a Linear head over every time step's hidden state (pytagi's
    time-series example shape). Windows of T >= 3 steps compute their steps independently in
    pytagi 0.2.1; the batch-1, T = 1 case carries hidden and cell states from one call to the
    next (and backward updates them), which is what lstm_online records."""
    yield Spec("lstm_stack", (3, 1), 1, lambda: Sequential(
        LSTM(1, 4, 3), LSTM(4, 4, 3), Linear(4 * 3, 1)))
    yield Spec("lstm_features", (4, 2), 2, lambda: Sequential(
        LSTM(2, 3, 4, gain_weight=1.5), LSTM(3, 3, 4, bias=False), Linear(3 * 4, 2)),
        batch=16, var_y=0.05)
    yield Spec("lstm_online", (1, 3), 1, lambda: Sequential(
        LSTM(3, 4, 1), LSTM(4, 4, 1), Linear(4, 1)), batch=1, var_y=0.1)


def seq_cases():
    """Embedding and SLSTM cases, to tests/data/pytagi_fixtures_seq.npz."""
    yield from emb_cases()
    yield Spec("slstm_smoother", (3,), 1, lambda: Sequential(
        SLSTM(3, 4, 1), SLSTM(4, 4, 1), SLinear(4, 1)), batch=1, var_y=0.1,
        recorder=record_smoother)


def emb_cases():
    """Ids in [0, 6) with padding id 0 and repeats in a batch, through Linear layers.

    pytagi 0.2.1's Embedding proposes Δv_W = v_W Σ δv where the innovation rule gives
    v_W² Σ δv, and its CPU layer never clears its delta buffers, so each backward adds to the
    last one's deltas (its CUDA layer clears them). The recorder stores what one backward
    writes (it clears the buffers first, as the CUDA layer does) and then hands step() the
    rule's v_W² Σ δv, so every later number is pytagi's arithmetic on the intended update;
    tests/unit/pytagi/test_seq_parity.py names the one recorded delta that differs.
    pytagi 0.2.1 draws the initial table from the system's random device, not from
    `pytagi.manual_seed`, so each recording holds another table (the tests load the recorded
    one, as for every case).
    """
    def ids(rng, shape):
        return rng.integers(0, 6, size=shape)

    yield Spec("emb_linear", (3,), 2, lambda: Sequential(
        Embedding(6, 3, input_size=3, scale=0.7, padding_idx=0), Linear(9, 4), ReLU(),
        Linear(4, 2)), batch=5, draw_x=ids, before_backward=_clear_embedding_deltas,
        before_step=_embedding_variance_rule)


def _clear_embedding_deltas(net):
    emb = net.layers[0]
    emb.delta_mu_w = np.zeros(len(emb.delta_mu_w), dtype=np.float32)
    emb.delta_var_w = np.zeros(len(emb.delta_var_w), dtype=np.float32)


def _embedding_variance_rule(net):
    emb = net.layers[0]
    emb.delta_var_w = (np.array(emb.delta_var_w) * np.array(emb.var_w)).astype(np.float32)


SMOOTHER_STEPS = 8  # time steps of the first pass (net.num_samples)


def record_smoother(spec, out):
    """pytagi's time-series smoother loop (examples/time_series_smoother.py): batch 1, one time
    step per call, SMOOTHER_STEPS training steps (the target of step 2 missing: NaN), then
    `net.smoother()`, then two more steps and an eval forward.

    Keys beyond the common ones (steps k = 0 … SMOOTHER_STEPS + 1; the last two follow the
    smoother, whose reset of the carried states they depend on):
      <case>/carried/<layer>.<mu_h|var_h|mu_c|var_c>     states carried into the smoother
      <case>/smooth/out_mu, out_var                       net.smoother(): (SMOOTHER_STEPS,)
      <case>/smooth/<layer>.<mu_h|var_h|mu_c|var_c>      get_lstm_states(t) stacked over t:
                                                          (SMOOTHER_STEPS, output_size)
    """
    name = spec.name
    pytagi.manual_seed(7)
    net = spec.build()
    net.set_threads(1)
    net.num_samples = SMOOTHER_STEPS
    upd = OutputUpdater(net.device)
    rng = np.random.default_rng(7)
    for k in range(SMOOTHER_STEPS + 2):
        if k == SMOOTHER_STEPS:
            for layer, states in net.get_lstm_states().items():
                for what, value in zip(("mu_h", "var_h", "mu_c", "var_c"), states):
                    out[f"{name}/carried/{layer}.{what}"] = np.array(value)
            mu, var = net.smoother()
            out[f"{name}/smooth/out_mu"], out[f"{name}/smooth/out_var"] = mu, var
            steps = [net.get_lstm_states(t) for t in range(SMOOTHER_STEPS)]
            for layer in steps[0]:
                for j, what in enumerate(("mu_h", "var_h", "mu_c", "var_c")):
                    out[f"{name}/smooth/{layer}.{what}"] = np.stack(
                        [np.array(s[layer][j]) for s in steps])
        x = draw_inputs(spec, rng)
        y = (spec.y_scale * rng.normal(size=(1, 1))).astype(np.float32)
        if k == 2:
            y[:] = np.nan
        record_step(spec, net, upd, out, k, x, y)
    net.eval()
    x = draw_inputs(spec, rng)
    m, v = net(x.ravel())
    out[f"{name}/x_eval"] = x
    out[f"{name}/eval/out_mu"], out[f"{name}/eval/out_var"] = np.array(m), np.array(v)


def layer_cases():
    """ConvTranspose2d and the softmax heads, to tests/data/pytagi_fixtures_layers.npz.

    convT_autoencoder is pytagi's autoencoder in small: a Conv2d encoder, then transposed
    convolutions with padding types 2 (stride 2) and 1 back to the 6x6 image, whose 36
    pixels are the observations. convT_decoder starts like pytagi's decoder, a Linear whose
    flat output a ConvTranspose2d given in_width/in_height reads as an image, with smooth
    Jacobians (Tanh, MixtureReLU) entering both transposed convolutions, stride 2 with
    padding type 1, and a layer without bias.

    The softmax heads take one-hot observations. pytagi 0.2.1's CPU Softmax normalises groups
    of B consecutive values of the flat batch (docs/tagi.md, Departures from pytagi): with
    B = N (fnn_softmax_b3, 3 classes in batches of 3) those groups are the samples, so the
    case records the per-sample softmax; fnn_softmax (B = 4) records the grouped one.
    """
    yield Spec("convT_autoencoder", (1, 6, 6), 36, lambda: Sequential(
        Conv2d(1, 2, 3, padding=1, in_width=6, in_height=6), MixtureReLU(), AvgPool2d(2, 2),
        ConvTranspose2d(2, 3, 3, stride=2, padding=1, padding_type=2), MixtureReLU(),
        ConvTranspose2d(3, 1, 3, padding=1)), var_y=0.1)
    yield Spec("convT_decoder", (3,), 49, lambda: Sequential(
        Linear(3, 2 * 2 * 2), Tanh(),
        ConvTranspose2d(2, 3, 3, stride=2, padding=1, padding_type=2, in_width=2, in_height=2),
        MixtureReLU(), ConvTranspose2d(3, 1, 3, bias=False, stride=2, padding=1)),
        batch=16, var_y=0.05)
    yield Spec("fnn_softmax_b3", (4,), 3, lambda: Sequential(
        Linear(4, 5), ReLU(), Linear(5, 3), Softmax()), batch=3, var_y=0.05,
        draw_y=one_hot)
    yield Spec("fnn_softmax", (4,), 3, lambda: Sequential(
        Linear(4, 5), ReLU(), Linear(5, 3), Softmax()), batch=4, var_y=0.05,
        draw_y=one_hot)
    yield Spec("fnn_cf_softmax", (4,), 3, lambda: Sequential(
        Linear(4, 6), MixtureReLU(), Linear(6, 3), ClosedFormSoftmax()), var_y=0.05,
        draw_y=one_hot)
    yield Spec("cnn_cf_softmax", (1, 4, 4), 3, lambda: Sequential(
        Conv2d(1, 2, 3, padding=1, in_width=4, in_height=4), ReLU(), AvgPool2d(2, 2),
        Linear(8, 3), ClosedFormSoftmax()), batch=8, var_y=0.05, draw_y=one_hot)


def one_hot(rng, shape):
    """One-hot rows of random classes: (batch, classes)."""
    return np.eye(shape[1])[rng.integers(0, shape[1], size=shape[0])]


FAMILIES = {"base": cases, "lstm": lstm_cases, "seq": seq_cases, "layers": layer_cases}

def param_layers(layers, prefix=""):
    """(path, layer) of every layer that holds parameters, nested blocks included."""
    for i, layer in enumerate(layers):
        path = f"{prefix}{i}"
        if hasattr(layer, "main_block"):  # a ResNetBlock (pytagi hands out the C++ objects)
            yield from param_layers(layer.main_block.layers, f"{path}.main.")
            if layer.shortcut is not None:
                short = layer.shortcut
                inner = short.layers if hasattr(short, "layers") else [short]
                yield from param_layers(inner, f"{path}.short.")
        elif hasattr(layer, "layers"):  # a LayerBlock
            yield from param_layers(layer.layers, f"{path}.")
        elif hasattr(layer, "mu_w") and len(layer.mu_w):
            yield path, layer


def grab(out, key, layer, names):
    for n in names:
        v = getattr(layer, n)
        if len(v):
            out[f"{key}.{n}"] = np.array(v, dtype=np.float64)


def record(spec, out):
    name, b = spec.name, spec.batch
    pytagi.manual_seed(7)
    net = spec.build()
    net.set_threads(1)
    upd = OutputUpdater(net.device)
    rng = np.random.default_rng(7)
    for k in range(2):
        x = draw_inputs(spec, rng)
        if spec.draw_y is not None:
            y = spec.draw_y(rng, (b, spec.n_out)).astype(np.float32)
        else:
            y = (spec.y_scale * rng.normal(size=(b, spec.n_out))).astype(np.float32)
        record_step(spec, net, upd, out, k, x, y)
    net.eval()
    x = draw_inputs(spec, rng)
    m, v = net(x.ravel())
    out[f"{name}/x_eval"] = x
    out[f"{name}/eval/out_mu"], out[f"{name}/eval/out_var"] = np.array(m), np.array(v)


def draw_inputs(spec, rng):
    shape = (spec.batch,) + spec.in_shape
    if spec.draw_x is not None:
        return spec.draw_x(rng, shape).astype(np.float32)
    return rng.normal(size=shape).astype(np.float32)


def record_step(spec, net, upd, out, k, x, y):
    """One training step of `net` on (x, y), recorded under `<case>/…{k}` (see the docstring);
    the parameters go to `init/` before the first step."""
    name = spec.name
    vy = np.full_like(y, spec.var_y)
    out[f"{name}/x{k}"], out[f"{name}/y{k}"], out[f"{name}/var_y{k}"] = x, y, vy
    m, v = net(x.ravel())
    if k == 0:
        for path, layer in param_layers(net.layers):
            grab(out, f"{name}/init/{path}", layer, ("mu_w", "var_w", "mu_b", "var_b"))
    out[f"{name}/step{k}/out_mu"], out[f"{name}/step{k}/out_var"] = np.array(m), np.array(v)
    if spec.norm_stats:
        for key, val in net.get_norm_mean_var().items():
            for j, what in enumerate(("running_mean", "running_var", "batch_mean",
                                      "batch_var")):
                out[f"{name}/step{k}/norm/{key}.{what}"] = np.array(
                    val[j], dtype=np.float64).ravel()
    if spec.heteros:  # observations are the even outputs only; var_y is unused
        y = y[:, :1].copy()
        out[f"{name}/y{k}"] = y
        upd.update_heteros(output_states=net.output_z_buffer, mu_obs=y.ravel(),
                           delta_states=net.input_delta_z_buffer)
    else:
        upd.update(output_states=net.output_z_buffer, mu_obs=y.ravel(), var_obs=vy.ravel(),
                   delta_states=net.input_delta_z_buffer)
    if spec.before_backward is not None:
        spec.before_backward(net)
    net.backward()
    for path, layer in param_layers(net.layers):
        grab(out, f"{name}/step{k}/{path}", layer,
             ("delta_mu_w", "delta_var_w", "delta_mu_b", "delta_var_b"))
    if spec.before_step is not None:
        spec.before_step(net)
    net.step()
    for path, layer in param_layers(net.layers):
        grab(out, f"{name}/step{k}/after/{path}", layer, ("mu_w", "var_w", "mu_b", "var_b"))


def cap_report(out, spec):
    """How hard the two steps of a case pushed the cap: the largest |Δm|/bar and |Δv|/bar, and
    how many variances the floor reset (v_old − min(|Δv|, bar) ≤ 0). The same rule as
    tests/unit/pytagi/parity.py's `cap_report`, printed here so a new case can be tuned."""
    c = 0.1 if spec.batch == 1 else (2.0 if spec.batch < 256 else 3.0)
    worst_m = worst_v = 0.0
    floors = 0
    for k in (0, 1):
        before = f"{spec.name}/init/" if k == 0 else f"{spec.name}/step0/after/"
        for key in [key for key in out if key.startswith(before) and ".var_" in key]:
            path, var_name = key[len(before):].rsplit(".", 1)
            group = var_name[len("var_"):]
            bar = np.sqrt(out[key]) / c
            d_m = out[f"{spec.name}/step{k}/{path}.delta_mu_{group}"]
            d_v = out[f"{spec.name}/step{k}/{path}.delta_var_{group}"]
            worst_m = max(worst_m, float(np.max(np.abs(d_m) / bar)))
            worst_v = max(worst_v, float(np.max(np.abs(d_v) / bar)))
            floors += int(np.sum(out[key] - np.minimum(np.abs(d_v), bar) <= 0))
    return worst_m, worst_v, floors


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", nargs="?", default="pytagi_fixtures.npz")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="base",
                        help="which cases to record (default: base)")
    args = parser.parse_args()
    path = args.path
    out = {}
    for spec in FAMILIES[args.family]():
        (spec.recorder or record)(spec, out)
        m, v, floors = cap_report(out, spec)
        print(f"{spec.name}: {sum(1 for k in out if k.startswith(spec.name + '/'))} arrays; "
              f"max |dm|/bar {m:.3g}, max |dv|/bar {v:.3g}, floors {floors}")
    np.savez_compressed(path, **{k: np.asarray(v, dtype=np.float64) for k, v in out.items()})
    print(f"wrote {path} ({len(out)} arrays), pytagi "
          f"{pytagi.__version__ if hasattr(pytagi, '__version__') else '0.2.1'}")


if __name__ == "__main__":
    main()
