"""The PyTorch DDP tutorial's toy model, data-parallel through dptrain's TorchLearner.

    dptrain run -n 2 examples/torch_toy_mlp.py
    dptrain run -n 2 examples/torch_toy_mlp.py --tiny --strategy fsdp --accumulation-steps 2
    python examples/torch_toy_mlp.py            # one process, the same code

Linear(10, 10) - ReLU - Linear(10, 5), MSE loss, SGD, on random regression data that every rank
generates identically; each rank trains on its own share of every batch.
"""

import argparse
import functools
import hashlib

import torch
from torch import nn

from dptrain.runtime import all_gather_object, distributed, means, rank_zero_print, reduce_sum_count
from dptrain.learners import TorchLearner

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--num-samples", type=int, default=4096)
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=64, help="global batch (all ranks)")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
parser.add_argument("--accumulation-steps", type=int, default=1)
parser.add_argument("--precision", choices=["32", "bf16", "fp16"], default="32")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--tiny", action="store_true", help="256 samples, 2 epochs (for tests)")
args = parser.parse_args()
if args.tiny:
    args.num_samples, args.epochs = 256, 2


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets from a fixed random teacher network plus noise, so there is something to learn."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    teacher = torch.randn(10, 5, generator=g)
    return x, torch.relu(x @ teacher) + 0.1 * torch.randn(n, 5, generator=g)


def my_batches(n: int, batch_size: int, rank: int, world_size: int, epoch: int) -> torch.Tensor:
    """(steps, batch_size // world_size) indices: one permutation shared by all ranks (seeded by
    the epoch), cut into global batches, each dealt out in equal shares; the ragged tail is
    dropped so every rank takes the same number of equal steps."""
    if batch_size % world_size:
        raise SystemExit(f"--batch-size {batch_size} must be divisible by {world_size} ranks")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + epoch))
    steps = n // batch_size
    return order[:steps * batch_size].view(steps, world_size, -1)[:, rank]


with distributed() as rt:
    rank, world_size = rt.env.rank, rt.env.world_size
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
    learner = TorchLearner(model, nn.MSELoss(), functools.partial(torch.optim.SGD, lr=args.lr),
                           strategy=args.strategy, accumulation_steps=args.accumulation_steps,
                           precision=args.precision)
    learner.setup(rt)  # moves to this rank's device, wraps in DDP/FSDP, replicas from rank 0

    x, y = make_data(args.num_samples + 512, seed=1234)
    x, y, x_test, y_test = x[512:], y[512:], x[:512], y[:512]
    rank_zero_print(f"{world_size} rank(s), {args.strategy}, global batch {args.batch_size}")
    for epoch in range(args.epochs):
        totals = {"loss": (0.0, 0.0)}
        for idx in my_batches(args.num_samples, args.batch_size, rank, world_size, epoch):
            metrics = learner.train_step((x[idx], y[idx]))
            totals["loss"] = tuple(a + b for a, b in zip(totals["loss"], metrics["loss"]))
        # Every rank evaluates its own slice of the test set once; sums over ranks are exact.
        test = learner.eval_step((x_test[rank::world_size], y_test[rank::world_size]))
        train_loss = means(reduce_sum_count(totals))["loss"]
        test_mse = means(reduce_sum_count(test))["mse"]
        rank_zero_print(f"epoch {epoch}: train loss {train_loss:.4f}  test mse {test_mse:.4f}")

    state = learner.model_state_dict()  # plain names: loads into `model` without DDP
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in state.values())).hexdigest()
    digests = all_gather_object(digest[:16])
    if len(set(digests)) != 1:
        raise SystemExit(f"rank {rank}: replicas differ: {digests}")
    rank_zero_print(f"parameters {digests[0]} identical on all {world_size} rank(s)")
