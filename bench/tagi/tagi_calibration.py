"""Why TAGI classification was overconfident on noisy labels, and what each candidate remedy
gives: ECE, error and mean confidence over seeds, on overlapping classes and on digits.

    .venv/bin/python bench/tagi/tagi_calibration.py              # 5 seeds, about 4 minutes
    .venv/bin/python bench/tagi/tagi_calibration.py --seeds 2 --no-json   # a quick look

writes bench/results/tagi_calibration.json.

Data: `blobs` (three unit-variance Gaussian classes in 5 dimensions whose means are 2.5 apart,
Bayes error 17.6 %, 2,000 training and 2,000 test samples drawn from the seed) and `digits`
(8x8, 1437 / 360, clean labels); and the same digits as MNIST files (28x28, 1500 / 297, as
bench/tagi/tagi_stability.py writes them) for the registry's `tagi-cnn`, 3 epochs, 3 seeds, auto
against probit; and digits with 2, 10 and 30 % of the training and test labels flipped to
another class (3 seeds), each link, auto's choice and the torch MLP. Every MLP run: the registry's MLP (2 ReLU layers of 128), batch
32, one permutation per epoch from `numpy.random.default_rng(seed)`, float32, one thread; 20
epochs on blobs, 10 on digits (the demo's). ECE is `dptrain.learners.calibration`'s (10
equal-width bins of the top class probability), the figure the learner reports.

Candidates:
- `tagi-mlp default (auto)`: the registry's TAGI MLP through its learner with every default
  (σ_v 0.05, `hrc_link` auto), and the link it chose (`link` per seed);
- `torch-mlp`: the registry's torch MLP, cross-entropy, Adam at dptrain's default 3e-3 (the
  reference the issue compares with);
- `hrc sv=S link=L`: the hierarchical softmax trained with σ_v S, its class probabilities by
  link L from the same trained network: `probit` (pytagi's Φ(m / sqrt(1/9 + v))) or `mean`
  (E[clip((1 + Z)/2, 0, 1)], Z ~ N(m, v));
- `remax sv=S`: a Remax head on 3 (10) outputs with one-hot observations, its mean as the
  class probabilities;
- `bayes` (blobs only): the true class probabilities, the floor that finite test sets allow.

The per-node table (`nodes`) is the mechanism: on the test set, the observed HRC nodes of
the σ_v 0.05 network grouped by |m|, with the share on the right side beside what each link
says. On blobs the share follows (1 + |m|)/2; the probit link says 0.98-1.0 from |m| = 0.6 on.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dptrain.data import ArrayDataset, load_dataset
from dptrain.data.datasets.blobs import bayes_probabilities
from dptrain.data.loader import fetch_batch
from dptrain.runtime import Runtime, means
from dptrain.runtime.env import SINGLE
from dptrain.learners.build import create_learner
from dptrain.learners.calibration import (calibration_sums, expected_calibration_error,
                                          pop_calibration)
from dptrain.learners.config import LearnerConfig, ModelConfig
from dptrain.models import ModelOptions, build_model
from dptrain.tagi import HRCSoftmax, Linear, OutputUpdater, ReLU, Remax, Sequential, manual_seed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS, command_line, git_describe, hardware, write_json  # noqa: E402
from common.digit_files import write_mnist_digits  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "tagi_calibration.json"
BATCH, HIDDEN = 32, 128
EPOCHS = {"blobs": 20, "digits": 10}
SIGMAS = (0.05, 0.5)
LINKS = ("probit", "mean")
MNIST_EPOCHS, MNIST_SEEDS = 3, 3
NOISE_RATES, NOISY_SEEDS = (0.02, 0.1, 0.3), 3
NODE_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 1.0, float("inf"))


def scores(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """ECE, error and mean top probability of (N, K) class probabilities."""
    sums = calibration_sums(probs, labels)
    means = {name: s / n for name, (s, n) in sums.items()}
    ece = expected_calibration_error(pop_calibration(means))
    conf, predicted = probs.max(1)
    return {"ece": ece, "error": (predicted != labels).double().mean().item(),
            "confidence": conf.double().mean().item()}


def batches(num: int, rng: np.random.Generator):
    perm = torch.as_tensor(rng.permutation(num))
    for start in range(0, num, BATCH):
        yield perm[start:start + BATCH]


def train_tagi(split, seed: int, sigma_v: float, head: str, epochs: int) -> Sequential:
    x, y = split.train.x, split.train.y
    k, width = split.num_classes, split.input_shape[0]
    manual_seed(seed)
    if head == "hrc":
        hrc = HRCSoftmax(k)
        net = build_model("tagi-mlp", split.input_shape, hrc.num_outputs,
                          ModelOptions(hidden=HIDDEN))
    else:  # the registry has no Remax model: the same MLP with a Remax head
        net = Sequential(Linear(width, HIDDEN), ReLU(), Linear(HIDDEN, HIDDEN), ReLU(),
                         Linear(HIDDEN, k), Remax())
    updater = OutputUpdater(net.device)
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        net.train()
        for b in batches(len(x), rng):
            net(x[b])
            if head == "hrc":
                obs, idx = hrc.encode(y[b])
                updater.update_using_indices(net.output_z_buffer, obs, sigma_v**2, idx,
                                             net.input_delta_z_buffer)
            else:
                onehot = nn.functional.one_hot(y[b], k).float()
                updater.update(net.output_z_buffer, onehot, sigma_v**2,
                               net.input_delta_z_buffer)
            net.backward()
            net.step()
    net.eval()
    return net


def train_torch(split, seed: int, epochs: int) -> nn.Module:
    x, y = split.train.x, split.train.y
    torch.manual_seed(seed)
    net = build_model("torch-mlp", split.input_shape, split.num_classes,
                      ModelOptions(hidden=HIDDEN))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        for b in batches(len(x), rng):
            loss = nn.functional.cross_entropy(net(x[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net.eval()


def train_default(split, seed: int, epochs: int, model: str = "tagi-mlp", **learner_options
                  ) -> tuple[str, torch.Tensor]:
    """A registry model through its learner (defaults: `hrc_link` auto), driven as the Trainer
    drives it on one process with no validation part (auto: the training labels choose):
    (the link it chose, its test class probabilities)."""
    learner = create_learner(ModelConfig(model=model), LearnerConfig(**learner_options), split,
                             seed=seed)
    learner.setup(Runtime(SINGLE, None, torch.device("cpu"), timedelta(seconds=60)))
    rng = np.random.default_rng(seed)
    for epoch in range(epochs):
        learner.set_epoch(epoch)
        sums: dict[str, tuple[float, float]] = {}
        for b in batches(len(split.train), rng):
            for name, (s, c) in learner.train_step(fetch_batch(split.train, 0, b)).items():
                total = sums.get(name, (0.0, 0.0))
                sums[name] = (total[0] + s, total[1] + c)
        learner.end_training(means(sums))
    x_test, y_test = fetch_batch(split.test, 0, torch.arange(len(split.test)))
    # No validation part here: the test evaluation applies the choice the last epoch's
    # training labels made (a test part chooses nothing), as in a library run without one.
    learner.end_evaluation(means(learner.eval_step((x_test, y_test))))
    learner.net.eval()
    with torch.no_grad():
        mu, var = (t.double() for t in learner.net(x_test))
    return learner.hrc.link, learner.hrc.probabilities(mu, var)


def node_table(hrc: HRCSoftmax, mu: torch.Tensor, var: torch.Tensor, labels: torch.Tensor
               ) -> list[dict[str, float]]:
    """The observed nodes of the test set by |m|: count, share right, each link's value."""
    obs, idx = hrc.encode(labels)
    m = mu.gather(1, idx - 1).flatten()
    v = var.gather(1, idx - 1).flatten()
    right = (torch.sign(m) == obs.flatten().to(m.dtype)).double()
    # a node's probability of the side its mean points to, as each link gives it
    side = torch.sign(m)
    link_values = {}
    for link in LINKS:
        # K = 2 has one node, so its class 0 probability is the node's P(+1)
        p_plus = HRCSoftmax(2, link=link).probabilities(m[:, None], v[:, None])[:, 0]
        link_values[link] = torch.where(side > 0, p_plus, 1 - p_plus)
    rows = []
    for low, high in zip(NODE_EDGES[:-1], NODE_EDGES[1:]):
        inside = (m.abs() >= low) & (m.abs() < high)
        if inside.any():
            rows.append({"abs_m_low": low, "abs_m_high": high, "count": int(inside.sum()),
                         "share_right": right[inside].mean().item(),
                         **{f"{link}_link": link_values[link][inside].double().mean().item()
                            for link in LINKS}})
    return rows


