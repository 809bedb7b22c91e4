"""Memory per process of an image-folder dataset of N and 4N images, and the file-list build time.

    .venv/bin/python bench/data/image_folder_memory.py          # ~2 min on 2 cores, writes the JSON
    .venv/bin/python bench/data/image_folder_memory.py --quick  # smoke run, writes nothing

Folders: N = --images training images plus N/20 in val/, and --factor times as many, all
--width x --height JPEGs (bench/common/image_folder.py), made of hard links to a pool of 200 (+20)
generated images, so that a folder of 100,000 images takes seconds and no disk space; every
entry is a real JPEG to the scan and the decoder. Each size exists as an RGB folder and as a
grey one: dptrain reads image headers until it meets an RGB one (a folder is grey only when
every image is), so the grey folder is the one whose build reads every header.

Each measurement is a fresh process (_folder_memory_worker.py) that builds the dataset with
`load_image_folder` (mean and std given, so nothing is decoded for the normalisation estimate,
whose 512 images do not depend on N), then draws --batches batches through a BatchLoader with
--workers forked workers. Reported per process: resident memory after the imports, after the
build and its peak (VmRSS, VmHWM), the peak of its workers (ru_maxrss of the children; a forked
worker's resident set counts the pages it shares with its parent) and their private memory
(Private_Clean + Private_Dirty of smaps_rollup: pages a worker holds alone, copies on write
included), and the build time with its parts (the scan of the folders, the header reads, the
fingerprint). The configurations alternate over --repeats (medians). The N -> 4N differences
divided by the extra images give bytes per image, next to the file list's own size (numpy
byte array of the relative paths, fixed width = the longest path, plus an int64 label).
Page cache warm (the folders were just written): a cold first scan of a network filesystem is
slower, and is paid by every process (each builds its own list).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS, command_line  # noqa: E402
from common.image_folder import (link_image_folder, machine_record,  # noqa: E402
                                 write_image_folder)

WORKER = Path(__file__).resolve().with_name("_folder_memory_worker.py")
DEFAULT_OUTPUT = RESULTS / "image_folder_memory.json"
POOL = (200, 20)


def measure(root: Path, args: argparse.Namespace) -> dict:
    done = subprocess.run([sys.executable, str(WORKER), str(root), str(args.image_size),
                           str(args.workers), str(args.batches), str(args.batch_size)],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        sys.exit(f"{WORKER.name} {root} failed ({done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=25_000, help="N: training images (+N/20 val)")
    p.add_argument("--factor", type=int, default=4, help="the larger folder has factor x N")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--workers", type=int, default=2, help="BatchLoader workers per process")
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="N = 2,000, 1 repeat; writes nothing")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args()
    if args.quick:
        args.images, args.repeats = 2_000, 1
    tmp = Path(tempfile.mkdtemp(prefix="dptrain-memory-bench-"))
    try:
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, tmp: Path) -> None:
    start = time.perf_counter()
    sizes = {"N": args.images, f"{args.factor}N": args.factor * args.images}
    folders = {}
    for colour in ("rgb", "grey"):
        pool = write_image_folder(tmp / f"pool-{colour}", train=POOL[0], val=POOL[1],
                                  width=args.width, height=args.height, grey=colour == "grey")
        for name, n in sizes.items():
            folders[(colour, name)] = link_image_folder(pool, tmp / f"{colour}-{name}",
                                                        train=n, val=n // 20)
    print(f"folders of {', '.join(f'{n:,}' for n in sizes.values())} training images (+5 % "
          f"val), RGB and grey, {args.width}x{args.height} JPEGs, made in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    load_before = os.getloadavg()
    configs = list(folders)
    runs: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
    for r in range(args.repeats):
        k = r % len(configs)
        for c in configs[k:] + configs[:k]:
            runs[c].append(measure(folders[c], args))
            m = runs[c][-1]
            print(f"  {c[0]:>4} {c[1]:>2}: {m['images']:>7,} images, build {m['build_s']:.2f} s,"
                  f" peak {m['hwm_end_kib'] / 1024:.1f} MB, workers' peak "
                  f"{m['workers_peak_kib'] / 1024:.1f} MB", flush=True)
    load_after = os.getloadavg()
    rows = summarize(runs, sizes)
    report(rows, args)
    if args.quick:
        return
    args.output.parent.mkdir(exist_ok=True)
    out = args.output.with_suffix(".tmp")
    out.write_text(json.dumps({
        "benchmark": "image_folder_memory", "command": command_line(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **machine_record(),
        "load_average_1_5_15": {"before": load_before, "after": load_after},
        "settings": {k: (v.name if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": rows,
        "runs": [{"colour": c[0], "size": c[1], "runs": v} for c, v in runs.items()]},
        indent=1) + "\n")
    out.replace(args.output)
    print(f"wrote {args.output}")


MEMORY = {"rss_imports_kib": "after imports", "rss_built_kib": "after the build",
          "hwm_built_kib": "peak after the build", "hwm_end_kib": "peak after the batches",
          "workers_peak_kib": "workers' peak", "worker_private_kib": "worker private"}


def summarize(runs: dict, sizes: dict) -> list[dict]:
    rows = []
    for (colour, name), ms in runs.items():
        med = {k: statistics.median(m[k] for m in ms) for k in
               ("build_s", "scan_s", "header_s", "fingerprint_s", *MEMORY)
               if k != "worker_private_kib"}
        private = [max((w["private_kib"] for w in m["workers"]), default=0) for m in ms]
        med["worker_private_kib"] = statistics.median(private)
        images = ms[0]["images"]
        rows.append({"colour": colour, "size": name, "images": images,
                     "file_list_bytes": ms[0]["file_list_bytes"],
                     "file_list_bytes_per_image": ms[0]["file_list_bytes"] / images,
                     "path_itemsize": ms[0]["path_itemsize"],
                     "build_s_per_10k": 1e4 * med["build_s"] / images,
                     **{f"median_{k}": v for k, v in med.items()}})
    small, large = list(sizes)
    for colour in ("rgb", "grey"):
        a = next(r for r in rows if r["colour"] == colour and r["size"] == small)
        b = next(r for r in rows if r["colour"] == colour and r["size"] == large)
        extra = b["images"] - a["images"]
        b["bytes_per_extra_image"] = {
            k: 1024 * (b[f"median_{k}"] - a[f"median_{k}"]) / extra for k in MEMORY}
        b["bytes_per_extra_image"]["file_list"] = (b["file_list_bytes"]
                                                   - a["file_list_bytes"]) / extra
    return rows


def report(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\nmedians of {args.repeats} fresh processes per folder; {args.workers} workers, "
          f"{args.batches} batches of {args.batch_size} at {args.image_size}x{args.image_size}")
    print(f"{'folder':<10}{'images':>9}{'build s':>9}{'s/10k':>7}{'scan':>7}{'headers':>8}"
          f"{'fprint':>7}  MB: {'imports':>8}{'built':>8}{'peak':>8}{'workers':>8}"
          f"{'w.priv':>8}{'list':>7}")
    for r in rows:
        print(f"{r['colour'] + ' ' + r['size']:<10}{r['images']:>9,}{r['median_build_s']:>9.2f}"
              f"{r['build_s_per_10k']:>7.2f}{r['median_scan_s']:>7.2f}{r['median_header_s']:>8.2f}"
              f"{r['median_fingerprint_s']:>7.2f}      "
              f"{r['median_rss_imports_kib'] / 1024:>8.1f}{r['median_rss_built_kib'] / 1024:>8.1f}"
              f"{r['median_hwm_end_kib'] / 1024:>8.1f}{r['median_workers_peak_kib'] / 1024:>8.1f}"
              f"{r['median_worker_private_kib'] / 1024:>8.1f}"
              f"{r['file_list_bytes'] / 2**20:>7.2f}")
    print("build = load_image_folder (scan + header reads + fingerprint); s/10k = build seconds "
          "per 10,000 images; built = VmRSS after the build; peak = VmHWM after the batches; "
          "workers = their peak RSS (shared pages included); w.priv = a worker's private memory; "
          "list = the file list's numpy arrays")
    for r in rows:
        if "bytes_per_extra_image" in r:
            b = r["bytes_per_extra_image"]
            print(f"{r['colour']}: bytes per extra image: file list {b['file_list']:.0f} (paths "
                  f"{r['path_itemsize']} + label 8); resident after build "
                  f"{b['rss_built_kib']:.0f}, process peak {b['hwm_end_kib']:.0f}, peak during "
                  f"the build {b['hwm_built_kib']:.0f}, workers' peak {b['workers_peak_kib']:.0f},"
                  f" worker private {b['worker_private_kib']:.0f}")


if __name__ == "__main__":
    main()
