"""The recording half of make_cutagi_fixtures.py: run in a Python whose path starts with the
cuTAGI build (`cutagi`) and that commit's `pytagi`; writes the .npz named on the command line.

Keys follow tests/data/make_pytagi_fixtures.py (so tests/unit/pytagi/parity.py replays them):
  <case>/x{k}, y{k}, var_y{k}                 inputs and observations of training step k (0, 1)
  <case>/init/<layer>.<mu_w|var_w|mu_b|var_b> parameters right after the first forward
  <case>/step{k}/out_mu, out_var              the network output of step k's forward
  <case>/step{k}/<layer>.<delta_mu_w|...>     parameter deltas after step k's backward
  <case>/step{k}/after/<layer>.<mu_w|...>     parameters after step k's step()
  <case>/x_eval, eval/out_mu, eval/out_var    an eval forward after the two steps
<layer> is the index in net.layers. Every case starts with a Linear, so the deltas of that
Linear carry the innovations that reached the input of the layer under test.
"""
import sys

import numpy as np
import pytagi
from pytagi.nn import Linear, MultiheadAttention, OutputUpdater, ReLU, RMSNorm, Sequential

T, E = 4, 8

#: name -> (network builder, input features, outputs, batch, observation noise)
CASES = {
    # Linear(3, T·E) makes the T·E-wide state cuTAGI's attention reads as T positions of E.
    "attn": (lambda: Sequential(Linear(3, T * E), MultiheadAttention(E, 2, 2)), 3, T * E, 2,
             0.2),
    "attn_gqa": (lambda: Sequential(Linear(3, T * E), MultiheadAttention(E, 4, 2)), 3, T * E,
                 2, 0.2),
    "attn_nobias_he": (lambda: Sequential(Linear(3, T * E), MultiheadAttention(
        E, 2, 1, bias=False, gain_weight=0.5, init_method="He")), 3, T * E, 2, 0.2),
    # One position (T = 1): the only input cuTAGI's attention reads as intended.
    "attn_t1": (lambda: Sequential(Linear(3, E), MultiheadAttention(E, 2, 2), Linear(E, 2)), 3,
                2, 4, 0.2),
    "rmsnorm": (lambda: Sequential(Linear(5, E), RMSNorm([E]), Linear(E, 2)), 5, 2, 4, 0.2),
    "rmsnorm_relu": (lambda: Sequential(Linear(5, E), ReLU(), RMSNorm([E]), Linear(E, 2)), 5, 2,
                     4, 0.2),
}


def param_layers(net):
    for i, layer in enumerate(net.layers):
        if hasattr(layer, "mu_w") and len(layer.mu_w):
            yield str(i), layer


def grab(out, key, layer, names):
    for n in names:
        v = getattr(layer, n)
        if len(v):
            out[f"{key}.{n}"] = np.array(v, dtype=np.float64)


def record(name, out):
    build, n_in, n_out, batch, var_y = CASES[name]
    pytagi.manual_seed(7)
    net = build()
    net.set_threads(1)
    upd = OutputUpdater(net.device)
    rng = np.random.default_rng(7)
    for k in range(2):
        x = rng.normal(size=(batch, n_in)).astype(np.float32)
        y = rng.normal(size=(batch, n_out)).astype(np.float32)
        vy = np.full_like(y, var_y)
        out[f"{name}/x{k}"], out[f"{name}/y{k}"], out[f"{name}/var_y{k}"] = x, y, vy
        m, v = net(x.ravel())
        if k == 0:
            for path, layer in param_layers(net):
                grab(out, f"{name}/init/{path}", layer, ("mu_w", "var_w", "mu_b", "var_b"))
        out[f"{name}/step{k}/out_mu"], out[f"{name}/step{k}/out_var"] = np.array(m), np.array(v)
        upd.update(output_states=net.output_z_buffer, mu_obs=y.ravel(), var_obs=vy.ravel(),
                   delta_states=net.input_delta_z_buffer)
        net.backward()
        for path, layer in param_layers(net):
            grab(out, f"{name}/step{k}/{path}", layer,
                 ("delta_mu_w", "delta_var_w", "delta_mu_b", "delta_var_b"))
        net.step()
        for path, layer in param_layers(net):
            grab(out, f"{name}/step{k}/after/{path}", layer, ("mu_w", "var_w", "mu_b", "var_b"))
    net.eval()
    x = rng.normal(size=(batch, n_in)).astype(np.float32)
    m, v = net(x.ravel())
    out[f"{name}/x_eval"] = x
    out[f"{name}/eval/out_mu"], out[f"{name}/eval/out_var"] = np.array(m), np.array(v)


def main():
    out = {}
    for name in CASES:
        record(name, out)
        print(f"recorded {name}")
    np.savez_compressed(sys.argv[1], **out)


if __name__ == "__main__":
    main()
