"""Images/s delivered by dptrain's image-folder loader vs a plain ImageFolder + DataLoader loop.

    .venv/bin/python bench/data/input_pipeline.py            # ~6 min on 2 cores, writes the JSON
    .venv/bin/python bench/data/input_pipeline.py --quick    # smoke run, writes nothing

Both sides read the same generated folder of RGB JPEGs (bench/common/image_folder.py: --images
training images of --width x --height, seeded, in a temporary directory) and deliver batches
of --batch-size float32 images (3, S, S), S = --image-size, through the same steps: Pillow
decode to RGB, random resized crop (8-100 % of the area, aspect 3/4-4/3) resized to S x S
(bilinear, antialiased), horizontal flip with probability 1/2, per-channel normalisation with
ImageNet's mean and std, default collate. With 0, 1 and 2 DataLoader worker processes:

- dptrain: `load_image_folder(...).train.with_augmentation(seed)` (the file list as one numpy
  byte array, draws from (seed, epoch, index)) through `BatchLoader(dataset, ShardedSampler,
  batch, workers=N)`, which is what `dptrain train --dataset imagefolder:DIR --workers N`
  runs on each rank.
- baseline: torchvision's `ImageFolder` + `transforms.v2` (RandomResizedCrop, RandomHorizontal-
  Flip, ToImage, ToDtype(float32, scale=True), Normalize) in `DataLoader(dataset, batch_size,
  shuffle=True, num_workers=N)` when `import torchvision` works. On this project's machines it
  does not (PyPI's torchvision wheels link a CUDA torch; ours is the CPU build), so the baseline
  is then the same thing written out: a Python list of (path, class id) built with os.walk and
  sorted(), `Image.open(f).convert("RGB")` as ImageFolder's loader does, and torchvision's v1
  ImageNet recipe (RandomResizedCrop, RandomHorizontalFlip, ToTensor, Normalize) transcribed
  from torchvision's functional code: the crop parameters drawn with torch's RNG, crop() then
  resize(), a flip when torch.rand(1) < 0.5, the uint8 HWC array permuted to a contiguous CHW
  float tensor divided by 255, then normalised on a clone. The result file says which ran.

The baseline's loader gets `persistent_workers=True` (with N > 0) like ours, so neither side
pays for starting processes in the timed passes (the plain default restarts them each epoch,
which would only slow the baseline down). Each (side, workers) configuration keeps its loader
for the whole run, makes one untimed warm-up pass, then one timed pass over all training images
per repeat; a repeat measures every configuration, dptrain and the baseline back to back for
each worker count (which goes first alternates, and the worker counts rotate), so a pair sees
the same machine load. Printed: images/s (median over repeats) per configuration and
dptrain / baseline per worker count, as the median of the per-repeat ratios (target >= 1.0),
and the CPU time per image that each side's processes (the training process and its workers,
/proc/PID/stat) spent in the pass: on a shared machine the images/s of a pass depend on what
else runs, the CPU time it takes much less.
The training process keeps torch's default threads (that of a training process on this
machine); the workers run one thread each on both sides (torch's DataLoader sets it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS, command_line  # noqa: E402
from common.image_folder import machine_record, write_image_folder  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "input_pipeline.json"
MEAN = (0.485, 0.456, 0.406)  # ImageNet's, as every torchvision recipe writes them
STD = (0.229, 0.224, 0.225)
SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
TARGET = 1.0
ENV_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")


# --------------------------------------------------------------------------------- baseline
class PlainImageFolder(Dataset):
    """torchvision's ImageFolder without torchvision: (path, class id) pairs in a Python list,
    classes from the sorted folder names, files found with os.walk, sorted."""

    def __init__(self, root: str, transform) -> None:
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.samples: list[tuple[str, int]] = []
        for label, name in enumerate(self.classes):
            for folder, _, files in sorted(os.walk(os.path.join(root, name), followlinks=True)):
                for file in sorted(files):
                    if file.lower().endswith(SUFFIXES):
                        self.samples.append((os.path.join(folder, file), label))
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        with open(path, "rb") as f:  # torchvision's pil_loader
            image = Image.open(f)
            image = image.convert("RGB")
        return self.transform(image), label


class PlainImageNetTrainTransform:
    """torchvision's Compose([RandomResizedCrop(size), RandomHorizontalFlip(), ToTensor(),
    Normalize(mean, std)]) on PIL images, transcribed from torchvision's functional code."""

    def __init__(self, size: int, mean=MEAN, std=STD) -> None:
        self.size, self.mean, self.std = size, mean, std
        self.scale, self.ratio = (0.08, 1.0), (3 / 4, 4 / 3)

    def crop_params(self, image: Image.Image) -> tuple[int, int, int, int]:
        # RandomResizedCrop.get_params
        width, height = image.size
        area = height * width
        log_ratio = torch.log(torch.tensor(self.ratio))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(*self.scale).item()
            aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                i = torch.randint(0, height - h + 1, size=(1,)).item()
                j = torch.randint(0, width - w + 1, size=(1,)).item()
                return i, j, h, w
        in_ratio = float(width) / float(height)
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h, w = height, int(round(height * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, image: Image.Image) -> torch.Tensor:
        i, j, h, w = self.crop_params(image)
        # F.resized_crop on a PIL image: crop, then resize (bilinear; Pillow antialiases)
        image = image.crop((j, i, j + w, i + h)).resize((self.size, self.size),
                                                         Image.Resampling.BILINEAR)
        if torch.rand(1) < 0.5:  # RandomHorizontalFlip
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        # ToTensor
        tensor = torch.from_numpy(np.array(image, np.uint8, copy=True))
        tensor = tensor.view(image.size[1], image.size[0], len(image.getbands()))
        tensor = tensor.permute((2, 0, 1)).contiguous().to(dtype=torch.float32).div(255)
        # Normalize (inplace=False)
        tensor = tensor.clone()
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype)
        std = torch.as_tensor(self.std, dtype=tensor.dtype)
        if (std == 0).any():
            raise ValueError("std evaluated to zero")
        return tensor.sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))


