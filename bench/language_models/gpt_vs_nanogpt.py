"""dptrain's torch-gpt against nanoGPT's own train.py: the same recipe, data, machine and threads.

    .venv/bin/python bench/language_models/gpt_vs_nanogpt.py  # 3 seeds x 2000 steps, ~15 min on 2 cores
    .venv/bin/python bench/language_models/gpt_vs_nanogpt.py --quick  # 60 steps, one seed, writes no JSON

nanoGPT's folder (karpathy/nanoGPT, with the tiny Shakespeare text as
data/shakespeare_char/input.txt) comes from NANOGPT_DIR, else a `shared/nanogpt` folder beside
the repository, and is copied to a temporary folder, where its own
`data/shakespeare_char/prepare.py` writes train.bin, val.bin and meta.pkl from the text (with a
stand-in `requests` module on its path: the text is already there, nothing is downloaded).
dptrain trains on those very files (`--dataset tokens:DIR`), so both see the same 65 characters
and the same 90/10 split.

The configuration is nanoGPT's CPU run of the character-level Shakespeare model: context 64,
batch 12, 4 layers, 4 heads, width 128, no dropout, AdamW lr 1e-3 with beta2 0.99 and weight
decay 0.1 on matrices only, 100 warm-up steps, cosine to 1e-4 at step 2000, gradient clipping 1.0.

Measured, per seed, interleaved (the side that goes first alternates):
- validation loss at the last step, two ways. Each side's own figure: nanoGPT's estimate
  (`eval_iters` random batches) and dptrain's `--val-batches` fixed batches; these are a few
  thousand tokens each, drawn differently. And the figure the target is judged on: both final
  models scored here by one function on every window of the validation part (val.bin cut into
  consecutive windows of the context length, about 111 000 tokens), so that both sides are
  measured on the same tokens. nanoGPT seeds itself with a constant, so its runs differ only in
  time; dptrain takes the seed.
- time per training step on one process, both on the same intra-op threads (`--threads`):
  nanoGPT's per-iteration times (the iterations that evaluated left out, and the first),
  dptrain's training time over its steps (validation points and checkpoints left out). The
  figure is the median over seeds of each seed's ratio dptrain / nanoGPT (target: within
  1.05): a seed's two runs are back to back, so a burst of other load on this shared machine
  moves one seed's ratio, not the figure.
- tokens per second on 2 processes (`--nproc 2`, the same global batch; the first seed) beside
  1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import REPO, RESULTS, command_line, cpu_model  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "gpt_vs_nanogpt.json"
LOSS_MARGIN = 0.02   # dptrain's mean validation loss may exceed nanoGPT's by at most this
TIME_TARGET = 1.05   # dptrain's time per step / nanoGPT's
EVAL_BATCHES = 20
MODEL = dict(block_size=64, batch_size=12, n_layer=4, n_head=4, n_embd=128)


def nanogpt_source() -> Path:
    found = Path(os.environ.get("NANOGPT_DIR", REPO.parent / "shared" / "nanogpt"))
    if not (found / "train.py").exists():
        sys.exit(f"nanoGPT's train.py not found in {found}: set NANOGPT_DIR to a nanoGPT checkout")
    return found


def prepare(source: Path, work: Path) -> Path:
    """nanoGPT copied to `work`, its shakespeare_char data prepared by its own script."""
    nano = work / "nanogpt"
    shutil.copytree(source, nano)
    for path in nano.rglob("*"):
        path.chmod(path.stat().st_mode | 0o200)
    stub = work / "stub"
    stub.mkdir()
    (stub / "requests.py").write_text('"""Not used: input.txt is already there."""\n')
    data = nano / "data" / "shakespeare_char"
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(stub)})
    return nano


def run_nanogpt(nano: Path, steps: int, warmup: int, eval_every: int, threads: int, out: Path
                ) -> dict[str, float]:
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu",
           "--compile=False", f"--eval_iters={EVAL_BATCHES}", "--log_interval=1",
           f"--eval_interval={eval_every}", f"--max_iters={steps}",
           f"--lr_decay_iters={steps}", f"--warmup_iters={warmup}", "--dropout=0.0",
           f"--out_dir={out}", "--always_save_checkpoint=True",
           *(f"--{k}={v}" for k, v in MODEL.items())]
    done = _run(cmd, cwd=nano, threads=threads)
    times = {int(m[1]): float(m[2]) / 1000 for m in
             re.finditer(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", done.stdout, re.M)}
    losses = {int(m[1]): float(m[2]) for m in
              re.finditer(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)", done.stdout, re.M)}
    step_times = [t for i, t in times.items() if i > 0 and i % eval_every != 0]
    if max(losses) != steps:
        sys.exit(f"nanoGPT evaluated last at step {max(losses)}, not {steps}: "
                 f"--eval-every must divide --steps")
    return {"val_loss": losses[steps], "step_s": statistics.fmean(step_times),
            "whole_val_loss": whole_validation_loss(nanogpt_model(nano, out), nano)}


def nanogpt_model(nano: Path, out: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    """nanoGPT's model at its last evaluation (`always_save_checkpoint`: the weights after
    every training step before the last evaluation, as dptrain's last checkpoint), built by its
    own model.py."""
    sys.path.insert(0, str(nano))
    try:
        from model import GPT, GPTConfig  # nanoGPT's, from the copy
    finally:
        sys.path.remove(str(nano))
    saved = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=False)
    model = GPT(GPTConfig(**saved["model_args"]))
    model.load_state_dict(saved["model"])
    model.eval()
    return lambda x: model(x, x)[0]  # given targets, nanoGPT returns logits at every position


def dptrain_model(out: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    """dptrain's model at its last checkpoint (the end of training)."""
    from dptrain import load_run
    model = load_run(out, which="last").model
    model.eval()
    return model


