"""Threads per rank and OpenMP's wait policy: the default share vs an oversubscribed run.

    .venv/bin/python bench/distributed/threads_oversubscription.py       # ~3-4 min, writes the JSON
    .venv/bin/python bench/distributed/threads_oversubscription.py --quick  # smoke run, writes nothing
    .venv/bin/python bench/distributed/threads_oversubscription.py --network cnn  # pytagi's MNIST CNN

Data-parallel TAGI training steps (FNN 784-128-128-11 or the tagi-cnn, HRC head, sum mode,
synthetic inputs) by 2 ranks on this machine, each configuration started the way users start
it, in fresh processes, the configurations alternating over the repeats (medians):

- `dptrain run -n 2`, nothing set: each rank gets its share of the usable cores;
- OMP_NUM_THREADS=2 under torchrun (the agent `dptrain run` drives, without dptrain's
  environment): 2 ranks x 2 threads with OpenMP's default wait policy (spin, then sleep);
- OMP_NUM_THREADS=2 under `dptrain run -n 2`: the same threads, and OMP_WAIT_POLICY=PASSIVE,
  which dptrain run sets when the workers' threads outnumber the cores;
- and what PASSIVE costs where nothing is oversubscribed: `dptrain run -n 1` (one rank with
  every usable core) with the default wait policy and with OMP_WAIT_POLICY=PASSIVE.

Each worker reports the threads and the wait policy it really had; the table shows them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS, command_line, cpu_model  # noqa: E402

WORKER = Path(__file__).resolve().with_name("_threads_worker.py")
DEFAULT_OUTPUT = RESULTS / "threads_oversubscription.json"
PY = sys.executable
DPTRAIN = [PY, "-m", "dptrain", "run"]
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone"]

# name -> (launcher argv up to the script, ranks, environment added to a clean one)
CONFIGS = {
    "2 ranks, default share": (DPTRAIN + ["-n", "2"], 2, {}),
    "2 ranks x 2 threads, default wait": (TORCHRUN + ["--nproc-per-node=2"], 2,
                                          {"OMP_NUM_THREADS": "2"}),
    "2 ranks x 2 threads, dptrain run": (DPTRAIN + ["-n", "2"], 2, {"OMP_NUM_THREADS": "2"}),
    "1 rank, all cores, default wait": (DPTRAIN + ["-n", "1"], 1, {}),
    "1 rank, all cores, PASSIVE": (DPTRAIN + ["-n", "1"], 1, {"OMP_WAIT_POLICY": "PASSIVE"}),
}
CLEARED = ("OMP_", "GOMP_", "KMP_", "MKL_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_",
           "MASTER_", "TORCHELASTIC_", "OMPI_", "PMI_", "SLURM_")


def measure(name: str, network: str, batch: int, seconds: float, warmup: int) -> dict:
    launcher, ranks, extra = CONFIGS[name]
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEARED)}
    env.update(extra, GLOO_SOCKET_IFNAME="lo")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [*launcher, str(WORKER), network, str(batch), str(seconds), str(warmup), tmp]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            sys.exit(f"{name}: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr}")
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(ranks)]
    slowest = max(r["seconds"] for r in per_rank)
    return {"samples_per_s": ranks * batch * per_rank[0]["steps"] / slowest,
            "steps": per_rank[0]["steps"],
            "torch_threads": [r["torch_threads"] for r in per_rank],
            "OMP_WAIT_POLICY": per_rank[0]["OMP_WAIT_POLICY"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--network", choices=("fnn", "cnn"), default="fnn")
    parser.add_argument("--batch", type=int, help="samples per rank per step "
                        "(default 32 fnn, 32 cnn)")
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="timed seconds per measurement (the ranks agree on a step count "
                             "from 5 calibration steps)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 10 fnn, 3 cnn)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="few steps, no results file")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    args.batch = args.batch or 32
    if args.warmup is None:  # a collapsed CNN step takes a second
        args.warmup = 10 if args.network == "fnn" else 3
    if args.output is None:
        args.output = DEFAULT_OUTPUT if args.network == "fnn" else \
            DEFAULT_OUTPUT.with_name("threads_oversubscription_cnn.json")
    names = list(CONFIGS)
    if args.quick:
        args.seconds, args.warmup, args.repeats = 1.0, 2, 1
        names = names[:3]
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in names}
    started = time.monotonic()
    for repeat in range(args.repeats):
        for name in (names if repeat % 2 == 0 else names[::-1]):
            runs[name].append(measure(name, args.network, args.batch, args.seconds,
                                      args.warmup))
            row = runs[name][-1]
            print(f"repeat {repeat + 1}/{args.repeats} {name}: {row['samples_per_s']:.0f} "
                  f"samples/s, {row['steps']} steps (threads {row['torch_threads']}, "
                  f"OMP_WAIT_POLICY {row['OMP_WAIT_POLICY']})", flush=True)
    table = {name: {"samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
                    "per_repeat": [round(r["samples_per_s"]) for r in rs],
                    "torch_threads": rs[0]["torch_threads"],
                    "OMP_WAIT_POLICY": rs[0]["OMP_WAIT_POLICY"]} for name, rs in runs.items()}
    base = table["2 ranks, default share"]["samples_per_s"]
    label = "tagi-cnn (pytagi's MNIST CNN)" if args.network == "cnn" else "FNN 784-128-128-11"
    print(f"\n{label} + HRC, {args.batch} samples per rank per step, ~{args.seconds:g} s timed, "
          f"median of {args.repeats}; {os.cpu_count()} CPUs, load average before "
          f"{load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    print(f"{'configuration':<36}{'threads':>9}{'wait policy':>13}{'samples/s':>11}"
          f"{'vs default share':>18}")
    for name, row in table.items():
        threads = "x".join(map(str, row["torch_threads"]))
        print(f"{name:<36}{threads:>9}{row['OMP_WAIT_POLICY'] or 'default':>13}"
              f"{row['samples_per_s']:>11.0f}{row['samples_per_s'] / base:>17.2f}x")

    def rate(name: str) -> float:
        return table[name]["samples_per_s"]

    ratios = {
        "oversubscribed default wait / default share":
            rate("2 ranks x 2 threads, default wait") / base,
        "oversubscribed dptrain run (PASSIVE) / default share":
            rate("2 ranks x 2 threads, dptrain run") / base,
        "oversubscribed PASSIVE / oversubscribed default wait":
            rate("2 ranks x 2 threads, dptrain run") / rate("2 ranks x 2 threads, default wait"),
    }
    if "1 rank, all cores, PASSIVE" in table:
        ratios["not oversubscribed: 1 rank PASSIVE / 1 rank default wait"] = \
            rate("1 rank, all cores, PASSIVE") / rate("1 rank, all cores, default wait")
    print()
    for text, value in ratios.items():
        print(f"{text}: {value:.2f}x")
    print(f"({time.monotonic() - started:.0f} s)")
    if args.quick:
        return
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "command": command_line(), "hardware": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "network": args.network, "batch_per_rank": args.batch, "seconds": args.seconds,
        "repeats": args.repeats,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "results": table, "ratios": ratios}, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
