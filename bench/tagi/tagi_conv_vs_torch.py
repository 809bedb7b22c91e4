"""The price of being Bayesian on conv networks: a TAGI step vs a torch SGD step, and memory.

    .venv/bin/python bench/tagi/tagi_conv_vs_torch.py                    # both networks, ~5 min
    .venv/bin/python bench/tagi/tagi_conv_vs_torch.py --network cnn      # the MNIST CNN only
    .venv/bin/python bench/tagi/tagi_conv_vs_torch.py --quick            # smoke run, writes nothing

Networks (--network cnn | resnet18 | both):
  cnn       pytagi's MNIST CNN on 28x28x1 (registry `tagi-cnn`: Conv2d(1,16,4,padding=1)-ReLU-
            AvgPool2d(3,2)-Conv2d(16,32,5)-ReLU-AvgPool2d(3,2)-Linear(512,100)-ReLU-
            Linear(100,11)), batch 32 and 128; torch: the same layers in torch.nn, 11 outputs
  resnet18  pytagi's CIFAR-10 ResNet18 on 32x32x3 (`tagi-resnet18`, gains 0.083), batch 32;
            torch: `torch-resnet18`, the usual CIFAR ResNet18
A TAGI step is forward + index output update (HRC head, σ_v 0.05) + backward + step; a torch
step is zero_grad + forward + cross-entropy + backward + SGD step, on the same synthetic input
batch. Each measurement runs in a fresh spawned process (so its peak resident memory,
`ru_maxrss`, is that network's own) on --threads threads: one untimed warm-up step, then
--steps timed steps, the process's figure being their median. TAGI and torch processes
alternate over the repeats (which goes first alternates too) and each printed figure is the
median over repeats, because the machine is shared. The target is TAGI step / torch step <= 3.

pytagi's peak memory (bench/.venv-pytagi, made by setup_pytagi.sh) is measured afterwards in
its own process (_pytagi_memory_worker.py, the networks of _pytagi_worker.py): after a few
steps for the CNN, after ONE step for the ResNet18 (a pytagi ResNet18 step takes ~1.5 min
here). Its time is not part of this benchmark (see tagi_vs_pytagi.py). --no-pytagi skips it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import (PYTAGI_DIR, PYTAGI_VENV, RESULTS as RESULTS_DIR, command_line,  # noqa: E402
                    cpu_model, setup_pytagi_venv)

RESULTS = RESULTS_DIR / "tagi_conv_vs_torch.json"
TARGET = 3.0
#: (network, batch) cases of each --network choice.
CASES = {"cnn": [("cnn", 32), ("cnn", 128)], "resnet18": [("resnet18", 32)]}
ENV_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")


def _torch_cnn() -> torch.nn.Module:
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(1, 16, 4, padding=1), nn.ReLU(), nn.AvgPool2d(3, 2),
                         nn.Conv2d(16, 32, 5), nn.ReLU(), nn.AvgPool2d(3, 2), nn.Flatten(),
                         nn.Linear(512, 100), nn.ReLU(), nn.Linear(100, 11))


def _measure(kind: str, network: str, batch: int, steps: int, width: int, threads: int,
             queue) -> None:
    """In a fresh process: median seconds per step of `kind` ("tagi" | "torch") and the
    process's peak resident memory."""
    torch.set_num_threads(threads)
    from dptrain.models import ModelOptions, build_model
    from dptrain.tagi import HRCSoftmax, OutputUpdater, manual_seed

    torch.manual_seed(0)
    manual_seed(0)
    shape = (1, 28, 28) if network == "cnn" else (3, 32, 32)
    x = torch.randn(batch, *shape)
    labels = torch.randint(0, 10, (batch,))
    if kind == "tagi":
        hrc = HRCSoftmax(10)
        if network == "cnn":
            net = build_model("tagi-cnn", shape, hrc.num_outputs)
        else:
            net = build_model("tagi-resnet18", shape, hrc.num_outputs,
                              ModelOptions(width=width, gain_weight=0.083))
        updater = OutputUpdater(net.device)
        obs, idx = hrc.encode(labels)

        def step() -> None:
            net(x)
            updater.update_using_indices(net.output_z_buffer, obs, 0.05 ** 2, idx,
                                         net.input_delta_z_buffer)
            net.backward()
            net.step()
    else:
        model = (_torch_cnn() if network == "cnn" else
                 build_model("torch-resnet18", shape, 10, ModelOptions(width=width)))
        optim = torch.optim.SGD(model.parameters(), lr=0.01)
        loss_fn = torch.nn.CrossEntropyLoss()

        def step() -> None:
            optim.zero_grad(set_to_none=True)
            loss_fn(model(x), labels).backward()
            optim.step()
    step()  # warm-up: allocations, kernel choice
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put({"seconds_per_step": statistics.median(seconds), "peak_rss_mb": peak_mb})


def measure(kind: str, network: str, batch: int, steps: int, width: int, threads: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure,
                       args=(kind, network, batch, steps, width, threads, queue))
    proc.start()
    result = queue.get(timeout=3600)
    proc.join()
    return result


