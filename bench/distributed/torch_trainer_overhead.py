"""dptrain's Trainer + TorchLearner vs a hand-written torch DDP loop: the cost of the framework.

    .venv/bin/python bench/distributed/torch_trainer_overhead.py   # full run, writes the JSON below
    .venv/bin/python bench/distributed/torch_trainer_overhead.py --quick  # smoke run, writes nothing

Both sides train the same MLP 784-1024-1024-10 (ReLU, CrossEntropy, Adam lr 1e-3, same initial
weights) on the same synthetic MNIST-shaped tensors (10 noisy class prototypes; no download), 2
ranks (gloo over a FileStore, CPU, 1 intra-op thread each), 128 samples per rank per step, the
same permutation per epoch (rank r takes every 2nd index from r, as dptrain's ShardedSampler
does) and the same number of steps. At the end both must hold bit-identical parameters; the
script checks it, which shows that they did the same work.

Side by side: each repeat is one world of 2 freshly spawned ranks that holds both models. The
real `Trainer.fit()` runs; a wrapper around its `learner.train_step` also runs one step of the
hand-written loop just before or just after each dptrain step (alternating), so the two sides'
steps are paired within a fraction of a second and see the same load from the other users of
this shared 2-core machine. Timing whole runs one after the other instead gave per-repeat ratios
from 0.93 to 1.22 here; interleaved steps give about +-2%. Figures are medians over the repeats.

What is timed (per rank; per epoch the slower rank counts; epoch 1 is a warm-up, not counted):
- "train epochs" (the target ratio). dptrain: the wall time of `Trainer._train_epoch` minus the
  hand-written steps run inside it, i.e. its sampler, batch gather, `TorchLearner.train_step`
  (with its per-step loss/error host sync), metric sums and the epoch-end metric all-reduce, plus
  the wrapper's own few microseconds per step (charged to dptrain). Hand-written: randperm,
  slicing, zero_grad/forward/loss/backward/step, loss and error summed as tensors, and one
  all-reduce of them at the epoch end.
- "whole run" (informational, not like for like). dptrain: `fit()` (seeding, `learner.setup` =
  DDP wrap, every epoch with evaluation, an atomic fsync'ed checkpoint and its copy as `best/`,
  CSV, TensorBoard, then the learning-curve PNG and summary.json) minus everything of the
  hand-written side run inside it. Hand-written: DDP wrap + every epoch with the same evaluation
  (test set split over the ranks, all-reduced) and a rank-0 `torch.save` of model and optimizer
  state (no fsync) followed by a barrier. Both exclude the ~5 s import of torch._dynamo that the
  first DDP construction in a process triggers (done before any clock starts).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS, cpu_model  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "torch_trainer_overhead.json"
HAND, DPTRAIN = "hand-written DDP", "dptrain Trainer"
CONFIGS = (HAND, DPTRAIN)
WHOLE_RUN_PARTS = {HAND: ("whole_run_s", "setup_s", "eval_s", "checkpoint_s"),
                   DPTRAIN: ("whole_run_s", "eval_s", "checkpoint_s", "rest_s")}
TARGET = 1.03  # issue 7: time with dptrain / time hand-written, train epochs
WORLD_SIZE = 2
LR = 1e-3
SEED = 0
TEST_SAMPLES = 2048
EVAL_BATCH = 512  # the TrainConfig default, used by both sides


def _model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


def _data(num_train: int) -> tuple[torch.Tensor, ...]:
    """MNIST-shaped (N, 784) inputs in [0, 1]: a class prototype plus noise; labels (N,)."""
    g = torch.Generator().manual_seed(1234)
    protos = 0.5 + 0.1 * torch.rand(10, 784, generator=g)
    out = []
    for n in (num_train, TEST_SAMPLES):
        y = torch.randint(0, 10, (n,), generator=g)
        x = (protos[y] + 0.5 * torch.randn(n, 784, generator=g)).clamp_(0, 1)
        out += [x, y]
    return tuple(out)


class HandWritten:
    """A plain torch DDP training loop, written as one would without a framework. Its loop body
    is `step()`, so that the benchmark can interleave its steps with the Trainer's."""

    def __init__(self, rank: int, batch: int, data: tuple, run_dir: Path) -> None:
        self.rank, self.batch, self.run_dir = rank, batch, run_dir
        self.x_train, self.y_train, self.x_test, self.y_test = data
        self.model = _model()
        self.loss_fn = nn.CrossEntropyLoss()

    def setup(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.ddp = DDP(self.model)
        self.opt = torch.optim.Adam(self.ddp.parameters(), lr=LR)

    def start_epoch(self, epoch: int) -> None:
        self.ddp.train()
        g = torch.Generator().manual_seed(SEED + epoch)
        self.mine = torch.randperm(self.x_train.shape[0], generator=g)[self.rank::WORLD_SIZE]
        self.pos = 0
        self.sums = torch.zeros(2, dtype=torch.float64)

    def step(self) -> None:
        idx = self.mine[self.pos:self.pos + self.batch]
        self.pos += self.batch
        x, y = self.x_train[idx], self.y_train[idx]
        self.opt.zero_grad(set_to_none=True)
        out = self.ddp(x)
        loss = self.loss_fn(out, y)
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            self.sums += torch.stack([loss.double() * len(idx),
                                      (out.argmax(1) != y).sum().double()])

    def end_epoch(self) -> tuple[float, float]:
        """Mean train loss and error over all ranks: one all-reduce."""
        if self.pos < len(self.mine):
            raise RuntimeError(f"hand-written epoch ran {self.pos} of {len(self.mine)} samples")
        dist.all_reduce(self.sums)
        loss, error = (self.sums / self.x_train.shape[0]).tolist()
        return loss, error

    def evaluate(self) -> float:
        """Test error: rank r takes every 2nd test sample from r; sums all-reduced."""
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64)
        step = WORLD_SIZE * EVAL_BATCH
        with torch.no_grad():
            for i in range(self.rank, self.x_test.shape[0], step):
                x, y = self.x_test[i:i + step:WORLD_SIZE], self.y_test[i:i + step:WORLD_SIZE]
                out = self.model(x)
                sums += torch.tensor([float((out.argmax(1) != y).sum()), float(len(y))],
                                     dtype=torch.float64)
        dist.all_reduce(sums)
        return (sums[0] / sums[1]).item()

    def save(self, epoch: int) -> None:
        if self.rank == 0:
            torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                        "epoch": epoch}, self.run_dir / "hand_checkpoint.pt")
        dist.barrier()


