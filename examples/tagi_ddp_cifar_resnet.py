"""TAGI ResNet18 on CIFAR-10, data-parallel, written as a pytagi user would: forward, update,
backward, step, with `DDPSequential` all-reducing the parameter deltas before every step.

    dptrain run -n 2 examples/tagi_ddp_cifar_resnet.py --data ~/data/cifar-10-batches-py
    torchrun --standalone --nproc-per-node 2 examples/tagi_ddp_cifar_resnet.py --data DIR
    mpirun -np 2 python examples/tagi_ddp_cifar_resnet.py --data DIR
    dptrain run -n 2 examples/tagi_ddp_cifar_resnet.py --tiny   # 32 synthetic images, width 4

The network is pytagi's `resnet18_cifar10`; the training images are randomly cropped (4-pixel
black padding) and flipped, the same images at any world size; σ_v follows
max(σ_v_min, σ_v · decay^epoch); each rank trains on its own shard and the test error is
reduced exactly over ranks (every test image counted once).
"""

import argparse
import tempfile

from tqdm import tqdm

from dptrain.data import ShardedSampler, load_cifar10
from dptrain.data.datasets.synthetic import write_synthetic_cifar10
from dptrain.runtime import means, rank_zero_print, reduce_sum_count
from dptrain.tagi import (AvgPool2d, BatchNorm2d, Conv2d, HRCSoftmax, LayerBlock, Linear,
                          MixtureReLU, OutputUpdater, ResNetBlock, Sequential, manual_seed)
from dptrain.tagi.ddp import DDPConfig, DDPSequential

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--data", metavar="DIR", help="CIFAR-10 python or binary batches")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--sigma-v", type=float, default=0.05, help="observation noise std")
parser.add_argument("--sigma-v-min", type=float, default=0.0)
parser.add_argument("--sigma-v-decay", type=float, default=1.0)
parser.add_argument("--gain", type=float, default=0.083, help="initial weight std gain")
parser.add_argument("--width", type=int, default=64, help="channels of the first stage")
parser.add_argument("--average", action="store_true", help="average deltas (pytagi) "
                    "instead of summing them (equivalent to one process on the global batch)")
parser.add_argument("--tiny", action="store_true", help="synthetic files, width 4, one epoch")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()


def layer_block(in_c, out_c, stride=1, padding_type=1, gain=1.0):
    """Two 3x3 convolutions, each followed by MixtureReLU and BatchNorm2d."""
    return LayerBlock(
        Conv2d(in_c, out_c, 3, bias=False, stride=stride, padding=1, padding_type=padding_type,
               gain_weight=gain), MixtureReLU(), BatchNorm2d(out_c),
        Conv2d(out_c, out_c, 3, bias=False, padding=1, gain_weight=gain), MixtureReLU(),
        BatchNorm2d(out_c))


def shortcut(in_c, out_c, gain=1.0):
    """Projection where the shape changes: 2x2 stride-2 convolution."""
    return LayerBlock(Conv2d(in_c, out_c, 2, bias=False, stride=2, gain_weight=gain),
                      MixtureReLU(), BatchNorm2d(out_c))


def resnet18_cifar10(gain=1.0, width=64):
    w = width
    layers = [Conv2d(3, w, 3, bias=False, padding=1, in_width=32, in_height=32,
                     gain_weight=gain), MixtureReLU(), BatchNorm2d(w),
              ResNetBlock(layer_block(w, w, gain=gain)),
              ResNetBlock(layer_block(w, w, gain=gain))]
    for c in (w, 2 * w, 4 * w):  # 16x16, 8x8, 4x4
        layers += [ResNetBlock(layer_block(c, 2 * c, 2, 2, gain=gain), shortcut(c, 2 * c, gain)),
                   ResNetBlock(layer_block(2 * c, 2 * c, gain=gain))]
    return Sequential(*layers, AvgPool2d(4), Linear(8 * w, 11, gain_weight=gain, gain_bias=gain))


config = DDPConfig.from_env(backend="auto")
if args.tiny:  # every rank writes the same files (same seed) to a directory of its own
    tiny_dir = tempfile.TemporaryDirectory(prefix="cifar-tiny-")  # removed at exit
    args.data, args.epochs, args.width, args.batch_size = tiny_dir.name, 1, 4, 8
    write_synthetic_cifar10(args.data, num_train=36, num_test=21)  # uneven last batch, shards
elif not args.data:
    parser.error("--data DIR is required (or --tiny)")
split = load_cifar10(args.data)  # pixels stay uint8; batches come out normalised
train = split.train.with_augmentation(seed=args.seed)  # crop + flip, training images only
test = split.test

hrc = HRCSoftmax(num_classes=10)
manual_seed(args.seed)  # every rank builds the same net; DDPSequential broadcasts rank 0's anyway
net = resnet18_cifar10(gain=args.gain, width=args.width)
ddp = DDPSequential(net, config, average=args.average)
updater = OutputUpdater(ddp.device)

# Sum mode: the epoch's last global batch is split as it falls (a rank may get fewer samples,
# or none), no sample repeated; BatchNorm's statistics are the global batch's. Average mode
# normalises each rank's shard with its own statistics, which an empty shard has not: padded.
sampler = ShardedSampler(train, rank=config.rank, world_size=config.world_size, seed=args.seed,
                         uneven_last_batch=not args.average)
test_sampler = ShardedSampler(test, rank=config.rank, world_size=config.world_size, mode="eval")
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    train.set_epoch(epoch)  # the crop/flip draws are a function of (seed, epoch, image)
    sigma_v = max(args.sigma_v_min, args.sigma_v * args.sigma_v_decay ** epoch)
    ddp.train()
    batches = tqdm(sampler.batches(args.batch_size), total=sampler.num_batches(args.batch_size),
                   desc=f"epoch {epoch + 1}", disable=config.rank != 0, leave=False)
    for idx in batches:
        x, labels = train[idx]
        ddp(x)
        y_obs, y_idx = hrc.encode(labels)
        updater.update_using_indices(ddp.output_z_buffer, y_obs, sigma_v ** 2, y_idx,
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
    rank_zero_print(f"epoch {epoch + 1}: σ_v {sigma_v:.4g}, test error {100 * error:.2f} % "
                    f"({config.world_size} rank(s), {'average' if args.average else 'sum'} mode)")

ddp.check_replicas()
rank_zero_print(f"replicas identical on {config.world_size} rank(s); "
                f"fingerprint {ddp.params_fingerprint()[:16]}")
