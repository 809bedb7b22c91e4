"""How long a checkpoint holds training up: written in the step (synchronous, as before issue
21) against copied to memory at the step and written in the background (the default).

    .venv/bin/python bench/distributed/checkpoint_pause.py     # bench/results/checkpoint_pause.json
    .venv/bin/python bench/distributed/checkpoint_pause.py --quick  # one repeat, fewer images, no JSON

For tagi-resnet18 and torch-resnet18 at --width 16 on synthetic CIFAR-10 files
(dptrain.data.datasets.synthetic, the real reader), one process, the library's Trainer as
`dptrain train` builds it: one epoch with a checkpoint every --every steps. Then torch-resnet18
with `--strategy fsdp` on 2 processes (spawned, gloo over a FileStore), whose checkpoints are
every rank's shards (torch.distributed.checkpoint): written in the step, or copied to memory
and written in the background by every rank (issue 40). The pause of a checkpoint is the time
`Trainer._save_checkpoint` keeps the training thread (the whole save when synchronous; the copy
of the state when asynchronous), as the Trainer records it in `checkpoint_pauses`; on 2
processes, the longer of the two ranks' pauses of each checkpoint (the next step's collectives
wait for the slower rank). The two modes alternate over the repeats (the one going first
alternates too) and a figure is the median over every checkpoint of every repeat. The step time
and the epoch's wall time are printed beside them: the background write shares the machine with
the steps, so the epoch as a whole is the honest bottom line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS as RESULTS_DIR, command_line, cpu_model  # noqa: E402

from dptrain.data.datasets.registry import load_dataset  # noqa: E402
from dptrain.data.datasets.synthetic import write_synthetic_cifar10  # noqa: E402
from dptrain.runtime import init_distributed  # noqa: E402
from dptrain.learners.build import create_learner, model_defaults  # noqa: E402
from dptrain.learners.config import LearnerConfig, ModelConfig  # noqa: E402
from dptrain.train import TrainConfig, Trainer  # noqa: E402

RESULTS = RESULTS_DIR / "checkpoint_pause.json"
MODELS = ("tagi-resnet18", "torch-resnet18")  # one process, the state file on rank 0
SHARDED = "torch-resnet18"  # --strategy fsdp on WORLD_SIZE processes, every rank its shards
WORLD_SIZE = 2
MODES = ("sync", "async")


def one_epoch(model: str, split, args, out: Path, asynchronous: bool,
              strategy: str = "ddp") -> dict:
    defaults = {k: v for k, v in model_defaults(model).items()
                if k in ModelConfig.__dataclass_fields__}
    learner = create_learner(ModelConfig(**{**defaults, "model": model, "width": args.width}),
                             LearnerConfig(strategy=strategy), split, seed=0)
    config = TrainConfig(out_dir=out, epochs=1, batch_size=args.batch_size,
                         checkpoint_every=args.every, keep_last=2, progress=False,
                         async_checkpoints=asynchronous)
    trainer = Trainer(learner, split, config, init_distributed())
    start = time.perf_counter()
    summary = trainer.fit()
    wall = time.perf_counter() - start
    newest = max((out / "checkpoints").glob("step-*"))
    return {"pauses_s": trainer.checkpoint_pauses, "epoch_wall_s": wall,
            "steps": summary["steps"],
            "checkpoint_bytes": sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())}


def _sharded_worker(rank: int, data: str, args: argparse.Namespace, tmp: str,
                    order: tuple[str, ...]) -> None:
    """One rank of the FSDP world: an epoch in each mode, in `order`; its figures to a file."""
    torch.set_num_threads(args.threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(os.path.join(tmp, "store"), WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=300))
    split = load_dataset(f"cifar10:{data}")
    runs = {mode: one_epoch(SHARDED, split, args, Path(tmp) / mode, mode == "async",
                            strategy="fsdp") for mode in order}
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(runs))
    dist.destroy_process_group()


def sharded_repeat(data: Path, args: argparse.Namespace, order: tuple[str, ...]) -> dict:
    """One world of WORLD_SIZE spawned ranks, both modes; per checkpoint the longer pause."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_sharded_worker, args=(str(data), args, tmp, order),
                           nprocs=WORLD_SIZE, start_method="spawn", join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    return {mode: {"pauses_s": [max(p) for p in zip(*(r[mode]["pauses_s"] for r in ranks))],
                   "epoch_wall_s": max(r[mode]["epoch_wall_s"] for r in ranks),
                   "steps": ranks[0][mode]["steps"],
                   "checkpoint_bytes": ranks[0][mode]["checkpoint_bytes"]} for mode in order}