def _timed(fn, into: list[float]):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t)
    return wrapper


def _worker(rank: int, repeat: int, batch: int, steps: int, epochs: int, tmp: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(os.path.join(tmp, "store"), WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=300))
    importlib.import_module("torch._dynamo")  # DDP's first construction imports it (~5 s here)
    from dptrain.data import ArrayDataset, Split
    from dptrain.runtime import init_distributed
    from dptrain.learners import TorchLearner
    from dptrain.train import TrainConfig, Trainer, params_sha256

    data = _data(steps * batch * WORLD_SIZE)
    run_dir = Path(tmp)

    hand = HandWritten(rank, batch, data, run_dir)
    dist.barrier()
    t = time.perf_counter()
    hand.setup()
    hand_setup = time.perf_counter() - t

    runtime = init_distributed()  # adopts the running group
    split = Split(name="synthetic-mnist", train=ArrayDataset(data[0], data[1]),
                  test=ArrayDataset(data[2], data[3]), task="classification", num_classes=10)
    learner = TorchLearner(_model(), nn.CrossEntropyLoss(),
                           functools.partial(torch.optim.Adam, lr=LR))
    config = TrainConfig(out_dir=run_dir / "run", epochs=epochs,
                         batch_size=batch * WORLD_SIZE, seed=SEED, resume="never",
                         eval_batch_size=EVAL_BATCH, progress=False)
    trainer = Trainer(learner, split, config, runtime)

    hand_train, hand_eval, hand_save, hand_history = [], [], [], []
    dp_train, dp_eval, dp_ckpt = [], [], []
    clock = {"steps": 0, "hand_steps_s": 0.0, "harness_s": 0.0}
    train_step, train_epoch = learner.train_step, trainer._train_epoch

    def hand_step() -> None:
        t = time.perf_counter()
        hand.step()
        clock["hand_steps_s"] += time.perf_counter() - t

    def paired_step(batch):
        """The Trainer's step and one hand-written step, in alternating order."""
        hand_first = (clock["steps"] + repeat) % 2 == 0
        clock["steps"] += 1
        if hand_first:
            hand_step()
        out = train_step(batch)
        if not hand_first:
            hand_step()
        return out

    def paired_epoch():
        """One epoch of both sides, then the hand-written evaluation and checkpoint."""
        t0 = time.perf_counter()
        epoch = trainer.epoch
        dist.barrier()
        t = time.perf_counter()
        hand.start_epoch(epoch)
        hand_s = time.perf_counter() - t
        clock["hand_steps_s"] = 0.0
        t = time.perf_counter()
        out = train_epoch()
        dp_train.append(time.perf_counter() - t - clock["hand_steps_s"])
        t = time.perf_counter()
        loss, error = hand.end_epoch()
        hand_train.append(hand_s + clock["hand_steps_s"] + time.perf_counter() - t)
        t = time.perf_counter()
        hand_history.append({"train_loss": loss, "train_error": error,
                             "test_error": hand.evaluate()})
        hand_eval.append(time.perf_counter() - t)
        t = time.perf_counter()
        hand.save(epoch)
        hand_save.append(time.perf_counter() - t)
        clock["harness_s"] += time.perf_counter() - t0 - dp_train[-1]
        return out

    learner.train_step = paired_step
    trainer._train_epoch = paired_epoch
    trainer._evaluate = _timed(trainer._evaluate, dp_eval)
    trainer._save_checkpoint = _timed(trainer._save_checkpoint, dp_ckpt)
    dist.barrier()
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the per-epoch lines rank 0 prints
        trainer.fit()
    dp_whole = time.perf_counter() - t - clock["harness_s"]
    dp_history = [{k: r[k] for k in ("train_loss", "train_error", "test_error")}
                  for r in trainer.history]
    result = {
        HAND: {"epoch_s": hand_train, "eval_s": sum(hand_eval), "checkpoint_s": sum(hand_save),
               "setup_s": hand_setup, "history": hand_history,
               "whole_run_s": hand_setup + sum(hand_train) + sum(hand_eval) + sum(hand_save),
               "params_sha256": params_sha256(hand.model.state_dict())},
        DPTRAIN: {"epoch_s": dp_train, "eval_s": sum(dp_eval), "checkpoint_s": sum(dp_ckpt),
                  "rest_s": dp_whole - sum(dp_train) - sum(dp_eval) - sum(dp_ckpt),
                  "history": dp_history, "whole_run_s": dp_whole,
                  "params_sha256": params_sha256(learner.model_state_dict())}}
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def measure(repeat: int, batch: int, steps: int, epochs: int) -> dict:
    """One world of 2 spawned ranks running both sides; per side, the slower rank's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(repeat, batch, steps, epochs, tmp), nprocs=WORLD_SIZE,
                           start_method="spawn", join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    samples = WORLD_SIZE * batch * steps * (epochs - 1)
    out = {}
    for side in CONFIGS:
        rs = [r[side] for r in ranks]
        if len({r["params_sha256"] for r in rs}) != 1:
            raise RuntimeError(f"{side}: the ranks ended with different parameters")
        per_epoch = [max(e) for e in zip(*(r["epoch_s"] for r in rs))]
        timed = sum(per_epoch[1:])  # epoch 1 is the warm-up
        out[side] = {"train_epochs_s": timed, "samples_per_s": samples / timed,
                     "epoch_s": per_epoch, "params_sha256": rs[0]["params_sha256"],
                     "history": rs[0]["history"],
                     **{key: max(r[key] for r in rs) for key in WHOLE_RUN_PARTS[side]}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=4, help="epochs, the first one warm-up")
    parser.add_argument("--repeats", type=int, default=7, help="worlds, each running both sides")
    parser.add_argument("--quick", action="store_true", help="few steps, no results file")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.epochs, args.repeats = 5, 2, 1
    if args.epochs < 2:
        parser.error("--epochs must be >= 2 (the first one is a warm-up)")
    runs: list[dict] = []
    for repeat in range(args.repeats):
        runs.append(measure(repeat, args.batch, args.steps, args.epochs))
        h, d = runs[-1][HAND], runs[-1][DPTRAIN]
        print(f"repeat {repeat + 1}/{args.repeats}: train epochs {h['train_epochs_s']:.2f} s "
              f"hand-written, {d['train_epochs_s']:.2f} s dptrain, ratio "
              f"{d['train_epochs_s'] / h['train_epochs_s']:.3f}; whole run "
              f"{h['whole_run_s']:.2f} s vs {d['whole_run_s']:.2f} s", flush=True)

    def median(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in runs)

    med = {side: {key: median(side, key)
                  for key in ("samples_per_s", "train_epochs_s", "whole_run_s")}
           for side in CONFIGS}
    ratios = [r[DPTRAIN]["train_epochs_s"] / r[HAND]["train_epochs_s"] for r in runs]
    ratio = statistics.median(ratios)
    ratio_of_medians = med[HAND]["samples_per_s"] / med[DPTRAIN]["samples_per_s"]
    epoch_ratios = [d / h for r in runs
                    for h, d in zip(r[HAND]["epoch_s"][1:], r[DPTRAIN]["epoch_s"][1:])]
    whole_ratio = statistics.median(r[DPTRAIN]["whole_run_s"] / r[HAND]["whole_run_s"]
                                    for r in runs)
    same = {r[side]["params_sha256"] for r in runs for side in CONFIGS}
    timed_steps = args.steps * (args.epochs - 1)
    parts = {side: {key: median(side, key) for key in WHOLE_RUN_PARTS[side]} for side in CONFIGS}

    print(f"\nMLP 784-1024-1024-10, Adam, {WORLD_SIZE} ranks x 1 thread (gloo, CPU), "
          f"{args.batch} samples per rank per step, {args.steps} steps per epoch, "
          f"{args.epochs} epochs (epoch 1 warm-up, not timed), median of {args.repeats} repeats")
    print(f"{'':<18}{'train epochs':>14}{'samples/s':>11}{'ms/step':>9}{'whole run':>11}")
    for side in CONFIGS:
        m = med[side]
        print(f"{side:<18}{m['train_epochs_s']:>12.2f} s{m['samples_per_s']:>11.0f}"
              f"{1000 * m['train_epochs_s'] / timed_steps:>9.1f}{m['whole_run_s']:>9.2f} s")
    print(f"\ntrain epochs = each epoch's step loop + its epoch-end metric all-reduce, epochs "
          f"2-{args.epochs}, the two sides' steps interleaved in the same processes:")
    print(f"  time dptrain / time hand-written = {ratio:.3f} (median of {len(ratios)} per-repeat "
          f"ratios, range {min(ratios):.3f}-{max(ratios):.3f}; ratio of the medians "
          f"{ratio_of_medians:.3f}; median of {len(epoch_ratios)} per-epoch ratios "
          f"{statistics.median(epoch_ratios):.3f})")
    print(f"  target <= {TARGET}: {'met' if ratio <= TARGET else 'NOT met'}")
    print(f"whole run (informational, not like for like) = dptrain fit() [setup, eval, atomic "
          f"fsync'ed checkpoints + best/ copy, CSV, TensorBoard, plot, summary] / hand-written "
          f"[DDP wrap, eval, rank-0 torch.save]: {whole_ratio:.3f}")
    h, d = parts[HAND], parts[DPTRAIN]
    print(f"  over {args.epochs} epochs, besides training: hand-written DDP wrap "
          f"{h['setup_s']:.2f} s, eval {h['eval_s']:.2f} s, torch.save + barrier "
          f"{h['checkpoint_s']:.2f} s; dptrain eval {d['eval_s']:.2f} s, checkpoints "
          f"{d['checkpoint_s']:.2f} s, the rest of fit() {d['rest_s']:.2f} s (setup, CSV, "
          f"TensorBoard, learning-curve PNG, summary)")
    last = runs[0]
    print(f"final parameters identical on both sides in every repeat: "
          f"{'yes' if len(same) == 1 else 'NO'}; last epoch train loss / test error "
          f"{last[HAND]['history'][-1]['train_loss']:.4f} / "
          f"{last[HAND]['history'][-1]['test_error']:.4f} (hand-written), "
          f"{last[DPTRAIN]['history'][-1]['train_loss']:.4f} / "
          f"{last[DPTRAIN]['history'][-1]['test_error']:.4f} (dptrain)")
    if len(same) != 1:
        raise SystemExit("the two sides did not train the same model: the comparison is void")
    if args.quick:
        return
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "hardware": {"cpu": cpu_model(), "cores": os.cpu_count(),
                     "load_average_after": os.getloadavg()},
        "torch": torch.__version__, "python": platform.python_version(),
        "model": "MLP 784-1024-1024-10 (ReLU), CrossEntropy, Adam lr 1e-3",
        "data": f"synthetic MNIST-shaped, {args.steps * args.batch * WORLD_SIZE} train / "
                f"{TEST_SAMPLES} test",
        "world_size": WORLD_SIZE, "threads_per_rank": 1, "backend": "gloo",
        "batch_per_rank": args.batch, "steps_per_epoch": args.steps, "epochs": args.epochs,
        "timed_epochs": args.epochs - 1, "repeats": args.repeats,
        "timed": {
            "train_epochs": "epochs 2..E, each side's step loop + epoch-end metric all-reduce "
                            "(dptrain: Trainer._train_epoch wall time minus the hand-written "
                            "steps run inside it); per epoch the slower rank; one world per "
                            "repeat runs both, one hand-written step just before or after "
                            "each dptrain step, alternating",
            "whole_run": "dptrain: Trainer.fit() (setup, epochs, eval, checkpoints, CSV, "
                         "TensorBoard, plot, summary) minus the hand-written epochs run inside "
                         "it; hand-written: DDP wrap + epochs with eval, rank-0 torch.save and a "
                         "barrier; slower rank; informational"},
        "results": {side: med[side] for side in CONFIGS},
        "train_epochs_time_ratio": ratio, "train_epochs_time_ratios_per_repeat": ratios,
        "train_epochs_time_ratio_of_medians": ratio_of_medians,
        "train_epochs_time_ratio_per_epoch_median": statistics.median(epoch_ratios),
        "whole_run_time_ratio": whole_ratio, "whole_run_parts_s": parts,
        "target_ratio": TARGET, "target_met": ratio <= TARGET,
        "identical_final_parameters": len(same) == 1,
        "per_repeat": [{side: {k: v for k, v in r[side].items() if k != "history"}
                        for side in CONFIGS} for r in runs]}, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
