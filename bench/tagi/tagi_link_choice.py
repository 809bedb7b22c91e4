"""How surely each rule picks TAGI's better-calibrated class-probability link (`--hrc-link
auto`): over seeds and hidden sizes, on overlapping classes (blobs), clean digits and the
digits as MNIST files.

    .venv/bin/python bench/tagi/tagi_link_choice.py              # about a minute, one thread
    .venv/bin/python bench/tagi/tagi_link_choice.py --quick --no-json

writes bench/results/tagi_link_choice.json.

Every run is the `Trainer` with the registry's TAGI model and defaults (`dptrain train`'s):
batch 32, σ_v 0.05, 10 % of the training part held out as the validation part by the run's
seed (200 samples on blobs, 144 on digits, 150 on MNIST-format digits), one process, one
thread; 3 epochs (blobs also 20 with hidden 128, where a network has begun to fit the noisy
training labels). After the last epoch each rule's pick is read from the same network:

- `val_confidence_gap`: the link whose mean top-class probability is nearer the validation
  accuracy (the learner's rule);
- `val_log_likelihood`: the link under which the validation labels are likelier;
- `val_brier`: the link with the lower Brier score on the validation part;
- `train_log_likelihood`: the link under which the last epoch's training labels were likelier,
  each scored before its update (the rule for a run without a validation part).

The right pick is the link with the lower test ECE (the test part judges, it chooses nothing).
Per data set and rule: how many runs picked it; the learner's own choice (`chosen`) and the test
ECE it gives, beside each fixed link's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from dptrain.data import load_dataset
from dptrain.data.datasets.holdout import hold_out
from dptrain.data.loader import fetch_batch
from dptrain.runtime import init_distributed
from dptrain.learners.build import create_learner
from dptrain.learners.calibration import (calibration_sums, expected_calibration_error,
                                          pop_calibration)
from dptrain.learners.config import LearnerConfig, ModelConfig
from dptrain.tagi import HRCSoftmax
from dptrain.tagi.hrc_softmax import LINKS
from dptrain.train.trainer import TrainConfig, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS, command_line, git_describe, hardware, write_json  # noqa: E402
from common.digit_files import write_mnist_digits  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "tagi_link_choice.json"
RULES = ("val_confidence_gap", "val_log_likelihood", "val_brier", "train_log_likelihood")
PLAN = {  # name: (data set, model, hidden sizes, seeds, epochs)
    "blobs": ("blobs", "tagi-mlp", (32, 64, 128), range(5), 3),
    "blobs, 20 epochs": ("blobs", "tagi-mlp", (128,), range(5), 20),
    "digits": ("digits", "tagi-mlp", (32, 64, 128), range(3), 3),
    "mnist-digits": ("mnist-digits", "tagi-cnn", (128,), range(2), 3),
}


def _ece(probs: torch.Tensor, labels: torch.Tensor) -> float:
    sums = calibration_sums(probs, labels)
    return expected_calibration_error(pop_calibration({k: s / c for k, (s, c) in sums.items()}))


def _scores(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Higher is better for each: −confidence gap, log-likelihood, −Brier score."""
    conf = probs.max(1).values.double().mean().item()
    acc = (probs.argmax(1) == labels).double().mean().item()
    true_p = probs.gather(1, labels.long().reshape(-1, 1)).clamp_min(1e-12)
    one_hot = torch.nn.functional.one_hot(labels.long(), probs.shape[1]).to(probs.dtype)
    return {"val_confidence_gap": -abs(conf - acc),
            "val_log_likelihood": true_p.log().mean().item(),
            "val_brier": -((probs - one_hot) ** 2).sum(1).mean().item()}


def _probabilities(learner, part) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    x, y = fetch_batch(part, 0, torch.arange(len(part)))
    learner.net.eval()
    with torch.no_grad():
        mu, var = (t.double() for t in learner.net(x))
    learner.net.train()
    return {link: HRCSoftmax(learner.hrc.num_classes, link=link).probabilities(mu, var)
            for link in LINKS}, y