def run_dataset(name: str, seeds: int) -> tuple[dict[str, list[dict]], list[dict]]:
    """Per candidate the seeds' scores; the node table of seed 0's σ_v 0.05 network."""
    results: dict[str, list[dict]] = {}
    nodes: list[dict] = []
    epochs = EPOCHS[name]
    for seed in range(seeds):
        split = load_dataset(name, seed=seed) if name == "blobs" else load_dataset(name)
        x_te, y_te = split.test.x, split.test.y
        add = lambda key, s: results.setdefault(key, []).append({"seed": seed, **s})  # noqa
        start = time.perf_counter()
        if name == "blobs":
            add("bayes", scores(bayes_probabilities(x_te), y_te))
        reference = train_torch(split, seed, epochs)
        with torch.no_grad():
            add("torch-mlp", scores(torch.softmax(reference(x_te).double(), 1), y_te))
        link, probs = train_default(split, seed, epochs)
        add("tagi-mlp default (auto)", {**scores(probs, y_te), "link": link})
        for sigma_v in SIGMAS:
            net = train_tagi(split, seed, sigma_v, "hrc", epochs)
            mu, var = (t.double() for t in net(x_te))
            for link in LINKS:
                hrc = HRCSoftmax(split.num_classes, link=link)
                add(f"hrc sv={sigma_v} link={link}", scores(hrc.probabilities(mu, var), y_te))
            if seed == 0 and sigma_v == SIGMAS[0]:
                nodes = node_table(HRCSoftmax(split.num_classes), mu, var, y_te)
            net = train_tagi(split, seed, sigma_v, "remax", epochs)
            mu_a, _ = net(x_te)
            probs = mu_a.double().clamp_min(0)
            add(f"remax sv={sigma_v}", scores(probs / probs.sum(1, keepdim=True), y_te))
        print(f"{name} seed {seed}: {time.perf_counter() - start:.1f} s", flush=True)
    return results, nodes


