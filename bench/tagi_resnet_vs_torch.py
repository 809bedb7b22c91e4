"""The price of the Bayesian network: TAGI ResNet18 vs torch ResNet18, one process each.

    .venv/bin/python bench/tagi_resnet_vs_torch.py           # full run, writes bench/results/
    .venv/bin/python bench/tagi_resnet_vs_torch.py --quick   # smoke run (width 8), writes nothing

Both networks are the registry's (`dptrain.learners.models`): `tagi-resnet18` (pytagi's CIFAR-10
ResNet18, HRC head, σ_v 0.05, gains 0.083) and `torch-resnet18` (the usual CIFAR ResNet18), on
32x32x3 synthetic inputs at the same batch. A TAGI step is forward + output update + backward +
step; a torch step is forward + cross-entropy + backward + SGD step. Each measurement runs in
a fresh process (so its peak resident memory is its own), on --threads threads; the two
alternate over the repeats and each figure is the median, because the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import command_line, cpu_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "tagi_resnet_vs_torch.json"


def _measure(kind: str, batch: int, steps: int, width: int, threads: int, queue) -> None:
    torch.set_num_threads(threads)
    from dptrain.learners.models import ModelOptions, build_model
    from dptrain.tagi import HRCSoftmax, OutputUpdater, manual_seed

    torch.manual_seed(0)
    manual_seed(0)
    x = torch.randn(batch, 3, 32, 32)
    labels = torch.randint(0, 10, (batch,))
    if kind == "tagi":
        hrc = HRCSoftmax(10)
        net = build_model("tagi-resnet18", (3, 32, 32), hrc.num_outputs,
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
        model = build_model("torch-resnet18", (3, 32, 32), 10, ModelOptions(width=width))
        optim = torch.optim.SGD(model.parameters(), lr=0.01)
        loss_fn = torch.nn.CrossEntropyLoss()

        def step() -> None:
            optim.zero_grad(set_to_none=True)
            loss_fn(model(x), labels).backward()
            optim.step()
    step()  # warm-up: allocations, kernel choice
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put({"samples_per_s": steps * batch / elapsed, "peak_rss_mb": peak_mb})


def measure(kind: str, batch: int, steps: int, width: int, threads: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(kind, batch, steps, width, threads, queue))
    proc.start()
    result = queue.get(timeout=3600)
    proc.join()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:
        args.width, args.steps, args.repeats = 8, 2, 1
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {"tagi": [], "torch": []}
    for r in range(args.repeats):
        for kind in (("tagi", "torch") if r % 2 == 0 else ("torch", "tagi")):
            runs[kind].append(measure(kind, args.batch, args.steps, args.width, args.threads))
    summary = {kind: {"samples_per_s": statistics.median(x["samples_per_s"] for x in rs),
                      "peak_rss_mb": max(x["peak_rss_mb"] for x in rs)}
               for kind, rs in runs.items()}
    ratio = summary["torch"]["samples_per_s"] / summary["tagi"]["samples_per_s"]
    print(f"ResNet18 (width {args.width}) on 32x32x3, batch {args.batch}, {args.threads} "
          f"thread(s), median of {args.repeats}")
    for kind in ("tagi", "torch"):
        s = summary[kind]
        print(f"  {kind:5s} {s['samples_per_s']:8.1f} samples/s   peak {s['peak_rss_mb']:7.0f} MB")
    print(f"  a TAGI step costs {ratio:.2f}x a torch SGD step")
    if not args.quick:
        args.output.parent.mkdir(exist_ok=True)
        args.output.write_text(json.dumps({
            "command": command_line(("OMP_WAIT_POLICY",)),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
            "config": vars(args) | {"output": str(args.output.name)}, "summary": summary,
            "tagi_step_over_torch_step": ratio,
            "runs": runs, "cpu": cpu_model(), "python": platform.python_version(),
            "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