def run_one(split, model: str, hidden: int, seed: int, epochs: int, out: Path) -> dict:
    split = hold_out(split, 0.1, seed=seed)
    learner = create_learner(ModelConfig(model=model, hidden=hidden), LearnerConfig(), split,
                             seed=seed)
    train_scores: dict[str, float] = {}
    end_training = learner.end_training

    def keep_scores(means: dict[str, float]) -> dict[str, float]:
        train_scores.update({link: means[f"_hrc_link_log_likelihood_{link}"] for link in LINKS})
        return end_training(means)

    learner.end_training = keep_scores
    config = TrainConfig(out_dir=out, epochs=epochs, seed=seed, progress=False,
                         async_checkpoints=False, keep_last=1)
    Trainer(learner, split, config, init_distributed()).fit()
    val_probs, y_val = _probabilities(learner, split.validation)
    test_probs, y_test = _probabilities(learner, split.test)
    val = {link: _scores(val_probs[link], y_val) for link in LINKS}
    picks = {rule: max(LINKS, key=lambda link: (val[link][rule], link))
             for rule in RULES[:-1]}
    picks["train_log_likelihood"] = max(LINKS, key=lambda link: (train_scores[link], link))
    test_ece = {link: _ece(test_probs[link], y_test) for link in LINKS}
    return {"hidden": hidden, "seed": seed, "chosen": learner.hrc.link, "picks": picks,
            "right": min(LINKS, key=lambda link: test_ece[link]),
            "test_ece": test_ece, "val": val, "train_log_likelihood": train_scores}


def summarise(runs: list[dict]) -> dict:
    chosen_ece = [r["test_ece"][r["chosen"]] for r in runs]
    return {"runs": len(runs),
            "right_picks": {rule: sum(r["picks"][rule] == r["right"] for r in runs)
                            for rule in RULES},
            "chosen": {link: sum(r["chosen"] == link for r in runs) for link in LINKS},
            "test_ece_chosen_mean": statistics.fmean(chosen_ece),
            **{f"test_ece_{link}_mean": statistics.fmean(r["test_ece"][link] for r in runs)
               for link in LINKS}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one seed and hidden size per data set")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    p.add_argument("--no-json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    record: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (dataset, model, hiddens, seeds, epochs) in PLAN.items():
            if args.quick:
                hiddens, seeds = hiddens[:1], seeds[:1]
            runs = []
            for hidden in hiddens:
                for seed in seeds:
                    if dataset == "mnist-digits":
                        split = load_dataset(f"mnist:{write_mnist_digits(Path(tmp) / 'mnist')}")
                    else:
                        split = load_dataset(dataset,
                                             **({"seed": seed} if dataset == "blobs" else {}))
                    run = run_one(split, model, hidden, seed, epochs,
                                  Path(tmp) / f"{dataset}-{epochs}-{hidden}-{seed}")
                    runs.append(run)
                    print(f"{name} hidden {hidden} seed {seed}: chose {run['chosen']}, right "
                          f"{run['right']} (test ECE mean {run['test_ece']['mean']:.3f}, probit "
                          f"{run['test_ece']['probit']:.3f}); picks {run['picks']}", flush=True)
            record[name] = {"dataset": dataset, "model": model, "epochs": epochs,
                            "summary": summarise(runs), "runs": runs}
            s = record[name]["summary"]
            print(f"{name}: right picks of {s['runs']}: {s['right_picks']}; test ECE chosen "
                  f"{s['test_ece_chosen_mean']:.3f} (mean link {s['test_ece_mean_mean']:.3f}, "
                  f"probit {s['test_ece_probit_mean']:.3f})\n", flush=True)
    if not args.no_json:
        write_json(args.output, {"command": command_line(), "val_fraction": 0.1, **record,
                                 "hardware": hardware(), "git": git_describe()})


if __name__ == "__main__":
    main()
