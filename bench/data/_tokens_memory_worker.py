"""One measurement of bench/data/tokens_memory.py, in a fresh process: load tokens:DIR, draw
windows through the Trainer's sampler and loader, print resident memory as one JSON line.

    python bench/data/_tokens_memory_worker.py DIR BLOCK WINDOWS BATCH pread|memmap|stored

pread is dptrain as it runs; memmap reads through one memory map kept open; stored draws the
epoch's order with torch.randperm held whole (the sampler's `permutation="stored"`).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def status_mb(key: str) -> float:
    """VmRSS or VmHWM of this process, in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    root, (block, windows, batch), mode = sys.argv[1], map(int, sys.argv[2:5]), sys.argv[5]
    import torch  # noqa: F401 - the imports a training process has, counted before the data

    from dptrain.data.config import DataConfig, load_split
    from dptrain.data.datasets.token_windows import TokenFile
    from dptrain.data.loader import BatchLoader
    from dptrain.data.sampler import ShardedSampler

    if mode == "memmap":  # the control: the file memory-mapped once, for the whole run
        import numpy as np

        def read_mapped(self, start: int, stop: int) -> np.ndarray:
            if getattr(self, "_map", None) is None:
                self._map = np.memmap(self.path, dtype=self.dtype, mode="r",
                                      offset=self.offset, shape=(self.count,))
            return np.array(self._map[start:stop], dtype=np.int64)

        TokenFile.read = read_mapped
    record = {"after_imports_mb": status_mb("VmRSS")}
    start = time.perf_counter()
    split = load_split(DataConfig(dataset=f"tokens:{root}", block_size=block), seed=0)
    record["load_s"] = time.perf_counter() - start
    record["after_load_mb"] = status_mb("VmRSS")
    record["peak_after_load_mb"] = status_mb("VmHWM")
    record["train_tokens"] = split.train.num_tokens
    record["train_windows"] = len(split.train)
    sampler = ShardedSampler(split.train, rank=0, world_size=1, seed=0,
                             permutation="stored" if mode == "stored" else None)
    loader = BatchLoader(split.train, sampler, batch, workers=0)
    seen, epoch, check = 0, 0, 0
    start = time.perf_counter()
    while seen < windows:
        sampler.set_epoch(epoch)
        for x, y in loader:
            check += int(y[:, -1].sum())  # the batch is used, not only made
            seen += len(x)
            if seen >= windows:
                break
        epoch += 1
    record["iterate_s"] = time.perf_counter() - start
    record["windows"] = seen
    record["end_mb"] = status_mb("VmRSS")
    record["peak_mb"] = status_mb("VmHWM")
    record["ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(record))


if __name__ == "__main__":
    main()
