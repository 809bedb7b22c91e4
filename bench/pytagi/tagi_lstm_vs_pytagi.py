"""TAGI LSTM forecasting, dptrain.tagi vs pytagi 0.2.1, side by side in one run.

    .venv/bin/python bench/pytagi/tagi_lstm_vs_pytagi.py            # writes bench/results/*.json
    .venv/bin/python bench/pytagi/tagi_lstm_vs_pytagi.py --quick    # smoke run, writes nothing

pytagi's time-series forecasting example, as it ships with 0.2.1: its toy sine series (daily
values 5·(1 + sin(2π t / 365.24 days)) from 2019-01-01, the first 924 days for training, the next
232 for test, made here with the same formula), standardised with the training part's mean and
standard deviation, windows of 5 values predicting the next one (stride 1), the network
LSTM(1,8,5)-LSTM(8,8,5)-Linear(40,1), batch 5 in time order, σ_v decayed from 1 by 0.99 per
epoch down to 0.3, LSTM states reset after each epoch, 50 epochs. Both libraries get the same
windows, float32, one thread each. Per seed the two runs alternate (which goes first alternates
too). Reported in the series' units: test RMSE, mean log-likelihood per window (predictive
variance = the network's + σ_v², as the example reports it) and 2σ coverage; and training
samples (windows) per second, median over seeds: per second of wall clock, and per CPU second
of the training process (on a machine shared with other work, wall time also counts the time
that work held the core; the CPU time does not).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import (RESULTS, command_line, git_describe, hardware,  # noqa: E402
                    setup_pytagi_venv, write_json)
from common.gaussian_forecasts import print_table, summarize  # noqa: E402
from common.lstm_example import (COMPILE_SECONDS, CPU_SECONDS, make_data,  # noqa: E402
                                 metrics, run_ours, run_pytagi)

DEFAULT_OUTPUT = RESULTS / "tagi_lstm_vs_pytagi.json"
#: The issue's targets: test RMSE and log-likelihood at least pytagi's, samples/s at least 2x.
SPEED_TARGET = 2.0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="1 seed, 2 epochs; writes nothing")
    p.add_argument("--compile", action="store_true",
                   help="train ours with net.compile() (for this network, the native step); "
                        "samples/s then leaves out the steps that may compile: the first two "
                        "and the first after the first reset of the LSTM states, the last two "
                        "reported as compile_seconds")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs = 1, 2
    python = setup_pytagi_venv()
    data = make_data(args.epochs, args.batch_size)
    samples = args.epochs * (len(data["x_train"]) // args.batch_size) * args.batch_size
    rows: dict[str, list[dict]] = {"dptrain": [], "pytagi": []}
    with tempfile.TemporaryDirectory() as tmp:
        data_file = Path(tmp) / "data.npz"
        np.savez(data_file, **data)
        for seed in range(args.seeds):
            runs = [("dptrain", lambda: run_ours(data, seed, compile=args.compile)),
                    ("pytagi", lambda: run_pytagi(python, data_file, seed))]
            for name, fn in (runs if seed % 2 == 0 else runs[::-1]):
                mu, var, seconds = fn()
                rows[name].append({**metrics(mu, var, data), "samples_per_s": samples / seconds,
                                   "cpu_samples_per_s": samples / CPU_SECONDS[name][-1]})
    summary = summarize(rows)
    speedup = summary["dptrain"]["samples_per_s"] / summary["pytagi"]["samples_per_s"]
    cpu_speedup = (summary["dptrain"]["cpu_samples_per_s"] /
                   summary["pytagi"]["cpu_samples_per_s"])
    print_table(summary)
    ours, theirs = summary["dptrain"], summary["pytagi"]
    as_good = ours["rmse"] <= theirs["rmse"] and ours["log_likelihood"] >= theirs["log_likelihood"]
    print(f"speed ratio dptrain/pytagi {speedup:.2f}x (target >= {SPEED_TARGET}x: "
          f"{'met' if speedup >= SPEED_TARGET else 'NOT met'}); RMSE and log-likelihood "
          f"{'at least' if as_good else 'NOT at least'} pytagi's; per CPU second "
          f"{cpu_speedup:.2f}x")
    if not args.quick:
        write_json(args.output, {"command": command_line(), "seeds": args.seeds,
                                 "epochs": args.epochs, "batch_size": args.batch_size,
                                 "per_seed": rows, "summary": summary, "speed_ratio": speedup,
                                 "cpu_speed_ratio": cpu_speedup,
                                 "load_average_1_5_15": os.getloadavg(),
                                 "compiled": args.compile, "compile_seconds": COMPILE_SECONDS,
                                 "hardware": hardware(), "git": git_describe(),
                                 "torch": torch.__version__})


if __name__ == "__main__":
    main()
