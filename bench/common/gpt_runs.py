"""The tiny Shakespeare text and one `dptrain train` run of a GPT on it, shared by
language_models/tagi_gpt.py (tagi-gpt beside torch-gpt) and language_models/tagi_gpt_variants.py
(torch-gpt as the reference of the variants).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import REPO


def shakespeare() -> Path:
    folder = Path(os.environ.get("NANOGPT_DIR", REPO.parent / "shared" / "nanogpt"))
    text = folder / "data" / "shakespeare_char" / "input.txt"
    if not text.exists():
        sys.exit(f"{text} not found: set NANOGPT_DIR to a nanoGPT folder with the text")
    return text


def train(model: str, text: Path, args: argparse.Namespace, nproc: int, out: Path
          ) -> dict[str, float]:
    cmd = [sys.executable, "-m", "dptrain", "train", "--model", model, "--dataset",
           f"text:{text}", "--val-size", "0.1", "--block-size", str(args.block_size),
           "--width", str(args.width), "--layers", str(args.layers), "--heads", str(args.heads),
           "--batch-size", str(args.batch_size), "--max-steps", str(args.steps),
           "--val-every", str(args.steps), "--val-batches", str(args.val_batches),
           "--seed", str(args.seed), "--nproc", str(nproc),
           "--threads", str(max(1, args.threads // nproc)), "--no-progress", "--out", str(out)]
    if model == "torch-gpt":
        cmd += ["--lr-decay-steps", str(args.steps), "--warmup", str(min(100, args.steps // 10))]
    elif args.sigma_v is not None:
        cmd += ["--sigma-v", str(args.sigma_v)]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    row = {"val_loss": summary["val_loss"], "val_ece": summary["val_ece"],
           "val_error": summary["val_error"], "tokens_per_s": summary["tokens_per_s"],
           "wall_s": time.perf_counter() - started}
    print(f"{model} on {nproc} process(es): {row}", flush=True)
    return row