def with_flipped_labels(split, rate: float, seed: int):
    """The split with a share `rate` of its training and of its test labels replaced by
    another class, drawn uniformly (the same draw for every model)."""
    g = torch.Generator().manual_seed(1000 + seed)

    def flip(labels: torch.Tensor) -> torch.Tensor:
        labels = labels.clone()
        hit = torch.rand(len(labels), generator=g) < rate
        shift = torch.randint(1, split.num_classes, (int(hit.sum()),), generator=g)
        labels[hit] = (labels[hit] + shift) % split.num_classes
        return labels

    return dataclasses.replace(
        split, train=ArrayDataset(split.train.x, flip(split.train.y)),
        test=ArrayDataset(split.test.x, flip(split.test.y)))


def run_noisy_digits(seeds: int) -> dict[str, list[dict]]:
    """Digits with 2, 10 and 30 % of the labels flipped (train and test): the registry's TAGI
    MLP with each link and auto's choice, beside the torch MLP; 10 epochs."""
    results: dict[str, list[dict]] = {}
    clean = load_dataset("digits")
    for rate in NOISE_RATES:
        for seed in range(seeds):
            split = with_flipped_labels(clean, rate, seed)
            y_te = split.test.y
            for link in ("auto", "mean", "probit"):
                chosen, probs = train_default(split, seed, EPOCHS["digits"], hrc_link=link)
                results.setdefault(f"flipped {rate:.0%} tagi-mlp hrc_link={link}", []).append(
                    {"seed": seed, **scores(probs, y_te), "link": chosen})
            reference = train_torch(split, seed, EPOCHS["digits"])
            with torch.no_grad():
                probs = torch.softmax(reference(split.test.x).double(), 1)
            results.setdefault(f"flipped {rate:.0%} torch-mlp", []).append(
                {"seed": seed, **scores(probs, y_te)})
        print(f"digits with {rate:.0%} flipped: done", flush=True)
    return results


