"""One measurement of image_folder_memory.py, in a process of its own (argv: ROOT IMAGE_SIZE
WORKERS BATCHES BATCH_SIZE); prints one JSON line.

1. imports (torch, numpy, Pillow, dptrain): resident memory before any data;
2. `load_image_folder(ROOT, image_size, mean, std)`: the file lists of train/ and val/ (the scan,
   the header reads that tell grey from RGB, the fingerprint), timed; mean and std are given,
   so no image is decoded here (the estimate from 512 images does not grow with the folder);
3. a BatchLoader with WORKERS forked workers over the training images (crop + flip), BATCHES
   batches, each worker's resident and private memory read while it runs, then closed;
4. the peak resident memory of this process (VmHWM) and of its workers (RUSAGE_CHILDREN);
5. after the memory figures, the parts of the build timed again one by one.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def _kib(path: str, field: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    root, size, workers, batches, batch = (Path(sys.argv[1]), *map(int, sys.argv[2:6]))
    import numpy  # noqa: F401
    import PIL.Image  # noqa: F401
    import torch

    from dptrain.data.datasets.image_folder import is_grey, load_image_folder, scan
    from dptrain.data.loader import BatchLoader
    from dptrain.data.sampler import ShardedSampler

    out: dict = {"rss_imports_kib": _kib("/proc/self/status", "VmRSS")}
    start = time.perf_counter()
    split = load_image_folder(root, image_size=size, mean="0.5", std="0.25")
    out["build_s"] = time.perf_counter() - start
    out["rss_built_kib"] = _kib("/proc/self/status", "VmRSS")
    out["hwm_built_kib"] = _kib("/proc/self/status", "VmHWM")
    lists = (split.train.files, split.test.files)
    out["images"] = sum(len(f) for f in lists)
    out["file_list_bytes"] = sum(f.paths.nbytes + f.labels.nbytes for f in lists)
    out["path_itemsize"] = max(f.paths.itemsize for f in lists)
    out["channels"] = split.train.channels

    dataset = split.train.with_augmentation(seed=0)
    sampler = ShardedSampler(dataset, rank=0, world_size=1, seed=0, mode="train")
    loader = BatchLoader(dataset, sampler, batch, workers=workers)
    sampler.set_epoch(0)
    worker_mem = []
    for k, (x, _) in enumerate(loader):
        assert x.shape[1:] == (split.train.channels, size, size)
        if k + 1 == batches:
            break
    if workers:
        # Each worker's memory while it is alive: resident (shared pages included) and the
        # pages it holds alone (private; copies made on write after the fork count here).
        for proc in loader._loader._iterator._workers:  # noqa: SLF001 - a benchmark's look
            status = f"/proc/{proc.pid}/status"
            rollup = f"/proc/{proc.pid}/smaps_rollup"
            worker_mem.append({"rss_kib": _kib(status, "VmRSS"),
                               "hwm_kib": _kib(status, "VmHWM"),
                               "private_kib": _kib(rollup, "Private_Clean")
                               + _kib(rollup, "Private_Dirty"),
                               "pss_kib": _kib(rollup, "Pss")})
    loader.close()
    out["workers"] = worker_mem
    out["hwm_end_kib"] = _kib("/proc/self/status", "VmHWM")
    out["workers_peak_kib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out["torch_threads"] = torch.get_num_threads()

    start = time.perf_counter()
    train, test = scan(root / "train"), scan(root / "val")
    out["scan_s"] = time.perf_counter() - start
    start = time.perf_counter()
    grey = is_grey(train) and is_grey(test)
    out["header_s"] = time.perf_counter() - start
    out["headers_read"] = (len(train) + len(test)) if grey else None
    start = time.perf_counter()
    train.fingerprint(), test.fingerprint()
    out["fingerprint_s"] = time.perf_counter() - start
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
