"""Resident memory of a process training on tokens:DIR, for a file of 1 M and of 100 M tokens:
it must not grow with the file.

    .venv/bin/python bench/data/tokens_memory.py            # ~2 min on 2 cores, writes the JSON
    .venv/bin/python bench/data/tokens_memory.py --quick    # 1 M and 10 M tokens, writes nothing

Two token folders are generated in a temporary directory (deleted afterwards): train.bin of
--small and --large random uint16 ids (nanoGPT's layout, written a chunk at a time), a val.bin
of 100,000 and a meta.json (GPT-2's 50,257 ids). Each measurement is a fresh process
(_tokens_memory_worker.py) that loads the split with `load_split` (which checks every id
below the vocabulary size, a chunk at a time, and hashes the files for the fingerprint), then
draws --windows windows of --block-size tokens in batches of --batch-size through the
Trainer's `ShardedSampler` and `BatchLoader` (a seeded permutation of the whole file: the
windows are spread over all of it). Recorded: VmRSS after the imports, after the load and at
the end, and the peak (VmHWM). Beside dptrain's reads (`TokenFile`: a window at a time by
position, `os.pread`; the epoch's order computed a batch at a time, `ComputedPermutation`),
two controls: "memmap" reads the same windows from one `np.memmap` of the file kept for the
whole run (the pages it has read stay the process's resident memory), and "stored" holds the
epoch's order whole (`torch.randperm`, 8 bytes per window, as the sampler did before). Sizes
and modes alternate over --repeats; medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS, command_line  # noqa: E402
from common.image_folder import machine_record  # noqa: E402

WORKER = Path(__file__).resolve().with_name("_tokens_memory_worker.py")
DEFAULT_OUTPUT = RESULTS / "tokens_memory.json"
VOCAB = 50257
CHUNK = 1 << 22


def write_tokens(root: Path, tokens: int, seed: int) -> None:
    """root/train.bin of `tokens` random ids, val.bin and meta.json; never all in memory."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    with open(root / "train.bin", "wb") as f:
        for start in range(0, tokens, CHUNK):
            rng.integers(0, VOCAB, size=min(CHUNK, tokens - start), dtype=np.uint16).tofile(f)
    rng.integers(0, VOCAB, size=100_000, dtype=np.uint16).tofile(root / "val.bin")
    (root / "meta.json").write_text(json.dumps({"vocab_size": VOCAB, "dtype": "uint16"}))


def measure(root: Path, args: argparse.Namespace, mode: str) -> dict:
    done = subprocess.run([sys.executable, str(WORKER), str(root), str(args.block_size),
                           str(args.windows), str(args.batch_size), mode],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        sys.exit(f"{WORKER.name} {root} failed ({done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", type=int, default=1_000_000, help="tokens of the small file")
    p.add_argument("--large", type=int, default=100_000_000, help="tokens of the large file")
    p.add_argument("--block-size", type=int, default=64, help="nanoGPT's CPU model's")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--windows", type=int, default=8192, help="windows drawn per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="10 M tokens, 1 repeat; writes nothing")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args()
    if args.quick:
        args.large, args.repeats = 10_000_000, 1
    tmp = Path(tempfile.mkdtemp(prefix="dptrain-tokens-bench-"))
    try:
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, tmp: Path) -> None:
    load_before = os.getloadavg()
    start = time.perf_counter()
    roots = {"small": tmp / "small", "large": tmp / "large"}
    write_tokens(roots["small"], args.small, seed=0)
    write_tokens(roots["large"], args.large, seed=1)
    print(f"wrote {args.small:,} and {args.large:,} tokens in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    modes = {"dptrain": "pread", "memmap": "memmap", "stored": "stored"}
    cases = [(size, mode) for mode in modes for size in ("small", "large")]
    runs: dict[str, list[dict]] = {f"{size}, {mode}": [] for size, mode in cases}
    for repeat in range(args.repeats):
        for size, mode in cases if repeat % 2 == 0 else cases[::-1]:
            record = measure(roots[size], args, modes[mode])
            runs[f"{size}, {mode}"].append(record)
            print(f"  {size:5} {mode:7} peak {record['peak_mb']:7.1f} MB (after imports "
                  f"{record['after_imports_mb']:.1f}, after load {record['after_load_mb']:.1f}, "
                  f"peak of the load {record['peak_after_load_mb']:.1f}, "
                  f"end {record['end_mb']:.1f}); load {record['load_s']:.2f} s, "
                  f"{record['windows']} windows in {record['iterate_s']:.2f} s", flush=True)
    medians = {case: {key: statistics.median(r[key] for r in records)
                      for key in records[0] if isinstance(records[0][key], (int, float))}
               for case, records in runs.items()}
    ratios = {}
    for mode in modes:
        small, large = medians[f"small, {mode}"], medians[f"large, {mode}"]
        ratios[mode] = {
            "peak_ratio": large["peak_mb"] / small["peak_mb"],
            "peak_growth_mb": large["peak_mb"] - small["peak_mb"],
            "data_peak_ratio": (large["peak_mb"] - large["after_imports_mb"])
            / (small["peak_mb"] - small["after_imports_mb"]),
            "stored_permutation_growth_mb":
                8 * (large["train_windows"] - small["train_windows"]) / 2**20,
        }
    print(f"\n{args.large:,} vs {args.small:,} tokens ({args.large // args.small}x the file), "
          f"{args.windows} windows of {args.block_size}, medians of {args.repeats}:")
    for mode, r in ratios.items():
        print(f"  {mode:7}: peak resident memory x{r['peak_ratio']:.3f} "
              f"({r['peak_growth_mb']:+.1f} MB; a stored permutation grows by "
              f"{r['stored_permutation_growth_mb']:+.1f} MB); above the imports "
              f"x{r['data_peak_ratio']:.2f}")
    if args.quick:
        return
    record = {"benchmark": "tokens_memory", "command": command_line(),
              "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              **machine_record(),
              "load_average_1_5_15": {"before": list(load_before), "after": list(os.getloadavg())},
              "settings": {k: v for k, v in vars(args).items() if k != "output"},
              "file_mb": {"small": args.small * 2 / 1e6, "large": args.large * 2 / 1e6},
              "medians": medians, "ratios": ratios, "runs": runs}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