@torch.no_grad()
def whole_validation_loss(logits_of: Callable[[torch.Tensor], torch.Tensor], nano: Path
                          ) -> float:
    """Mean cross-entropy in nats per token over val.bin cut into consecutive windows of the
    context length (each window's targets: its tokens shifted by one)."""
    block = MODEL["block_size"]
    ids = torch.from_numpy(np.fromfile(nano / "data" / "shakespeare_char" / "val.bin",
                                       dtype=np.uint16).astype(np.int64))
    count = (len(ids) - 1) // block
    x = ids[:count * block].view(count, block)
    y = ids[1:count * block + 1].view(count, block)
    total = 0.0
    for start in range(0, count, 64):
        logits = logits_of(x[start:start + 64])
        total += F.cross_entropy(logits.flatten(0, 1).float(), y[start:start + 64].flatten(),
                                 reduction="sum").item()
    return total / y.numel()


def run_dptrain(data: Path, steps: int, warmup: int, eval_every: int, seed: int, nproc: int,
                threads: int, out: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "dptrain", "train", "--model", "torch-gpt",
           "--dataset", f"tokens:{data}", "--block-size", str(MODEL["block_size"]),
           "--batch-size", str(MODEL["batch_size"]), "--layers", str(MODEL["n_layer"]),
           "--heads", str(MODEL["n_head"]), "--width", str(MODEL["n_embd"]), "--dropout", "0",
           "--max-steps", str(steps), "--lr-decay-steps", str(steps), "--warmup", str(warmup),
           "--lr", "1e-3", "--min-lr", "1e-4", "--betas", "0.9,0.99", "--weight-decay", "0.1",
           "--clip-grad-norm", "1.0", "--val-every", str(eval_every),
           "--val-batches", str(EVAL_BATCHES), "--seed", str(seed), "--nproc", str(nproc),
           "--threads", str(max(1, threads // nproc)), "--no-progress", "--out", str(out)]
    _run(cmd)
    summary = json.loads((out / "summary.json").read_text())
    return {"val_loss": summary["val_loss"],
            "step_s": summary["train_time_s"] / summary["steps"],
            "tokens_per_s": summary["tokens_per_s"],
            "whole_val_loss": whole_validation_loss(dptrain_model(out), data.parents[1])}


def _run(cmd: list[str], cwd: Path | None = None, threads: int | None = None
         ) -> subprocess.CompletedProcess:
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="intra-op threads of one process (2 processes: half each)")
    parser.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    parser.add_argument("--eval-every", type=int, default=250, help="nanoGPT's eval_interval")
    parser.add_argument("--quick", action="store_true", help="60 steps, one seed, no JSON")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.eval_every, args.seeds = 60, 10, 30, args.seeds[:1]
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpt-bench-") as tmp:
        work = Path(tmp)
        nano = prepare(nanogpt_source(), work)
        data = nano / "data" / "shakespeare_char"
        for i, seed in enumerate(args.seeds):
            common = (args.steps, args.warmup, args.eval_every)
            sides = [("nanogpt", lambda: run_nanogpt(nano, *common, args.threads,
                                                     work / f"nano{seed}")),
                     ("dptrain", lambda: run_dptrain(data, *common, seed, 1, args.threads,
                                                     work / f"dp1-{seed}"))]
            row = {"seed": seed}
            for name, run in (sides if i % 2 == 0 else sides[::-1]):
                started = time.perf_counter()
                row[name] = run()
                print(f"seed {seed} {name}: {row[name]} ({time.perf_counter() - started:.0f} s)",
                      flush=True)
            if i == 0:  # throughput on 2 processes: one run is enough
                row["dptrain_2proc"] = run_dptrain(data, *common, seed, 2, args.threads,
                                                   work / f"dp2-{seed}")
                print(f"seed {seed} dptrain --nproc 2: {row['dptrain_2proc']}", flush=True)
            rows.append(row)
    mean = {side: {k: statistics.fmean(r[side][k] for r in rows if side in r)
                   for k in rows[0][side]} for side in ("nanogpt", "dptrain", "dptrain_2proc")}
    # Each seed's two runs ran back to back: their ratio is what the machine's load left alike;
    # the median of the seeds' ratios lets no one disturbed run decide the figure.
    ratio = statistics.median(r["dptrain"]["step_s"] / r["nanogpt"]["step_s"] for r in rows)
    margin = mean["dptrain"]["whole_val_loss"] - mean["nanogpt"]["whole_val_loss"]
    result = {
        "benchmark": "gpt_vs_nanogpt", "command": command_line(("NANOGPT_DIR",)),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "steps": args.steps, "config": MODEL, "runs": rows, "mean": mean,
        # each side's own estimate, on tokens drawn differently
        "val_loss_margin": mean["dptrain"]["val_loss"] - mean["nanogpt"]["val_loss"],
        # the target: both scored on the same tokens, every window of the validation part
        "whole_val_loss_margin": margin,
        "val_loss_target_met": margin <= LOSS_MARGIN,
        "median_step_s": {side: statistics.median(r[side]["step_s"] for r in rows)
                          for side in ("nanogpt", "dptrain")},
        "step_time_ratio": ratio, "step_time_target_met": ratio <= TIME_TARGET,
        "tokens_per_s_2proc_over_1proc": mean["dptrain_2proc"]["tokens_per_s"]
        / mean["dptrain"]["tokens_per_s"],
    }
    print(f"validation loss after {args.steps} steps, each side's own estimate: dptrain "
          f"{mean['dptrain']['val_loss']:.4f}, nanoGPT {mean['nanogpt']['val_loss']:.4f}")
    print(f"validation loss on the whole validation part: dptrain "
          f"{mean['dptrain']['whole_val_loss']:.4f}, nanoGPT "
          f"{mean['nanogpt']['whole_val_loss']:.4f} (target: <= nanoGPT + {LOSS_MARGIN})")
    print(f"time per step: dptrain / nanoGPT = {ratio:.3f} (target <= {TIME_TARGET}); "
          f"tokens/s on 2 processes / 1: {result['tokens_per_s_2proc_over_1proc']:.2f}")
    if not args.quick:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
