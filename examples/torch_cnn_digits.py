"""A small CNN with BatchNorm on 8x8 handwritten digits, data-parallel through TorchLearner.

    dptrain run -n 2 examples/torch_cnn_digits.py
    dptrain run -n 2 examples/torch_cnn_digits.py --tiny
    dptrain run -n 2 examples/torch_cnn_digits.py --strategy fsdp --precision bf16

Conv-BN-ReLU x2, max-pool, linear head; CrossEntropy, Adam. BatchNorm statistics are taken over
the global batch (all ranks) unless --no-sync-bn. scikit-learn's digits: 1437 train / 360 test.
"""

import argparse
import functools

import torch
from torch import nn

from dptrain.data import ShardedSampler, load_digits
from dptrain.runtime import distributed, means, rank_zero_print, reduce_sum_count
from dptrain.learners import TorchLearner

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--channels", type=int, default=16)
parser.add_argument("--num-train", type=int, default=None, help="first N training images only")
parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
parser.add_argument("--accumulation-steps", type=int, default=1)
parser.add_argument("--precision", choices=["32", "bf16", "fp16"], default="32")
parser.add_argument("--no-sync-bn", action="store_true", help="per-rank BatchNorm statistics")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--tiny", action="store_true", help="1 epoch on 256 images, 4 channels")
args = parser.parse_args()
if args.tiny:
    args.epochs, args.num_train, args.channels = 1, 256, 4


def make_cnn(c: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),           # (B, c, 8, 8)
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
        nn.MaxPool2d(2),                                                      # (B, 2c, 4, 4)
        nn.Flatten(), nn.Linear(2 * c * 16, 10))                              # (B, 10) logits


with distributed() as rt:
    split = load_digits(flat=False)  # images (1, 8, 8), labels 0..9
    num_train = min(args.num_train or len(split.train), len(split.train))
    torch.manual_seed(args.seed)
    learner = TorchLearner(make_cnn(args.channels), nn.CrossEntropyLoss(),
                           functools.partial(torch.optim.Adam, lr=args.lr),
                           strategy=args.strategy, sync_batchnorm=not args.no_sync_bn,
                           accumulation_steps=args.accumulation_steps, precision=args.precision)
    learner.setup(rt)

    # Train: the same shuffled order on every rank, each rank its own equal share.
    train = ShardedSampler(num_train, seed=args.seed)
    # Eval: every test image exactly once over all ranks (shares may differ by one).
    test = ShardedSampler(len(split.test), mode="eval", shuffle=False)
    rank_zero_print(f"{rt.env.world_size} rank(s), {args.strategy}, {num_train} training images, "
                    f"batch {args.batch_size} per rank")
    for epoch in range(args.epochs):
        train.set_epoch(epoch)
        totals: dict[str, tuple[float, float]] = {}
        for idx in train.batches(args.batch_size):
            for name, (s, c) in learner.train_step(split.train[idx]).items():
                old = totals.get(name, (0.0, 0.0))
                totals[name] = (old[0] + s, old[1] + c)
        # One eval call per rank on its whole share: FSDP needs equal call counts on all ranks.
        evaluated = learner.eval_step(split.test[test.indices()])
        test_sums = reduce_sum_count(evaluated)
        train_m, test_m = means(reduce_sum_count(totals)), means(test_sums)
        rank_zero_print(f"epoch {epoch}: train loss {train_m['loss']:.4f} error "
                        f"{train_m['error']:.2%} | test loss {test_m['loss']:.4f} error "
                        f"{test_m['error']:.2%}")
    rank_zero_print(f"test error {test_m['error']:.2%} on {test_sums['error'][1]:.0f} images")