def figures(runs: dict[str, list[dict]], repeats: int) -> dict:
    """Medians over every checkpoint (and epoch) of every repeat, per mode, and the ratios."""
    out: dict = {}
    for mode, done in runs.items():
        pauses = [s for run in done for s in run["pauses_s"]]
        walls = [run["epoch_wall_s"] for run in done]
        out[mode] = {"pause_median_s": statistics.median(pauses), "pause_max_s": max(pauses),
                     "checkpoints": len(pauses),
                     "epoch_wall_median_s": statistics.median(walls),
                     "steps": done[0]["steps"], "checkpoint_bytes": done[0]["checkpoint_bytes"],
                     "repeats": done}
    sync, asyn = out["sync"], out["async"]
    # The step time of the synchronous epoch with its pauses taken out.
    out["step_s_estimate"] = (sync["epoch_wall_median_s"] - sync["pause_median_s"] *
                              sync["checkpoints"] / repeats) / sync["steps"]
    out["ratio_pause_sync_over_async"] = sync["pause_median_s"] / asyn["pause_median_s"]
    out["ratio_epoch_sync_over_async"] = sync["epoch_wall_median_s"] / \
        asyn["epoch_wall_median_s"]
    return out


def report(name: str, width: int, m: dict) -> None:
    sync, asyn = m["sync"], m["async"]
    print(f"{name} (width {width}, checkpoint {sync['checkpoint_bytes'] / 1e6:.1f} MB, "
          f"~{m['step_s_estimate'] * 1e3:.0f} ms/step): pause per checkpoint "
          f"{sync['pause_median_s'] * 1e3:.0f} ms synchronous, "
          f"{asyn['pause_median_s'] * 1e3:.1f} ms asynchronous "
          f"({m['ratio_pause_sync_over_async']:.0f}x shorter; longest "
          f"{sync['pause_max_s'] * 1e3:.0f} / {asyn['pause_max_s'] * 1e3:.1f} ms); "
          f"epoch {sync['epoch_wall_median_s']:.1f} s / {asyn['epoch_wall_median_s']:.1f} s "
          f"({m['ratio_epoch_sync_over_async']:.2f}x)", flush=True)


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
    # The machine is shared: its load says how much else ran beside the measurement.
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        data = write_synthetic_cifar10(Path(tmp) / "cifar", num_train=args.num_train,
                                       num_test=64)
        split = load_dataset(f"cifar10:{data}")
        orders = [MODES if repeat % 2 == 0 else MODES[::-1] for repeat in range(args.repeats)]
        for model in MODELS:
            runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
            for repeat, order in enumerate(orders):
                for mode in order:
                    out = Path(tmp) / f"{model}-{mode}-{repeat}"
                    runs[mode].append(one_epoch(model, split, args, out, mode == "async"))
            m = {"processes": 1, "strategy": "replicated", **figures(runs, args.repeats)}
            record["models"][model] = m
            report(model, args.width, m)
        runs = {mode: [] for mode in MODES}
        for order in orders:
            for mode, run in sharded_repeat(data, args, order).items():
                runs[mode].append(run)
        m = {"processes": WORLD_SIZE, "strategy": "fsdp", **figures(runs, args.repeats)}
        record["models"][f"{SHARDED} fsdp"] = m
        report(f"{SHARDED} --strategy fsdp, {WORLD_SIZE} processes", args.width, m)
    record["load_average_1_5_15"] = {"before": load_before, "after": os.getloadavg()}
    if not args.quick:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