def baseline_dataset(root: Path, size: int) -> tuple[Dataset, str]:
    """The baseline's training dataset and what it is."""
    try:
        import torchvision
        from torchvision.transforms import v2
    except Exception as err:  # noqa: BLE001 - any failure to import means: not available
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return (PlainImageFolder(str(root / "train"), PlainImageNetTrainTransform(size)),
                f"plain ImageFolder + torchvision's v1 ImageNet transforms transcribed "
                f"(import torchvision failed: {reason})")
    transform = v2.Compose([v2.RandomResizedCrop(size, antialias=True),
                            v2.RandomHorizontalFlip(), v2.ToImage(),
                            v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    return (torchvision.datasets.ImageFolder(str(root / "train"), transform=transform),
            f"torchvision {torchvision.__version__} ImageFolder + transforms.v2")


# ------------------------------------------------------------------------------------ sides
CLOCK_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by the processes `pids` (all their threads)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICK


class Side:
    """One (side, workers) configuration: a loader kept for the whole run."""

    def __init__(self, side: str, workers: int, root: Path, args: argparse.Namespace) -> None:
        self.side, self.workers, self.epoch = side, workers, 0
        if side == "dptrain":
            from dptrain.data.datasets.image_folder import load_image_folder
            from dptrain.data.loader import BatchLoader
            from dptrain.data.sampler import ShardedSampler

            split = load_image_folder(root, image_size=args.image_size,
                                      mean=",".join(map(str, MEAN)), std=",".join(map(str, STD)))
            dataset = split.train.with_augmentation(seed=args.seed)
            self.sampler = ShardedSampler(dataset, rank=0, world_size=1, seed=args.seed,
                                          mode="train")
            self.loader = BatchLoader(dataset, self.sampler, args.batch_size, workers=workers)
            self.images = len(dataset)
            self.what = "dptrain ImageFolderDataset + BatchLoader"
        else:
            dataset, self.what = baseline_dataset(root, args.image_size)
            self.loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                     num_workers=workers, persistent_workers=workers > 0)
            self.images = len(dataset)

    def worker_pids(self) -> list[int]:
        loader = self.loader._loader if self.side == "dptrain" else self.loader
        iterator = getattr(loader, "_iterator", None)  # noqa: SLF001 - a benchmark's look
        return [w.pid for w in getattr(iterator, "_workers", [])]

    def one_pass(self) -> tuple[float, float, int, torch.Tensor]:
        """(seconds, CPU seconds of this process and the workers, images) of one pass over
        the training images, and its last batch."""
        if self.side == "dptrain":
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        images, x = 0, None
        pids = [os.getpid(), *self.worker_pids()]
        cpu = cpu_seconds(pids)
        start = time.perf_counter()
        for x, y in self.loader:
            images += len(y)
        seconds = time.perf_counter() - start
        return seconds, cpu_seconds(pids) - cpu, images, x

    def close(self) -> None:
        if self.side == "dptrain":
            self.loader.close()
        else:
            iterator = getattr(self.loader, "_iterator", None)
            if iterator is not None:
                iterator._shutdown_workers()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=1024, help="training images in the folder")
    p.add_argument("--width", type=int, default=256, help="width of the JPEGs")
    p.add_argument("--height", type=int, default=256, help="height of the JPEGs")
    p.add_argument("--image-size", type=int, default=224, help="S: the crops are S x S")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 256 images, 2 repeats; writes nothing")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args()
    if args.quick:
        args.images, args.repeats = 256, 2
    tmp = Path(tempfile.mkdtemp(prefix="dptrain-input-bench-"))
    try:
        start = time.perf_counter()
        write_image_folder(tmp, train=args.images, val=max(10, args.images // 20),
                           width=args.width, height=args.height, seed=args.seed)
        folder_mb = sum(f.stat().st_size for f in tmp.rglob("*.jpg")) / 2**20
        print(f"wrote {args.images} training JPEGs of {args.width}x{args.height} "
              f"({folder_mb:.0f} MB with val/) in {time.perf_counter() - start:.0f} s", flush=True)
        run(args, tmp, folder_mb)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, root: Path, folder_mb: float) -> None:
    load_before = os.getloadavg()
    configs = [(side, w) for w in args.workers for side in ("dptrain", "baseline")]
    sides = {c: Side(*c, root, args) for c in configs}
    baseline_what = sides[("baseline", args.workers[0])].what
    print(f"baseline: {baseline_what}", flush=True)
    runs: dict[tuple[str, int], list[dict]] = {c: [] for c in configs}
    try:
        for c, s in sides.items():  # warm-up: workers started, files in the page cache
            _, _, n, x = s.one_pass()
            assert n == s.images and x.dtype == torch.float32 and \
                x.shape[1:] == (3, args.image_size, args.image_size), (c, n, x.shape)
            print(f"  warm-up {c[0]:>8} {c[1]} workers: last batch {tuple(x.shape)}, mean "
                  f"{x.mean():+.3f} std {x.std():.3f}", flush=True)
        for r in range(args.repeats):
            k = r % len(args.workers)
            order = args.workers[k:] + args.workers[:k]
            for w in order:
                pair = ("dptrain", "baseline") if r % 2 == 0 else ("baseline", "dptrain")
                for side in pair:
                    seconds, cpu, n, _ = sides[(side, w)].one_pass()
                    runs[(side, w)].append({"seconds": seconds, "cpu_seconds": cpu,
                                            "images": n, "images_per_s": n / seconds,
                                            "cpu_ms_per_image": 1e3 * cpu / n})
            print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(
                f"{w}w {runs[('dptrain', w)][-1]['images_per_s']:.0f}/"
                f"{runs[('baseline', w)][-1]['images_per_s']:.0f}" for w in args.workers)
                + " images/s (dptrain/baseline)", flush=True)
    finally:
        for s in sides.values():
            s.close()
    load_after = os.getloadavg()
    rows = []
    for w in args.workers:
        ours = [x["images_per_s"] for x in runs[("dptrain", w)]]
        base = [x["images_per_s"] for x in runs[("baseline", w)]]
        ratios = [a / b for a, b in zip(ours, base)]
        cpu_ours = [x["cpu_ms_per_image"] for x in runs[("dptrain", w)]]
        cpu_base = [x["cpu_ms_per_image"] for x in runs[("baseline", w)]]
        rows.append({"workers": w, "dptrain_images_per_s": statistics.median(ours),
                     "baseline_images_per_s": statistics.median(base),
                     "dptrain_cpu_ms_per_image": statistics.median(cpu_ours),
                     "baseline_cpu_ms_per_image": statistics.median(cpu_base),
                     "cpu_ratio": statistics.median(b / a for a, b in zip(cpu_ours, cpu_base)),
                     "ratio": statistics.median(ratios), "paired_ratios": ratios,
                     "ratio_of_medians": statistics.median(ours) / statistics.median(base),
                     "ratio_of_best": max(ours) / max(base),
                     "dptrain_runs": runs[("dptrain", w)],
                     "baseline_runs": runs[("baseline", w)]})
    print(f"\n{args.images} JPEGs {args.width}x{args.height} -> {args.image_size}x"
          f"{args.image_size}, batch {args.batch_size}, {args.repeats} repeats; torch threads "
          f"in the training process {torch.get_num_threads()}; load average (1 min) "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(f"baseline: {baseline_what}")
    print(f"{'workers':>7}{'dptrain img/s':>15}{'baseline img/s':>16}{'ratio':>8}"
          f"{'range':>14}{'best':>7}  {'target':<13}{'CPU ms/img':>17}{'ratio':>7}")
    for r in rows:
        ok = "met" if r["ratio"] >= TARGET else "MISSED"
        print(f"{r['workers']:>7}{r['dptrain_images_per_s']:>15,.0f}"
              f"{r['baseline_images_per_s']:>16,.0f}{r['ratio']:>7.2f}x"
              f"{min(r['paired_ratios']):>7.2f}-{max(r['paired_ratios']):.2f}"
              f"{r['ratio_of_best']:>6.2f}x  {'>= 1.0x ' + ok:<13}"
              f"{r['dptrain_cpu_ms_per_image']:>8.2f} /{r['baseline_cpu_ms_per_image']:>6.2f}"
              f"{r['cpu_ratio']:>6.2f}x")
    print("ratio = dptrain / baseline images/s, median of the per-repeat ratios (range: "
          "their min-max); best = ratio of each side's fastest repeat; CPU ms/img = CPU time "
          "of the training process and its workers per image, dptrain / baseline, and its "
          "ratio baseline / dptrain (> 1: dptrain uses less)")
    if args.quick:
        return
    args.output.parent.mkdir(exist_ok=True)
    out = args.output.with_suffix(".tmp")
    out.write_text(json.dumps({
        "benchmark": "input_pipeline", "command": command_line(ENV_VARS),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **machine_record(),
        "load_average_1_5_15": {"before": load_before, "after": load_after},
        "environment": {k: os.environ.get(k) for k in ENV_VARS},
        "torch_threads_training_process": torch.get_num_threads(),
        "settings": {k: (v.name if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "folder_mb": folder_mb, "baseline": baseline_what, "target_ratio": TARGET,
        "results": rows}, indent=1) + "\n")
    out.replace(args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    sys.exit(main())
