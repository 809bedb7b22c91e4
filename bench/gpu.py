"""TAGI on one GPU: train-step throughput and peak GPU memory, against a torch SGD step.

    python bench/gpu.py            # on a machine with a CUDA GPU; writes bench/results/gpu.json
    python bench/gpu.py --quick    # 1 repeat of 3 steps each; writes nothing

Without CUDA it refuses in one line (exit status 1). Not yet run on a GPU: the figures it
prints are the first ones.

What it measures, on `cuda:0` with torch's default settings (cuDNN convolutions may use TF32):
  resnet18  pytagi's CIFAR-10 ResNet18 (the registry's `tagi-resnet18`, gains 0.083) on
            32x32x3 synthetic images, batch 64, HRC head (σ_v 0.05): one TAGI train step is
            forward + index output update + backward + capped step; against `torch-resnet18`
            (the usual CIFAR ResNet18) taking a cross-entropy SGD step on the same batch. The
            step-time ratio TAGI / torch is the price of being Bayesian on this GPU.
  cnn       pytagi's MNIST CNN (`tagi-cnn`) on 28x28x1, batch 64, against the same layers in
            torch.nn (tagi_conv_vs_torch.py's torch CNN).
Per case one untimed warm-up step, then --steps timed steps between two
`torch.cuda.synchronize()` (a step's host syncs, e.g. the input check, are part of it); TAGI
and torch alternate over --repeats (which goes first alternates too); figures are medians.
Peak memory is `torch.cuda.max_memory_allocated()` over the timed steps of one repeat, the
statistics reset before it, so each model's own.

For comparison it records pytagi's published GPU figure for the same network, dataset and
batch (ResNet18, CIFAR-10, batch 64: 142.6 s per epoch, i.e. 50,000 / 142.6 = 350.6
samples/s, as quoted in this project's issue 22; an epoch there includes what its loop does
besides training steps, and its GPU is not ours, so the ratio is indicative only).

  lstm b5, lstm b64 (with --compiled): pytagi's LSTM example network at batch 5 and 64, the
            eager loop against `net.compile()` (the whole step as one inductor program) and
            `net.compile(mode="reduce-overhead")` (that program replayed as a CUDA graph); the
            compile time is left out (one untimed compiled step first), and reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for `common`
from common import RESULTS, command_line, cpu_model, git_describe, write_json  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "gpu.json"
BATCH = 64
PYTAGI_PUBLISHED = {"network": "ResNet18", "dataset": "CIFAR-10", "batch_size": 64,
                    "seconds_per_epoch": 142.6, "train_samples": 50_000,
                    "samples_per_s": 50_000 / 142.6,
                    "source": "pytagi's published GPU figure, as quoted in issue 22; not "
                              "measured here"}
SHAPES = {"resnet18": (3, 32, 32), "cnn": (1, 28, 28)}


def _torch_cnn() -> torch.nn.Module:
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(1, 16, 4, padding=1), nn.ReLU(), nn.AvgPool2d(3, 2),
                         nn.Conv2d(16, 32, 5), nn.ReLU(), nn.AvgPool2d(3, 2), nn.Flatten(),
                         nn.Linear(512, 100), nn.ReLU(), nn.Linear(100, 11))


def make_step(kind: str, network: str, batch: int, device: torch.device) -> Callable[[], None]:
    """One training step of `kind` ("tagi" | "torch") on `network`, all of it on `device`."""
    from dptrain.models import ModelOptions, build_model
    from dptrain.tagi import HRCSoftmax, OutputUpdater, manual_seed

    torch.manual_seed(0)
    manual_seed(0)
    shape = SHAPES[network]
    x = torch.randn(batch, *shape, device=device)
    labels = torch.randint(0, 10, (batch,), device=device)
    if kind == "tagi":
        hrc = HRCSoftmax(10)
        options = ModelOptions(gain_weight=0.083) if network == "resnet18" else None
        name = "tagi-resnet18" if network == "resnet18" else "tagi-cnn"
        net = build_model(name, shape, hrc.num_outputs, options).to(device)
        updater = OutputUpdater(device)
        obs, idx = (t.to(device) for t in hrc.encode(labels.cpu()))

        def tagi_step() -> None:
            net(x)
            updater.update_using_indices(net.output_z_buffer, obs, 0.05 ** 2, idx,
                                         net.input_delta_z_buffer)
            net.backward()
            net.step()
        return tagi_step
    model = (build_model("torch-resnet18", shape, 10) if network == "resnet18"
             else _torch_cnn()).to(device)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()

    def torch_step() -> None:
        optim.zero_grad(set_to_none=True)
        loss_fn(model(x), labels).backward()
        optim.step()
    return torch_step


def measure(kind: str, network: str, batch: int, steps: int, device: torch.device) -> dict:
    """Seconds per step (median of `steps`) and, on CUDA, the peak memory they allocated."""
    step = make_step(kind, network, batch, device)
    cuda = device.type == "cuda"
    step()  # warm-up: allocations, cuDNN's algorithm choice
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    del step
    if cuda:
        torch.cuda.empty_cache()
    return {"seconds_per_step": statistics.median(seconds), "peak_gpu_mb": peak}


def run_case(network: str, batch: int, steps: int, repeats: int,
             device: torch.device) -> dict:
    runs: dict[str, list[dict]] = {"tagi": [], "torch": []}
    for r in range(repeats):
        order = ("tagi", "torch") if r % 2 == 0 else ("torch", "tagi")
        for kind in order:
            runs[kind].append(measure(kind, network, batch, steps, device))
    summary = {}
    for kind, rows in runs.items():
        seconds = statistics.median(row["seconds_per_step"] for row in rows)
        peaks = [row["peak_gpu_mb"] for row in rows if row["peak_gpu_mb"] is not None]
        summary[kind] = {"seconds_per_step": seconds, "samples_per_s": batch / seconds,
                         "peak_gpu_mb": max(peaks) if peaks else None}
    return {"network": network, "batch": batch, "steps": steps, "repeats": repeats,
            **summary,
            "tagi_step_over_torch_step": summary["tagi"]["seconds_per_step"]
            / summary["torch"]["seconds_per_step"], "runs": runs}


def compiled_cases(device: torch.device, steps: int, repeats: int,
                   backend: str = "inductor") -> list[dict]:
    """ms per step of the LSTM example: eager, compiled, compiled + CUDA graph (on CUDA)."""
    from dptrain import tagi

    modes = {"eager": None, "compiled": {}}
    if device.type == "cuda":
        modes["cuda_graph"] = {"mode": "reduce-overhead"}
    rows = []
    for batch in (5, 64):
        steppers, compile_s = {}, {}
        for name, kwargs in modes.items():
            tagi.manual_seed(0)
            net = tagi.Sequential(tagi.LSTM(1, 8, 5), tagi.LSTM(8, 8, 5), tagi.Linear(40, 1)
                                  ).to(device)
            step = net.compile(backend=backend, **(kwargs or {}))
            if kwargs is None:
                step._give_up("the eager reference")  # the plain pytagi loop
            steppers[name] = step
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch, 5, generator=g).to(device)
        y = torch.randn(batch, 1, generator=g).to(device)
        for name, step in steppers.items():
            step(x, y, 0.09)  # eager first step
            start = time.perf_counter()
            step(x, y, 0.09)  # compiles
            _sync(device)
            compile_s[name] = time.perf_counter() - start
        times: dict[str, list[float]] = {name: [] for name in steppers}
        for r in range(repeats):
            for name in (list(steppers) if r % 2 == 0 else list(steppers)[::-1]):
                _sync(device)
                start = time.perf_counter()
                for _ in range(steps):
                    steppers[name](x, y, 0.09)
                _sync(device)
                times[name].append(1e3 * (time.perf_counter() - start) / steps)
        rows.append({"case": f"lstm b{batch}",
                     **{f"{name}_ms": statistics.median(t) for name, t in times.items()},
                     "compile_s": compile_s,
                     "fallbacks": {n: s.fallback_reason for n, s in steppers.items()
                                   if n != "eager"}})
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1 repeat of 3 steps; no JSON")
    p.add_argument("--compiled", action="store_true",
                   help="also the LSTM example: eager vs compiled vs CUDA-graph replay")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device (torch.cuda.is_available() is False); run it on a "
              "machine with a GPU", file=sys.stderr)
        return 1
    if args.quick:
        args.steps, args.repeats = 3, 1
    device = torch.device("cuda", 0)
    results = [run_case(network, BATCH, args.steps, args.repeats, device)
               for network in ("resnet18", "cnn")]
    for r in results:
        print(f"{r['network']:8} batch {r['batch']}: TAGI {r['tagi']['samples_per_s']:,.1f} "
              f"samples/s, peak {r['tagi']['peak_gpu_mb']:,.0f} MB; torch SGD "
              f"{r['torch']['samples_per_s']:,.1f} samples/s, peak "
              f"{r['torch']['peak_gpu_mb']:,.0f} MB; TAGI step / torch step "
              f"{r['tagi_step_over_torch_step']:.2f}x")
    compiled = compiled_cases(device, args.steps * 10, args.repeats) if args.compiled else []
    for r in compiled:
        print(f"{r['case']:8} " + ", ".join(f"{k[:-3]} {v:.3f} ms" for k, v in r.items()
                                           if k.endswith("_ms")) + f"; compile {r['compile_s']}")
    resnet = results[0]["tagi"]["samples_per_s"]
    vs_pytagi = resnet / PYTAGI_PUBLISHED["samples_per_s"]
    print(f"TAGI ResNet18 {resnet:,.1f} samples/s against pytagi's published "
          f"{PYTAGI_PUBLISHED['samples_per_s']:.1f} (142.6 s per CIFAR-10 epoch): "
          f"{vs_pytagi:.2f}x (other GPU, other loop: indicative only)")
    if not args.quick:
        props = torch.cuda.get_device_properties(device)
        write_json(args.output, {
            "command": command_line(("CUDA_VISIBLE_DEVICES",)), "git": git_describe(),
            "gpu": {"name": props.name, "memory_gib": props.total_memory / 2**30,
                    "capability": f"{props.major}.{props.minor}",
                    "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                    "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                    "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32},
            "cpu": cpu_model(), "torch": torch.__version__,
            "environment": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES",)},
            "results": results, "compiled_step": compiled, "pytagi_published": PYTAGI_PUBLISHED,
            "tagi_resnet18_over_pytagi_published": vs_pytagi})
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
