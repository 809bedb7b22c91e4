"""How long a checkpoint holds training up: written in the step (synchronous, as before issue
21) against copied to memory at the step and written in the background (the default).

    .venv/bin/python bench/checkpoint_pause.py          # bench/results/checkpoint_pause.json
    .venv/bin/python bench/checkpoint_pause.py --quick  # one repeat, fewer images, no JSON

For tagi-resnet18 and torch-resnet18 at --width 16 on synthetic CIFAR-10 files
(dptrain.data.datasets.synthetic, the real reader), one process, the library's Trainer as
`dptrain train` builds it: one epoch with a checkpoint every --every steps. The pause of a
checkpoint is the time `Trainer._save_checkpoint` keeps the training thread (the whole save
when synchronous; the copy of the state when asynchronous), as the Trainer records it in
`checkpoint_pauses`. The two modes alternate over the repeats (the one going first alternates
too) and a figure is the median over every checkpoint of every repeat. The step time and the
epoch's wall time are printed beside them: the background write shares the machine with the
steps, so the epoch as a whole is the honest bottom line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import command_line, cpu_model  # noqa: E402

from dptrain.data.datasets.registry import load_dataset  # noqa: E402
from dptrain.data.datasets.synthetic import write_synthetic_cifar10  # noqa: E402
from dptrain.runtime import init_distributed  # noqa: E402
from dptrain.learners.build import create_learner, model_defaults  # noqa: E402
from dptrain.learners.config import LearnerConfig, ModelConfig  # noqa: E402
from dptrain.train import TrainConfig, Trainer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_pause.json"
MODELS = ("tagi-resnet18", "torch-resnet18")


def one_epoch(model: str, split, args, out: Path, asynchronous: bool) -> dict:
    defaults = {k: v for k, v in model_defaults(model).items()
                if k in ModelConfig.__dataclass_fields__}
    learner = create_learner(ModelConfig(**{**defaults, "model": model, "width": args.width}),
                             LearnerConfig(), split, seed=0)
    config = TrainConfig(out_dir=out, num_epochs=1, global_batch_size=args.batch_size,
                         checkpoint_every=args.every, keep_last=2, progress=False,
                         async_checkpoints=asynchronous)
    trainer = Trainer(learner, split, config, init_distributed())
    start = time.perf_counter()
    summary = trainer.fit()
    wall = time.perf_counter() - start
    steps = summary["steps"]
    state = max((out / "checkpoints").glob("step-*/state.pt"))
    return {"pauses_s": trainer.checkpoint_pauses, "epoch_wall_s": wall, "steps": steps,
            "state_bytes": state.stat().st_size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--num-train", type=int, default=640)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--every", type=int, default=4, help="checkpoint every this many steps")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads for the steps")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.num_train, args.repeats = 256, 1
    torch.set_num_threads(args.threads)
    record: dict = {"command": command_line(("OMP_NUM_THREADS",)), "config": vars(args),
                    "cpu": cpu_model(), "python": platform.python_version(),
                    "torch": torch.__version__, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_synthetic_cifar10(Path(tmp) / "cifar", num_train=args.num_train,
                                       num_test=64)
        split = load_dataset(f"cifar10:{data}")
        for model in MODELS:
            runs: dict[str, list[dict]] = {"sync": [], "async": []}
            for repeat in range(args.repeats):
                order = ("sync", "async") if repeat % 2 == 0 else ("async", "sync")
                for mode in order:
                    out = Path(tmp) / f"{model}-{mode}-{repeat}"
                    runs[mode].append(one_epoch(model, split, args, out, mode == "async"))
            figures = {}
            for mode, done in runs.items():
                pauses = [s for run in done for s in run["pauses_s"]]
                walls = [run["epoch_wall_s"] for run in done]
                figures[mode] = {"pause_median_s": statistics.median(pauses),
                                 "pause_max_s": max(pauses), "checkpoints": len(pauses),
                                 "epoch_wall_median_s": statistics.median(walls),
                                 "steps": done[0]["steps"], "state_bytes": done[0]["state_bytes"],
                                 "repeats": done}
            sync, asyn = figures["sync"], figures["async"]
            steps = sync["steps"]
            # The step time of the synchronous epoch with its pauses taken out.
            step_s = (sync["epoch_wall_median_s"] - sync["pause_median_s"] *
                      sync["checkpoints"] / args.repeats) / steps
            figures["ratio_pause_sync_over_async"] = sync["pause_median_s"] / \
                asyn["pause_median_s"]
            figures["ratio_epoch_sync_over_async"] = sync["epoch_wall_median_s"] / \
                asyn["epoch_wall_median_s"]
            figures["step_s_estimate"] = step_s
            record["models"][model] = figures
            print(f"{model} (width {args.width}, state {sync['state_bytes'] / 1e6:.1f} MB, "
                  f"~{step_s * 1e3:.0f} ms/step): pause per checkpoint "
                  f"{sync['pause_median_s'] * 1e3:.0f} ms synchronous, "
                  f"{asyn['pause_median_s'] * 1e3:.1f} ms asynchronous "
                  f"({figures['ratio_pause_sync_over_async']:.0f}x shorter; longest "
                  f"{sync['pause_max_s'] * 1e3:.0f} / {asyn['pause_max_s'] * 1e3:.1f} ms); "
                  f"epoch {sync['epoch_wall_median_s']:.1f} s / "
                  f"{asyn['epoch_wall_median_s']:.1f} s "
                  f"({figures['ratio_epoch_sync_over_async']:.2f}x)", flush=True)
    if not args.quick:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
