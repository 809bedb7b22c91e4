"""What pruning saves on a real search: the same `dptrain tune` search (same space, sampler and
seed, same number of trials) with successive-halving pruning and without, compared on the
process-hours and trials each needed to reach the same best value.

    .venv/bin/python bench/distributed/tune_pruning.py            # bench/results/tune_pruning.json
    .venv/bin/python bench/distributed/tune_pruning.py --quick    # 4 trials of 3 epochs, no JSON

Each trial is a real `dptrain train` run (tagi-mlp on digits, one process), started by the
search. "The same best value" is the worse of the two searches' best values: the level both
reached; each search's cost is what it had spent (process-hours, trials) when it first reached
it. The monitored metric is --monitor (train_error by default: the digits runs report no
validation metric here; pass val_error where the runs report it).
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS as RESULTS_DIR, command_line, cpu_model  # noqa: E402

from dptrain.tune import TuneOptions, tune  # noqa: E402

RESULTS = RESULTS_DIR / "tune_pruning.json"
SPACE = ("sigma_v=float:0.05:2.0", "hidden=choice:16,64,256", "batch_size=choice:16,32,128")


def search(out: Path, pruner: str, args: argparse.Namespace) -> list[dict]:
    options = TuneOptions(out=str(out), space=SPACE, monitor=args.monitor, pruner=pruner,
                          sampler_seed=0, max_trials=args.trials)
    tune(options, {"model": "tagi-mlp", "dataset": "digits", "nproc": 1,
                   "epochs": args.epochs, "seed": 0}, say=lambda line: print(f"  {line}"))
    with open(out / "trials.csv", newline="") as f:
        return list(csv.DictReader(f))


def cost_to_reach(rows: list[dict], level: float) -> dict:
    """Process-hours and trials spent, in trial order, until a trial's value first reached
    `level` (minimised metric)."""
    spent = 0.0
    for i, row in enumerate(rows, 1):
        spent += float(row["process_hours"])
        if row["state"] == "COMPLETE" and float(row["value"]) <= level:
            return {"process_hours": spent, "trials": i}
    return {"process_hours": spent, "trials": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--monitor", default="train_error")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.epochs = 4, 3
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pruner in ("none", "halving"):
            print(f"search with pruner {pruner}:")
            found[pruner] = search(Path(tmp) / pruner, pruner, args)
    bests = {p: min(float(r["value"]) for r in rows if r["state"] == "COMPLETE")
             for p, rows in found.items()}
    level = max(bests.values())
    reach = {p: cost_to_reach(rows, level) for p, rows in found.items()}
    total = {p: sum(float(r["process_hours"]) for r in rows) for p, rows in found.items()}
    pruned = sum(r["state"] == "PRUNED" for r in found["halving"])
    ratio = reach["halving"]["process_hours"] / reach["none"]["process_hours"]
    whole = total["halving"] / total["none"]
    print(f"best {args.monitor}: {bests['none']:.4f} without pruning, {bests['halving']:.4f} "
          f"with ({pruned} of {args.trials} trials pruned)")
    print(f"to reach {level:.4f}: {reach['none']['process_hours']:.4f} process-hours "
          f"({reach['none']['trials']} trials) without pruning, "
          f"{reach['halving']['process_hours']:.4f} ({reach['halving']['trials']} trials) with: "
          f"x{ratio:.2f}; the whole search: x{whole:.2f} of the process-hours")
    if args.quick:
        return
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "command": command_line(("OMP_NUM_THREADS",)), "cpu": cpu_model(),
        "python": platform.python_version(), "torch": torch.__version__,
        "space": SPACE, "monitor": args.monitor, "trials": args.trials, "epochs": args.epochs,
        "best": bests, "level": level, "to_reach_level": reach, "process_hours": total,
        "pruned_trials": pruned, "process_hours_ratio_to_reach": ratio,
        "process_hours_ratio_whole_search": whole,
        "trial_rows": found,
    }, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
