#!/usr/bin/env python3
"""Regenerate tests/data/pytagi_fixtures.npz with the pytagi 0.2.1 wheel: what pytagi computes on
small TAGI networks, as numbers the engine's parity tests (tests/unit/test_tagi_parity.py,
through tests/unit/pytagi_parity.py) are checked against.

For each case a small network is built in pytagi, then two training steps (forward, output
update, backward, step) and one eval forward run on fixed inputs. Everything is written to one
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
buffers; the layouts are torch's (Linear (out, in), Conv2d (out, in, k, k), NCHW states).
Parameters are copied into the engine from `init/…` (pytagi draws its own initial values), then
the same steps must reproduce `step*/…` and `eval/…`. Cases where pytagi has a known bug (see
docs/tagi.md) are recorded as pytagi computes them: the tests compare them deliberately.

  bash bench/setup_pytagi.sh      # a venv with the pytagi 0.2.1 wheel
  LD_LIBRARY_PATH=$PWD/bench/.venv-pytagi/lib/python3.11/site-packages/nvidia/nccl/lib \
      bench/.venv-pytagi/bin/python tests/data/make_pytagi_fixtures.py tests/data/pytagi_fixtures.npz
"""
import sys
import numpy as np
import pytagi
from pytagi.nn import (AvgPool2d, BatchNorm2d, Conv2d, EvenExp, LayerBlock, LayerNorm, Linear,
                       MixtureReLU, OutputUpdater, ReLU, ResNetBlock, Sequential)

B = 4


def cases():
    yield "fnn", (5,), 3, lambda: Sequential(Linear(5, 6), ReLU(), Linear(6, 6), MixtureReLU(),
                                             Linear(6, 3))
    yield "cnn", (2, 6, 6), 4, lambda: Sequential(
        Conv2d(2, 3, 3, padding=1, in_width=6, in_height=6), ReLU(), AvgPool2d(2, 2), Linear(27, 4))
    yield "cnn_stride_pad2", (2, 6, 6), 3, lambda: Sequential(
        Conv2d(2, 4, 3, stride=2, padding=1, padding_type=2, in_width=6, in_height=6), MixtureReLU(),
        Linear(36, 3))
    yield "cnn_bn", (2, 6, 6), 4, lambda: Sequential(
        Conv2d(2, 3, 3, padding=1, in_width=6, in_height=6), BatchNorm2d(3), ReLU(), AvgPool2d(2, 2),
        Linear(27, 4))
    yield "fnn_bn", (5,), 3, lambda: Sequential(Linear(5, 6), BatchNorm2d(6), ReLU(), Linear(6, 3))
    yield "fnn_ln", (5,), 3, lambda: Sequential(Linear(5, 6), LayerNorm([6]), ReLU(), Linear(6, 3))
    # heteroscedastic head: outputs (mean, noise variance) pairs, OutputUpdater.update_heteros
    yield "fnn_heteros", (2,), 2, lambda: Sequential(Linear(2, 8), ReLU(), Linear(8, 2), EvenExp())
    yield "resnet_identity", (2, 4, 4), 2, lambda: Sequential(
        Conv2d(2, 3, 3, padding=1, in_width=4, in_height=4), ReLU(),
        ResNetBlock(LayerBlock(Conv2d(3, 3, 3, padding=1), ReLU(), Conv2d(3, 3, 3, padding=1))), ReLU(),
        Linear(48, 2))
    yield "resnet_projection_bn", (2, 4, 4), 2, lambda: Sequential(
        Conv2d(2, 3, 3, padding=1, in_width=4, in_height=4), BatchNorm2d(3), ReLU(),
        ResNetBlock(LayerBlock(Conv2d(3, 4, 3, padding=1), BatchNorm2d(4), ReLU(),
                               Conv2d(4, 4, 3, padding=1), BatchNorm2d(4)),
                    LayerBlock(Conv2d(3, 4, 1), BatchNorm2d(4))), ReLU(),
        Linear(64, 2))


def param_layers(layers, prefix=""):
    """(path, layer) of every layer that holds parameters, nested blocks included."""
    for i, layer in enumerate(layers):
        path = f"{prefix}{i}"
        if hasattr(layer, "main_block"):  # a ResNetBlock (pytagi hands out the C++ objects)
            yield from param_layers(layer.main_block.layers, f"{path}.main.")
            if layer.shortcut is not None:
                inner = layer.shortcut.layers if hasattr(layer.shortcut, "layers") else [layer.shortcut]
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


def record(name, in_shape, n_out, build, out):
    pytagi.manual_seed(7)
    net = build()
    net.set_threads(1)
    upd = OutputUpdater(net.device)
    rng = np.random.default_rng(7)
    for k in range(2):
        x = rng.normal(size=(B,) + in_shape).astype(np.float32)
        y = rng.normal(size=(B, n_out)).astype(np.float32)
        vy = np.full_like(y, 0.3)
        out[f"{name}/x{k}"], out[f"{name}/y{k}"], out[f"{name}/var_y{k}"] = x, y, vy
        m, v = net(x.ravel())
        if k == 0:
            for path, layer in param_layers(net.layers):
                grab(out, f"{name}/init/{path}", layer, ("mu_w", "var_w", "mu_b", "var_b"))
        out[f"{name}/step{k}/out_mu"], out[f"{name}/step{k}/out_var"] = np.array(m), np.array(v)
        if "bn" in name:
            for key, val in net.get_norm_mean_var().items():
                for j, what in enumerate(("running_mean", "running_var", "batch_mean", "batch_var")):
                    out[f"{name}/step{k}/norm/{key}.{what}"] = np.array(val[j], dtype=np.float64).ravel()
        if "heteros" in name:  # observations are the even outputs only; var_y is unused
            y = y[:, :1].copy()
            out[f"{name}/y{k}"] = y
            upd.update_heteros(output_states=net.output_z_buffer, mu_obs=y.ravel(),
                               delta_states=net.input_delta_z_buffer)
        else:
            upd.update(output_states=net.output_z_buffer, mu_obs=y.ravel(), var_obs=vy.ravel(),
                       delta_states=net.input_delta_z_buffer)
        net.backward()
        for path, layer in param_layers(net.layers):
            grab(out, f"{name}/step{k}/{path}", layer, ("delta_mu_w", "delta_var_w", "delta_mu_b", "delta_var_b"))
        net.step()
        for path, layer in param_layers(net.layers):
            grab(out, f"{name}/step{k}/after/{path}", layer, ("mu_w", "var_w", "mu_b", "var_b"))
    net.eval()
    x = rng.normal(size=(B,) + in_shape).astype(np.float32)
    m, v = net(x.ravel())
    out[f"{name}/x_eval"], out[f"{name}/eval/out_mu"], out[f"{name}/eval/out_var"] = x, np.array(m), np.array(v)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "pytagi_fixtures.npz"
    out = {}
    for name, in_shape, n_out, build in cases():
        record(name, in_shape, n_out, build, out)
        print(f"{name}: {sum(1 for k in out if k.startswith(name + '/'))} arrays")
    np.savez_compressed(path, **{k: np.asarray(v, dtype=np.float64) for k, v in out.items()})
    print(f"wrote {path} ({len(out)} arrays), pytagi {pytagi.__version__ if hasattr(pytagi, '__version__') else '0.2.1'}")


if __name__ == "__main__":
    main()
