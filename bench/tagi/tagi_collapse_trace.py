"""What happens inside a TAGI CNN run that collapses, step by step, beside runs that learn: the
per-layer statistics behind docs/tagi.md, Collapsed runs, and its figure.

    .venv/bin/python bench/tagi/tagi_collapse_trace.py     # ~20 s

writes bench/results/tagi_collapse_trace.json and docs/images/tagi_collapse.png.

Runs, one epoch each on the MNIST-format digits of bench/tagi/tagi_stability.py (28x28, batch 32,
σ_v 0.05, the order of `numpy.random.default_rng(seed)`): pytagi's initialisation (gain 1) on
seed 3, which collapses, and on seed 1, which learns, and the registry default (gain 0.5) on
seed 3. Recorded at every training step, from the forward before the update: per ReLU, the
share of its inputs above zero and the share of its units above zero for no sample of the
batch ("dead"); per layer, the mean of |μ| and of the variances; at the output, the spread over
the batch of the predicted means and the mean output variance; the batch error; over the
parameters, the share of mean and variance updates that the step cap clipped and the share of
variances the floor reset.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from dptrain.data import load_dataset
from dptrain.models import ModelOptions, build_model
from dptrain.learners.plots import pyplot
from dptrain.tagi import HRCSoftmax, OutputUpdater, ReLU, manual_seed
from dptrain.tagi.base import cap_factor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import REPO, RESULTS, command_line, write_json  # noqa: E402
from common.digit_files import write_mnist_digits  # noqa: E402

RUNS = (("gain 1 (pytagi), seed 3", "tagi-cnn-pytagi", 3),
        ("gain 1 (pytagi), seed 1", "tagi-cnn-pytagi", 1),
        ("gain 0.5 (default), seed 3", "tagi-cnn", 3))
BATCH, SIGMA_V = 32, 0.05


def _record_layers(net, stats: dict) -> None:
    """Wrap each layer's forward to note its output statistics while training."""
    for i, layer in enumerate(net.layers):
        def forward(states, inner=layer.forward, i=i, layer=layer):
            out = inner(states)
            if stats.get("on"):
                row = {"abs_mu": out.mu_a.abs().mean().item(),
                       "var": 0.0 if out.var_a is None else out.var_a.mean().item()}
                if isinstance(layer, ReLU):
                    above = states.mu_a.reshape(states.mu_a.shape[0], -1) > 0  # (B, units)
                    row["active"] = above.double().mean().item()
                    row["dead"] = (~above.any(0)).double().mean().item()
                stats[f"{i} {type(layer).__name__}"] = row
            return out
        layer.forward = forward


def trace(model: str, seed: int, split) -> list[dict]:
    torch.manual_seed(seed)
    manual_seed(seed)
    net = build_model(model, split.input_shape, 11, ModelOptions())
    stats: dict = {"on": True}
    _record_layers(net, stats)
    hrc, updater = HRCSoftmax(10), OutputUpdater(net.device)
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(split.train)))
    rows = []
    for step, i in enumerate(range(0, len(order), BATCH)):
        idx = order[i:i + BATCH]
        mu, var = net(split.train.x[idx])
        y = split.train.y[idx]
        wrong = (hrc.predict(mu, var) != y).double().mean().item()
        obs, obs_idx = hrc.encode(y)
        updater.update_using_indices(net.output_z_buffer, obs, SIGMA_V ** 2, obs_idx,
                                     net.input_delta_z_buffer)
        net.backward()
        params, deltas = net.flat_params, net.flat_deltas  # (2, P): means, variances
        bar = params[1].sqrt() / cap_factor(len(idx))
        rows.append({"step": step, "batch_error": wrong,
                     "output_spread": mu.double().std(0).max().item(),
                     "output_var": var.mean().item(),
                     "cap_mean": (deltas[0].abs() > bar).double().mean().item(),
                     "cap_var": (deltas[1].abs() > bar).double().mean().item(),
                     "floor": (params[1] + deltas[1].clamp(-bar, bar) <= 0).double().mean()
                     .item(),
                     "layers": {k: v for k, v in stats.items() if k != "on"}})
        net.step()
    return rows


def plot(path: Path, traces: dict[str, list[dict]]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for label, rows in traces.items():
        steps = [r["step"] for r in rows]
        relu = next(k for k in rows[0]["layers"] if k.startswith("4 "))  # the second conv's
        axes[0].plot(steps, [1 - r["layers"][relu]["dead"] for r in rows], label=label)
        axes[1].semilogy(steps, [max(r["output_spread"], 1e-9) for r in rows], label=label)
        axes[2].plot(steps, [sum(r["batch_error"] for r in rows[max(0, s - 4):s + 1])
                             / len(rows[max(0, s - 4):s + 1]) for s in steps], label=label)
    axes[0].set(title="2nd conv ReLU: units on for some input", xlabel="step", ylim=(0, 1.02))
    axes[1].set(title="spread over the batch of the output means", xlabel="step")
    axes[2].set(title="batch error (mean of 5 steps)", xlabel="step", ylim=(0, 1))
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, default=RESULTS /
                   "tagi_collapse_trace.json")
    p.add_argument("--figure", type=Path, default=REPO / "docs" / "images" /
                   "tagi_collapse.png")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        split = load_dataset(f"mnist:{write_mnist_digits(Path(tmp))}")
        traces = {label: trace(model, seed, split) for label, model, seed in RUNS}
    for label, rows in traces.items():
        relu = next(k for k in rows[0]["layers"] if k.startswith("4 "))
        dead_at = next((r["step"] for r in rows if r["layers"][relu]["dead"] == 1.0), None)
        capped = np.mean([r["cap_mean"] for r in rows])
        floored = np.mean([r["floor"] for r in rows])
        print(f"{label:28} 2nd-conv ReLU all dead from step {dead_at}; output spread at the "
              f"end {rows[-1]['output_spread']:.1e}; per step {capped:.2%} of the mean "
              f"updates capped, {floored:.3%} of the variances floored")
    write_json(args.output, {"command": command_line(), "runs": traces})
    plot(args.figure, traces)
    print(f"wrote {args.output} and {args.figure}")


if __name__ == "__main__":
    main()