def pytagi_memory(network: str, batch: int, steps: int, threads: int) -> dict | None:
    """Peak RSS of a pytagi process after `steps` training steps, or None without the venv."""
    python = setup_pytagi_venv()
    nccl_libs = sorted(PYTAGI_VENV.glob("lib/python*/site-packages/nvidia/nccl/lib"))
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(p) for p in nccl_libs[-1:]] + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    out = subprocess.run([str(python), str(PYTAGI_DIR / "_pytagi_memory_worker.py"), network,
                          str(batch), str(steps), str(threads)], env=env, check=True,
                         stdout=subprocess.PIPE, text=True, cwd=PYTAGI_DIR)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_case(network: str, batch: int, args: argparse.Namespace) -> dict:
    steps = args.steps if args.steps is not None else (
        (3 if args.quick else 20 if batch <= 32 else 8) if network == "cnn" else
        (1 if args.quick else 3))
    repeats = args.repeats if args.repeats is not None else (
        1 if args.quick else 5 if network == "cnn" else 3)
    width = 8 if args.quick and network == "resnet18" else args.width
    runs: dict[str, list[dict]] = {"tagi": [], "torch": []}
    for r in range(repeats):
        for kind in (("tagi", "torch") if r % 2 == 0 else ("torch", "tagi")):
            runs[kind].append(measure(kind, network, batch, steps, width, args.threads))
    tagi_s = [x["seconds_per_step"] for x in runs["tagi"]]
    torch_s = [x["seconds_per_step"] for x in runs["torch"]]
    return {
        "network": network, "batch": batch, "width": width, "steps": steps,
        "repeats": repeats,
        "tagi_ms_per_step": 1e3 * statistics.median(tagi_s),
        "torch_ms_per_step": 1e3 * statistics.median(torch_s),
        "tagi_step_over_torch_step": statistics.median(tagi_s) / statistics.median(torch_s),
        "paired_ratios": [a / b for a, b in zip(tagi_s, torch_s)],
        "tagi_peak_rss_mb": max(x["peak_rss_mb"] for x in runs["tagi"]),
        "torch_peak_rss_mb": max(x["peak_rss_mb"] for x in runs["torch"]),
        "runs": runs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--network", choices=("cnn", "resnet18", "both"), default="both")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--width", type=int, default=64, help="ResNet18 width (64: the real one)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per process (default 20 / 8 for the CNN at batch 32 / "
                        "128, 3 for the ResNet18)")
    p.add_argument("--repeats", type=int, default=None,
                   help="alternated process pairs (default 5 CNN, 3 ResNet18)")
    p.add_argument("--no-pytagi", action="store_true", help="skip pytagi's memory")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: batch 32 only, one repeat, few steps, ResNet18 width 8, "
                        "pytagi's memory for the CNN only; writes nothing")
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args()
    load_before = os.getloadavg()
    networks = ("cnn", "resnet18") if args.network == "both" else (args.network,)
    rows = []
    for network in networks:
        for net_name, batch in CASES[network][:1] if args.quick else CASES[network]:
            rows.append(run_case(net_name, batch, args))
            r = rows[-1]
            print(f"{net_name} batch {batch}: TAGI {r['tagi_ms_per_step']:.1f} ms, torch SGD "
                  f"{r['torch_ms_per_step']:.1f} ms per step -> "
                  f"{r['tagi_step_over_torch_step']:.2f}x", flush=True)
    if not args.no_pytagi:
        for r in rows:
            if args.quick and (r["network"] != "cnn" or r["batch"] != 32):
                continue
            pytagi_steps = 1 if r["network"] == "resnet18" or args.quick else 3
            mem = pytagi_memory(r["network"], r["batch"], pytagi_steps, args.threads)
            r["pytagi_peak_rss_mb"] = mem["peak_rss_mb"]
            r["pytagi_memory_after_steps"] = pytagi_steps
    load_after = os.getloadavg()
    print(f"\n{args.threads} thread(s); load average (1 min) {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after; medians over alternated fresh processes")
    print(f"{'network':<10}{'batch':>6}{'TAGI ms':>10}{'torch ms':>10}{'ratio':>8}"
          f"{'target':>10}{'TAGI MB':>10}{'torch MB':>10}{'pytagi MB':>11}")
    for r in rows:
        ok = "ok" if r["tagi_step_over_torch_step"] <= TARGET else "MISS"
        pyt = r.get("pytagi_peak_rss_mb")
        pyt_text = "-" if pyt is None else (
            f"{pyt:,.0f}" + ("*" if r.get("pytagi_memory_after_steps") == 1 else ""))
        print(f"{r['network']:<10}{r['batch']:>6}{r['tagi_ms_per_step']:>10.1f}"
              f"{r['torch_ms_per_step']:>10.1f}{r['tagi_step_over_torch_step']:>7.2f}x"
              f"{'<=3x ' + ok:>10}{r['tagi_peak_rss_mb']:>10,.0f}{r['torch_peak_rss_mb']:>10,.0f}"
              f"{pyt_text:>11}")
    print("ratio = TAGI step time / torch SGD step time (target <= 3x); MB = peak resident "
          "memory per process (interpreter, torch and data included); * = pytagi measured "
          "after one step")
    if not args.quick:
        args.output.parent.mkdir(exist_ok=True)
        tmp = args.output.with_suffix(".tmp")
        tmp.write_text(json.dumps({
            "benchmark": "tagi_conv_vs_torch",
            "command": command_line(ENV_VARS),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_1_5_15": {"before": load_before, "after": load_after},
            "config": {k: (v.name if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "target_ratio": TARGET, "results": rows, "cpu": cpu_model(),
            "python": platform.python_version(), "torch": torch.__version__}, indent=1) + "\n")
        tmp.replace(args.output)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