def run_mnist_digits(seeds: int) -> dict[str, list[dict]]:
    """The registry's tagi-cnn on the digits as MNIST files (28x28), 3 epochs: auto against
    pytagi's probit, the accuracy the default must keep."""
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        split = load_dataset(f"mnist:{write_mnist_digits(Path(tmp) / 'mnist')}")
        labels = fetch_batch(split.test, 0, torch.arange(len(split.test)))[1]
        for seed in range(seeds):
            start = time.perf_counter()
            for link in ("auto", "probit"):
                chosen, probs = train_default(split, seed, MNIST_EPOCHS, "tagi-cnn",
                                              hrc_link=link)
                results.setdefault(f"tagi-cnn hrc_link={link}", []).append(
                    {"seed": seed, **scores(probs, labels), "link": chosen})
            print(f"mnist-digits seed {seed}: {time.perf_counter() - start:.1f} s", flush=True)
    return results


def summarise(runs: list[dict]) -> dict[str, float]:
    out = {}
    for key in ("ece", "error", "confidence"):
        values = [r[key] for r in runs]
        out[f"{key}_mean"] = statistics.fmean(values)
        out[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
    links = sorted({r["link"] for r in runs if "link" in r})
    if links:
        out["links_chosen"] = links
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    p.add_argument("--no-json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    record = {}
    for name in ("blobs", "digits"):
        runs, nodes = run_dataset(name, args.seeds)
        summary = {key: summarise(r) for key, r in runs.items()}
        record[name] = {"epochs": EPOCHS[name], "summary": summary, "runs": runs,
                        "nodes_sv0.05_seed0": nodes}
        print(f"\n{name} ({args.seeds} seeds, {EPOCHS[name]} epochs)   ECE          error"
              f"          confidence")
        for key, s in summary.items():
            print(f"  {key:26s} {s['ece_mean']:.3f} ± {s['ece_std']:.3f}  "
                  f"{100 * s['error_mean']:5.2f} ± {100 * s['error_std']:.2f} %  "
                  f"{s['confidence_mean']:.3f}")
        print("  nodes by |m| (σ_v 0.05, seed 0): count, share right, probit, mean link")
        for row in nodes:
            print(f"    {row['abs_m_low']:.2f}-{row['abs_m_high']:.2f} {row['count']:6d} "
                  f"{row['share_right']:.3f} {row['probit_link']:.3f} {row['mean_link']:.3f}")
    runs = run_noisy_digits(min(args.seeds, NOISY_SEEDS))
    summary = {key: summarise(r) for key, r in runs.items()}
    record["digits_flipped_labels"] = {"epochs": EPOCHS["digits"], "summary": summary,
                                       "runs": runs}
    print(f"\ndigits with flipped labels ({min(args.seeds, NOISY_SEEDS)} seeds)")
    for key, s in summary.items():
        print(f"  {key:36s} ECE {s['ece_mean']:.3f} ± {s['ece_std']:.3f}  "
              f"error {100 * s['error_mean']:5.2f} %  link {s.get('links_chosen', '')}")
    runs = run_mnist_digits(min(args.seeds, MNIST_SEEDS))
    summary = {key: summarise(r) for key, r in runs.items()}
    record["mnist_digits"] = {"epochs": MNIST_EPOCHS, "summary": summary, "runs": runs}
    print(f"\nMNIST-format digits ({min(args.seeds, MNIST_SEEDS)} seeds, tagi-cnn, "
          f"{MNIST_EPOCHS} epochs)")
    for key, s in summary.items():
        print(f"  {key:26s} ECE {s['ece_mean']:.3f}  error {100 * s['error_mean']:.2f} %  "
              f"link {s.get('links_chosen')}")
    if not args.no_json:
        write_json(args.output, {"command": command_line(), "seeds": args.seeds,
                                 "batch_size": BATCH, "hidden": HIDDEN, **record,
                                 "hardware": hardware(), "git": git_describe()})


if __name__ == "__main__":
    main()
