"""pytagi 0.2.1's tutorials 01-03 (regression, heteroscedastic regression, LSTM), seeded, on
dptrain.pytagi (imports rewritten) and on the pytagi wheel (unchanged), side by side.

    bash bench/pytagi/setup_pytagi.sh
    DPTRAIN_PYTAGI_PROGRAMS=<cuTAGI v0.2.1 checkout> \\
        .venv/bin/python bench/pytagi/pytagi_tutorials_vs_wheel.py   # writes bench/results/*.json

Each notebook runs as a script of its code cells (bench/common/pytagi_port.py), with the
seed set before it starts by a sitecustomize on PYTHONPATH (`torch.manual_seed` for dptrain,
`pytagi.manual_seed` for the wheel; the notebooks seed numpy only). Per seed the two runs
alternate. Reported per notebook and figure (the last epoch's training MSE; the test MSE and
log-likelihood where the notebook prints them): the mean and standard deviation over the seeds
on each side, and the difference of the means in standard errors (|Δ| / sqrt(s₁²/n + s₂²/n));
the issue asks for at most 2.5.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import (PYTAGI_VENV, RESULTS, command_line, hardware,  # noqa: E402
                    setup_pytagi_venv, write_json)
from common.pytagi_port import port_tree  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "pytagi_tutorials_vs_wheel.json"
NOTEBOOKS = ["TAGI_Tutorial_01_1D_toy_regression", "TAGI_Tutorial_02_1D_toy_regression_heteros",
             "TAGI_Tutorial_03_LSTM"]
FIGURES = {"train_mse": re.compile(r"Epoch (\d+)/\1\| mse:\s*([-\d.]+)"),
           "test_mse": re.compile(r"Test MSE:\s*([-\d.]+)"),
           "test_log_likelihood": re.compile(r"Test Log-Likelihood:\s*([-\d.]+)")}
SEED_HOOK = {"dptrain": "import torch\ntorch.manual_seed({seed})\n",
             "wheel": "import pytagi\npytagi.manual_seed({seed})\n"}
LIMIT_SE = 2.5
#: How the run was started, without the machine's path to the programs.
COMMAND = "DPTRAIN_PYTAGI_PROGRAMS=<cuTAGI v0.2.1 checkout> " + command_line()


def prepare(programs: Path, root: Path) -> dict[str, Path]:
    trees = {}
    for side, rewrite in (("dptrain", True), ("wheel", False)):
        tree = root / side
        port_tree(programs, tree, rewrite=rewrite)
        for csv in (tree / "data" / "toy_time_series").glob("*.csv"):  # tutorial 03's wget
            (tree / "docs" / "tutorials" / csv.name).write_bytes(csv.read_bytes())
        trees[side] = tree
    return trees


def run_once(side: str, tree: Path, notebook: str, seed: int, hook_dir: Path) -> dict:
    hook_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(SEED_HOOK[side].format(seed=seed))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "MPLBACKEND": "Agg",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{hook_dir}{os.pathsep}{tree}"}
    if side == "wheel":
        python = PYTAGI_VENV / "bin" / "python"
        env["LD_LIBRARY_PATH"] = str(sorted(PYTAGI_VENV.glob(
            "lib/python*/site-packages/nvidia/nccl/lib"))[-1])
    else:
        python = Path(sys.executable)
    done = subprocess.run([str(python), f"{notebook}.py"], cwd=tree / "docs" / "tutorials",
                          env=env, capture_output=True, text=True, timeout=1800)
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{side} {notebook} seed {seed} failed:\n{text[-2000:]}")
    found = {}
    for name, pattern in FIGURES.items():
        hits = pattern.findall(text)
        if hits:
            last = hits[-1]
            found[name] = float(last[-1] if isinstance(last, tuple) else last)
    return found


def compare(ours: list[float], theirs: list[float]) -> dict:
    a, b = np.array(ours), np.array(theirs)
    se = float(np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b)))
    diff = float(a.mean() - b.mean())
    in_se = abs(diff) / se if se > 0 else (0.0 if diff == 0 else float("inf"))
    return {"dptrain_mean": float(a.mean()), "dptrain_std": float(a.std(ddof=1)),
            "wheel_mean": float(b.mean()), "wheel_std": float(b.std(ddof=1)),
            "difference": diff, "difference_in_se": in_se, "within": in_se <= LIMIT_SE,
            "dptrain": ours, "wheel": theirs}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", type=Path, default=os.environ.get("DPTRAIN_PYTAGI_PROGRAMS"),
                   help="a checkout of cuTAGI's tag v0.2.1 (or DPTRAIN_PYTAGI_PROGRAMS)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--notebooks", nargs="+", default=NOTEBOOKS)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    if args.programs is None or not (args.programs / "docs" / "tutorials").is_dir():
        p.error("--programs (or DPTRAIN_PYTAGI_PROGRAMS) must name a checkout of cuTAGI v0.2.1")
    setup_pytagi_venv()
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = prepare(args.programs, Path(tmp))
        for notebook in args.notebooks:
            runs: dict[str, list[dict]] = {"dptrain": [], "wheel": []}
            for k, seed in enumerate(args.seeds):
                order = ("dptrain", "wheel") if k % 2 == 0 else ("wheel", "dptrain")
                for side in order:
                    runs[side].append(run_once(side, trees[side], notebook, seed,
                                               Path(tmp) / f"hook-{side}"))
                    print(f"{notebook} seed {seed} {side}: {runs[side][-1]}", flush=True)
            names = [n for n in FIGURES if all(n in r for r in runs["dptrain"] + runs["wheel"])]
            results[notebook] = {n: compare([r[n] for r in runs["dptrain"]],
                                            [r[n] for r in runs["wheel"]]) for n in names}
            write_json(args.output, {"command": COMMAND,
                                     "hardware": hardware(), "seeds": args.seeds,
                                     "limit_difference_in_se": LIMIT_SE, "results": results})
    print(f"\n{'notebook':45} {'figure':20} {'dptrain':>16} {'wheel':>16} {'Δ/SE':>6}")
    for notebook, figures in results.items():
        for name, c in figures.items():
            print(f"{notebook:45} {name:20} {c['dptrain_mean']:8.4f} ± {c['dptrain_std']:.4f}"
                  f" {c['wheel_mean']:8.4f} ± {c['wheel_std']:.4f} {c['difference_in_se']:6.2f}")
    print(f"wrote {args.output}")  # after every notebook, so a failure keeps what was done


if __name__ == "__main__":
    main()
