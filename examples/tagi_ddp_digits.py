"""Data-parallel TAGI classification, written as a pytagi user would: forward, update, backward,
step, with `DDPSequential` all-reducing the parameter deltas before every step.

    dptrain run -n 2 examples/tagi_ddp_digits.py
    torchrun --standalone --nproc-per-node 2 examples/tagi_ddp_digits.py
    mpirun -np 2 python examples/tagi_ddp_digits.py
    dptrain run -n 2 examples/tagi_ddp_digits.py --mnist ~/data/mnist   # MNIST IDX files

Each rank trains on its own disjoint shard; the test error is reduced exactly over ranks.
"""

import argparse

from tqdm import tqdm

from dptrain.data import ArrayDataset, ShardedSampler, load_digits, load_mnist
from dptrain.runtime import means, rank_zero_print, reduce_sum_count
from dptrain.tagi import HRCSoftmax, Linear, OutputUpdater, ReLU, Sequential, manual_seed
from dptrain.tagi.ddp import DDPConfig, DDPSequential

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=16, help="per rank")
parser.add_argument("--sigma-v", type=float, default=0.05, help="observation noise std")
parser.add_argument("--average", action="store_true", help="average deltas (pytagi) "
                    "instead of summing them (equivalent to one process on the global batch)")
parser.add_argument("--mnist", metavar="DIR", help="MNIST IDX files instead of digits")
parser.add_argument("--tiny", action="store_true", help="a few hundred samples, one epoch")
parser.add_argument("--save", metavar="FILE", help="write the trained parameters (net.save)")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

config = DDPConfig.from_env(backend="auto")
split = load_mnist(args.mnist, flat=True) if args.mnist else load_digits(flat=True)
train, test = split.train, split.test
if args.tiny:  # odd sizes make the last training batch and the eval shards uneven
    train, test, args.epochs = ArrayDataset(*train[:331]), ArrayDataset(*test[:101]), 1

hrc = HRCSoftmax(num_classes=split.num_classes)
manual_seed(args.seed)  # every rank builds the same net; DDPSequential broadcasts rank 0's anyway
net = Sequential(Linear(split.input_shape[0], 128), ReLU(), Linear(128, 128), ReLU(),
                 Linear(128, hrc.num_outputs))
ddp = DDPSequential(net, config, average=args.average)
updater = OutputUpdater(ddp.device)
var_y = args.sigma_v ** 2

# The epoch's last global batch is split as it falls (a rank may get fewer samples, or none):
# no sample is repeated to even it out, so in sum mode the steps are those of one process on
# the global batch, on any number of ranks.
sampler = ShardedSampler(train, rank=config.rank, world_size=config.world_size, seed=args.seed,
                         uneven_last_batch=True)
test_sampler = ShardedSampler(test, rank=config.rank, world_size=config.world_size, mode="eval")
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    ddp.train()
    batches = tqdm(sampler.batches(args.batch_size), total=sampler.num_batches(args.batch_size),
                   desc=f"epoch {epoch + 1}", disable=config.rank != 0, leave=False)
    for idx in batches:
        x, labels = train[idx]
        ddp(x)
        y_obs, y_idx = hrc.encode(labels)
        updater.update_using_indices(ddp.output_z_buffer, y_obs, var_y, y_idx,
                                     ddp.input_delta_z_buffer)
        ddp.backward()
        ddp.step()

    ddp.eval()
    wrong = seen = 0
    for idx in test_sampler.batches(256):
        x, labels = test[idx]
        mu, var = ddp(x)
        wrong += int((hrc.predict(mu, var) != labels).sum())
        seen += len(idx)
    error = means(reduce_sum_count({"error": (wrong, seen)}))["error"]
    rank_zero_print(f"epoch {epoch + 1}: test error {100 * error:.2f} % "
                    f"({config.world_size} rank(s), {'average' if args.average else 'sum'} mode)")

ddp.check_replicas()
rank_zero_print(f"replicas identical on {config.world_size} rank(s); "
                f"fingerprint {ddp.params_fingerprint()[:16]}")
if args.save and config.rank == 0:
    net.save(args.save)
