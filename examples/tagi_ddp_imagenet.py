"""TAGI ResNet18 on ImageNet, data-parallel: pytagi's DDP ImageNet example, ported.

    mpirun -np 2 python examples/tagi_ddp_imagenet.py --data ~/data/imagenet   # train/, val/
    torchrun --standalone --nproc-per-node 2 examples/tagi_ddp_imagenet.py --data DIR
    dptrain run -n 2 examples/tagi_ddp_imagenet.py --tiny     # 40 synthetic 128x128 images

As pytagi's example: an image folder (DIR/train/<class>/*.JPEG, DIR/val/<class>/...), random
resized crops of 224 and flips for training, resize to 256 and centre crop for evaluation,
ImageNet's normalisation, DataLoader workers, batch 128 per rank, σ_v 0.1, gains 0.1, deltas
averaged over ranks (`--sum` for the update of one process on the global batch). The network is
pytagi's ImageNet ResNet18 (the registry's tagi-resnet18 at 224 pixels) where pytagi's script
uses its AlexNet. Every rank reads only its shard; the test error counts every image once.
"""

import argparse
import tempfile

from tqdm import tqdm

from dptrain.data import ShardedSampler, load_dataset
from dptrain.data.datasets.synthetic import write_synthetic_image_folder
from dptrain.data.loader import BatchLoader
from dptrain.runtime import means, rank_zero_print, reduce_sum_count
from dptrain.models import ModelOptions, build_model
from dptrain.tagi import HRCSoftmax, OutputUpdater, manual_seed
from dptrain.tagi.ddp import DDPConfig, DDPSequential

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--data", metavar="DIR", help="image folder with train/ and val/")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=128, help="per rank")
parser.add_argument("--image-size", type=int, default=224)
parser.add_argument("--workers", type=int, default=4, help="decoding processes per rank")
parser.add_argument("--sigma-v", type=float, default=0.1, help="observation noise std")
parser.add_argument("--gain", type=float, default=0.1, help="initial weight std gain")
parser.add_argument("--width", type=int, default=64, help="channels of the first stage")
parser.add_argument("--sum", action="store_true", help="sum the deltas over ranks instead of "
                    "averaging them (pytagi's default)")
parser.add_argument("--tiny", action="store_true", help="synthetic images, 128 px, width 4")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

config = DDPConfig.from_env(backend="auto")
if args.tiny:  # every rank writes the same files (same seed) to a directory of its own
    tiny_dir = tempfile.TemporaryDirectory(prefix="imagenet-tiny-")  # removed at exit
    args.data, args.epochs, args.width, args.batch_size = tiny_dir.name, 1, 4, 8
    args.image_size, args.workers = 128, 1
    write_synthetic_image_folder(args.data, num_train=40, num_test=21, size=144)
elif not args.data:
    parser.error("--data DIR is required (or --tiny)")
split = load_dataset(f"imagefolder:{args.data}", image_size=args.image_size,
                     mean="0.485,0.456,0.406", std="0.229,0.224,0.225")
train = split.train.with_augmentation(seed=args.seed)  # random resized crop + flip
hrc = HRCSoftmax(num_classes=split.num_classes)

manual_seed(args.seed)  # every rank builds the same net; DDPSequential broadcasts rank 0's anyway
net = build_model("tagi-resnet18", split.input_shape, hrc.num_outputs,
                  ModelOptions(width=args.width, gain_weight=args.gain))
ddp = DDPSequential(net, config, average=not args.sum)
updater = OutputUpdater(ddp.device)

# Sum mode: the epoch's last global batch is split as it falls (a rank may get fewer samples,
# or none), no sample repeated; BatchNorm's statistics are the global batch's. Average mode
# normalises each rank's shard with its own statistics, which an empty shard has not: padded.
sampler = ShardedSampler(train, rank=config.rank, world_size=config.world_size, seed=args.seed,
                         uneven_last_batch=args.sum)
test_sampler = ShardedSampler(split.test, rank=config.rank, world_size=config.world_size,
                              mode="eval")
with BatchLoader(train, sampler, args.batch_size, workers=args.workers) as loader, \
        BatchLoader(split.test, test_sampler, args.batch_size, workers=args.workers) as tests:
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # the crops and flips are a function of (seed, epoch, image)
        ddp.train()
        for x, labels in tqdm(loader, desc=f"epoch {epoch + 1}", disable=config.rank != 0,
                              leave=False):
            ddp(x)
            y_obs, y_idx = hrc.encode(labels)
            updater.update_using_indices(ddp.output_z_buffer, y_obs, args.sigma_v ** 2, y_idx,
                                         ddp.input_delta_z_buffer)
            ddp.backward()
            ddp.step()

        ddp.eval()
        wrong = seen = 0
        test_sampler.set_position(0)
        for x, labels in tests:
            mu, var = ddp(x)
            wrong += int((hrc.predict(mu, var) != labels).sum())
            seen += len(labels)
        error = means(reduce_sum_count({"error": (wrong, seen)}))["error"]
        rank_zero_print(f"epoch {epoch + 1}: test error {100 * error:.2f} % "
                        f"({config.world_size} rank(s), {'sum' if args.sum else 'average'} mode)")

ddp.check_replicas()
rank_zero_print(f"replicas identical on {config.world_size} rank(s); "
                f"fingerprint {ddp.params_fingerprint()[:16]}")
