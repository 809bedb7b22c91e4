"""tagi-gpt beside torch-gpt: the same text, windows, sizes, steps, batches and machine.

    .venv/bin/python bench/language_models/tagi_gpt.py     # the recorded run (see --help for sizes)
    .venv/bin/python bench/language_models/tagi_gpt.py --quick  # 20 steps, writes no JSON

The text is the tiny Shakespeare of nanoGPT's folder (NANOGPT_DIR, else a `shared/nanogpt`
folder beside the repository: data/shakespeare_char/input.txt), read by both as `text:FILE`
(characters, the last 10 % the validation part). Both models have the same width, blocks, heads
and context (by default nanoGPT's CPU model of bench/language_models/gpt_vs_nanogpt.py) and train for the same steps on the same windows (the same seed); torch-gpt with its
nanoGPT recipe (AdamW, cosine schedule), tagi-gpt with no optimizer at all (`--sigma-v`, the
observation noise of its hierarchical softmax, is its one setting). Each runs on 1 and on 2
processes (`--nproc 2`, the same global batch). Measured at the last step, on the same
`--val-batches` fixed validation batches: the loss in nats per token, the expected calibration
error of the next-token probabilities (15 bins), and the training tokens per second.

The goal: tagi-gpt's ECE below torch-gpt's at a validation loss within 5 % of it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS, command_line, cpu_model  # noqa: E402
from common.gpt_runs import shakespeare, train  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "tagi_gpt.json"
LOSS_WITHIN = 1.05  # the goal: tagi-gpt's loss at most 5 % above torch-gpt's ...
# ... with a lower ECE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--val-batches", type=int, default=40)
    parser.add_argument("--sigma-v", type=float, default=None,
                        help="tagi-gpt's observation noise (default: the model's, 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="intra-op threads of one process (2 processes: half each)")
    parser.add_argument("--quick", action="store_true", help="20 steps, no JSON")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.val_batches = 20, 4
    text = shakespeare()
    runs: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tagi-gpt-bench-") as tmp:
        for nproc in (1, 2):
            for model in ("torch-gpt", "tagi-gpt"):
                runs[f"{model}_{nproc}proc"] = train(model, text, args, nproc,
                                                     Path(tmp) / f"{model}-{nproc}")
    tagi, torch_ = runs["tagi-gpt_1proc"], runs["torch-gpt_1proc"]
    result = {
        "benchmark": "tagi_gpt", "command": command_line(("NANOGPT_DIR",)),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "config": {k: getattr(args, k) for k in ("steps", "width", "layers", "heads",
                                                  "block_size", "batch_size", "val_batches",
                                                  "sigma_v", "seed", "threads")},
        "runs": runs,
        "loss_ratio": tagi["val_loss"] / torch_["val_loss"],
        "ece_ratio": tagi["val_ece"] / torch_["val_ece"],
        "tokens_per_s_ratio": tagi["tokens_per_s"] / torch_["tokens_per_s"],
        "tagi_2proc_over_1proc": runs["tagi-gpt_2proc"]["tokens_per_s"] / tagi["tokens_per_s"],
        "torch_2proc_over_1proc": runs["torch-gpt_2proc"]["tokens_per_s"]
        / torch_["tokens_per_s"],
    }
    result["goal_met"] = (tagi["val_ece"] < torch_["val_ece"]
                          and result["loss_ratio"] <= LOSS_WITHIN)
    print(f"after {args.steps} steps on 1 process: validation loss tagi-gpt {tagi['val_loss']:.4f}"
          f" / torch-gpt {torch_['val_loss']:.4f} = {result['loss_ratio']:.3f}; ECE "
          f"{tagi['val_ece']:.4f} / {torch_['val_ece']:.4f}; tokens/s "
          f"{result['tokens_per_s_ratio']:.3f}x torch-gpt's; goal (ECE lower, loss within "
          f"{LOSS_WITHIN}x) {'met' if result['goal_met'] else 'not met'}")
    if not args.quick:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
