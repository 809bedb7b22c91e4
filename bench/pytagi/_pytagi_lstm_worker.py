"""pytagi half of tagi_lstm_vs_pytagi.py: one training run, in bench/.venv-pytagi.

    python _pytagi_lstm_worker.py '{"data": "in.npz", "out": "out.npz", "seed": 0,
                                    "threads": 1}'

Trains pytagi's time-series network (LSTM(1,8,L)-LSTM(8,8,L)-Linear(8L,1)) the way its
time_series_forecasting example does: windows in time order (no shuffle), the observation noise
σ_v decayed once per epoch by `exponential_scheduler`, the LSTM states reset after each epoch.
It then forwards the test windows and writes their predictive means and variances (the network's
plus σ_v², as the example reports them) and the training seconds to out.npz. Imports nothing from
dptrain: that lives in the other venv.

Optional keys (tagi_lstm_init_swap.py): "init_out" writes the initial parameters, as read after
the first forward (as tests/data/make_pytagi_fixtures.py records them), to that .npz under
dptrain's state_dict keys ("0.mu_w", ...); "init" starts from the parameters in that .npz
instead of pytagi's own draws.
"""

import json
import os
import sys
import time

import numpy as np
import pytagi
from pytagi import exponential_scheduler
from pytagi.nn import LSTM, Linear, OutputUpdater, Sequential

PARAM_NAMES = ("mu_w", "var_w", "mu_b", "var_b")


def main() -> None:
    args = json.loads(sys.argv[1])
    os.dup2(2, 1)  # whatever the C++ library prints goes to stderr
    data = np.load(args["data"])
    x_train, y_train = data["x_train"].astype(np.float32), data["y_train"].astype(np.float32)
    x_test = data["x_test"].astype(np.float32)
    batch, epochs, window = int(data["batch_size"]), int(data["epochs"]), x_train.shape[1]
    sigma_v0, sigma_min, decay = (float(v) for v in data["sigma_v"])
    pytagi.manual_seed(args["seed"])
    net = Sequential(LSTM(1, 8, window), LSTM(8, 8, window), Linear(8 * window, 1))
    net.set_threads(args["threads"])
    updater = OutputUpdater(net.device)
    if args.get("init"):
        # The layers hold their parameters once a forward has run; the throwaway forward's
        # states are reset, so training starts as from a fresh network.
        net(x_train[:batch].reshape(-1))
        with np.load(args["init"]) as init:
            for i, layer in enumerate(net.layers):
                for name in PARAM_NAMES:
                    if f"{i}.{name}" in init:
                        setattr(layer, name, init[f"{i}.{name}"].astype(np.float32).ravel())
        net.reset_lstm_states()
    sigma_v = sigma_v0
    start, cpu_start = time.perf_counter(), time.process_time()
    for epoch in range(epochs):
        sigma_v = exponential_scheduler(curr_v=sigma_v, min_v=sigma_min, decaying_factor=decay,
                                        curr_iter=epoch)
        var_y = np.full((batch,), sigma_v**2, dtype=np.float32)
        for i in range(0, len(x_train) - batch + 1, batch):
            net(x_train[i:i + batch].reshape(-1))
            if args.get("init_out") and epoch == 0 and i == 0:
                np.savez(args["init_out"], **{f"{j}.{name}": np.array(getattr(layer, name))
                                              for j, layer in enumerate(net.layers)
                                              for name in PARAM_NAMES
                                              if len(getattr(layer, name))})
            updater.update(output_states=net.output_z_buffer,
                           mu_obs=y_train[i:i + batch].reshape(-1), var_obs=var_y,
                           delta_states=net.input_delta_z_buffer)
            net.backward()
            net.step()
        net.reset_lstm_states()
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    mus, variances = [], []
    batch = min(batch, len(x_test))  # (a batch larger than the test part: one batch of it)
    for i in range(0, len(x_test) - batch + 1, batch):
        mu, var = net(x_test[i:i + batch].reshape(-1))
        mus.append(np.asarray(mu)[:batch])
        variances.append(np.asarray(var)[:batch] + sigma_v**2)
    np.savez(args["out"], mu=np.concatenate(mus), var=np.concatenate(variances),
             seconds=seconds, cpu_seconds=cpu_seconds, version=pytagi.__version__.strip())


if __name__ == "__main__":
    main()
