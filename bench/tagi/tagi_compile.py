"""torch.compile (inductor) on the TAGI engine's elementwise hot paths, eager vs compiled, one run.

    .venv/bin/python bench/tagi/tagi_compile.py            # writes bench/results/tagi_compile.json
    .venv/bin/python bench/tagi/tagi_compile.py --quick    # smoke run, writes nothing

Where a TAGI step is hundreds of small tensor operations (FNN at batch 32, heteroscedastic
regression at batch 10, the LSTM), the question is whether fusing the elementwise work with
inductor pays. The compiled variant swaps these pure functions for `torch.compile`d ones:

  the capped step        sqrt, bounds, clamp, add, variance floor: one fused kernel
  output updates         `_innovations` (HRC / plain) and `_agvi_innovations` (heteroscedastic)
  activation moments     ReLU, EvenExp
  LSTM elementwise core  gate moments, cell and hidden states, gate coefficients (the ~60
                         small ops per layer between its matrix products)

Matrix products stay torch's either way. Two networks are built from the same seed, one stepped
eagerly and one through the compiled functions, alternating repeats of the same batches; a figure
is the median over repeats. Printed per case: eager and compiled ms per step, their ratio, the
compile time (first compiled step minus an eager one, with a fresh inductor cache, so a cold
start), the break-even number of steps (compile time / time saved per step; "never" where
compiled is not faster), and the largest difference of the parameters after the first step
relative to the largest parameter (compiled kernels may round differently). The engine adopts
no switch unless this shows a win.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

# A fresh inductor cache, so the compile time printed is what a first run pays.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dptrain import tagi  # noqa: E402
from dptrain.tagi import activations, base, lstm, output_updater  # noqa: E402
from dptrain.tagi.base import VAR_FLOOR  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS, command_line, git_describe, hardware, write_json  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "tagi_compile.json"


def _fused_capped_update(params: torch.Tensor, deltas: torch.Tensor, inverse_cap: float) -> None:
    bar = torch.sqrt(params[1]) * inverse_cap
    new = params + torch.clamp(deltas, -bar, bar)
    params[0].copy_(new[0])
    params[1].copy_(F.threshold(new[1], 0.0, VAR_FLOOR))


@contextlib.contextmanager
def compiled_hot_paths() -> Iterator[None]:
    """Within: the engine calls compiled versions of its elementwise hot paths."""
    step = torch.compile(_fused_capped_update, dynamic=False)
    swaps: list[tuple[object, str, Callable]] = [
        (base.StepRows, "capped_update_",
         lambda rows, factor: step(rows.params, rows.deltas, 1.0 / factor)),
        (output_updater, "_innovations", torch.compile(output_updater._innovations)),
        (output_updater, "_agvi_innovations", torch.compile(output_updater._agvi_innovations)),
        (activations.ReLU, "moments", torch.compile(activations.ReLU.moments)),
        (activations.EvenExp, "moments", torch.compile(activations.EvenExp.moments)),
        (lstm, "_gate_moments", torch.compile(lstm._gate_moments, dynamic=False)),
        (lstm.LSTM, "_cell_state", torch.compile(lstm.LSTM._cell_state, dynamic=False)),
        (lstm.LSTM, "_hidden_state", torch.compile(lstm.LSTM._hidden_state, dynamic=False)),
        (lstm.LSTM, "_gate_coefficients",
         torch.compile(lstm.LSTM._gate_coefficients, dynamic=False)),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    for owner, name, fn in swaps:
        setattr(owner, name, fn)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


class Case:
    """A network, its data and its training step at one batch size."""

    def __init__(self, name: str, build: Callable[[], tagi.Sequential], x: torch.Tensor,
                 y: torch.Tensor, batch: int, update: Callable) -> None:
        self.name, self.build, self.x, self.y, self.batch = name, build, x, y, batch
        self.update = update

    def steps(self, net: tagi.Sequential, updater: tagi.OutputUpdater, first: int,
              count: int) -> float:
        n = len(self.x) // self.batch
        start = time.perf_counter()
        for k in range(first, first + count):
            s = slice((k % n) * self.batch, (k % n + 1) * self.batch)
            net(self.x[s])
            self.update(updater, net, self.y[s])
            net.backward()
            net.step()
        return time.perf_counter() - start


def cases() -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    hrc = tagi.HRCSoftmax(num_classes=10)
    x = torch.randn(32 * 64, 784, generator=gen)
    y_obs, y_idx = hrc.encode(torch.randint(0, 10, (32 * 64,), generator=gen))
    labels = torch.cat([y_obs, y_idx.double()], 1)

    def hrc_update(updater, net, y):
        updater.update_using_indices(net.output_z_buffer, y[:, :4], 0.0025, y[:, 4:].long(),
                                     net.input_delta_z_buffer)

    def heteros_update(updater, net, y):
        updater.update_heteros(net.output_z_buffer, y, net.input_delta_z_buffer)

    def plain_update(updater, net, y):
        updater.update(net.output_z_buffer, y, 0.09, net.input_delta_z_buffer)

    out = [
        Case("fnn b32", lambda: tagi.Sequential(
            tagi.Linear(784, 128), tagi.ReLU(), tagi.Linear(128, 128), tagi.ReLU(),
            tagi.Linear(128, hrc.num_outputs)), x, labels, 32, hrc_update),
        Case("heteros b10", lambda: tagi.Sequential(
            tagi.Linear(1, 128), tagi.ReLU(), tagi.Linear(128, 128), tagi.ReLU(),
            tagi.Linear(128, 2), tagi.EvenExp()),
            torch.linspace(-1, 1, 500).unsqueeze(1), torch.randn(500, 1, generator=gen), 10,
            heteros_update),
    ]
    if hasattr(tagi, "LSTM"):  # pytagi's time-series network: 2 LSTM layers, window 5
        out.append(Case("lstm b5", lambda: tagi.Sequential(
            tagi.LSTM(1, 8, 5), tagi.LSTM(8, 8, 5), tagi.Linear(8 * 5, 1)),
            torch.randn(500, 5, generator=gen), torch.randn(500, 1, generator=gen), 5,
            plain_update))
    return out


def measure(case: Case, repeats: int, steps: int) -> dict:
    tagi.manual_seed(0)
    eager_net, eager_upd = case.build(), None
    tagi.manual_seed(0)
    compiled_net = case.build()
    eager_upd, compiled_upd = (tagi.OutputUpdater(eager_net.device),
                               tagi.OutputUpdater(compiled_net.device))
    eager_first = case.steps(eager_net, eager_upd, 0, 1)
    with compiled_hot_paths():
        compile_s = case.steps(compiled_net, compiled_upd, 0, 1) - eager_first
    # after one step: later, rounding differences grow along the two training trajectories
    a, b = eager_net.flat_params, compiled_net.flat_params
    first_step_diff = float((a - b).abs().max() / a.abs().max())
    # warm start: dynamo forgets its graphs but inductor's on-disk cache keeps the kernels,
    # which is what a second process with the same cache pays
    eager_second = case.steps(eager_net, eager_upd, 1, 1)
    torch._dynamo.reset()
    with compiled_hot_paths():
        warm_compile_s = case.steps(compiled_net, compiled_upd, 1, 1) - eager_second
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    position = 2
    for r in range(repeats):
        order = ["eager", "compiled"] if r % 2 == 0 else ["compiled", "eager"]
        for which in order:
            if which == "eager":
                times[which].append(case.steps(eager_net, eager_upd, position, steps))
            else:
                with compiled_hot_paths():
                    times[which].append(case.steps(compiled_net, compiled_upd, position, steps))
        position += steps
    eager_ms, compiled_ms = (1e3 * statistics.median(times[k]) / steps for k in times)
    saved_s = (eager_ms - compiled_ms) / 1e3
    return {"case": case.name, "eager_ms": eager_ms, "compiled_ms": compiled_ms,
            "speedup": eager_ms / compiled_ms, "compile_s": compile_s,
            "warm_compile_s": warm_compile_s,
            "break_even_steps": compile_s / saved_s if saved_s > 0 else None,
            "max_rel_param_diff": first_step_diff}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=200, help="training steps per repeat")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="2 repeats of 20 steps; writes nothing")
    p.add_argument("--case", action="append", choices=[c.name for c in cases()],
                   help="run only this case (repeatable; default all)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 2, 20
    torch.set_num_threads(args.threads)
    rows = [measure(case, args.repeats, args.steps) for case in cases()
            if args.case is None or case.name in args.case]
    print(f"{'case':12} {'eager ms':>9} {'compiled':>9} {'speedup':>8} {'compile s':>10} "
          f"{'warm s':>7} {'break-even steps':>17} {'max rel diff':>13}")
    for r in rows:
        even = "never" if r["break_even_steps"] is None else f"{r['break_even_steps']:.0f}"
        print(f"{r['case']:12} {r['eager_ms']:9.3f} {r['compiled_ms']:9.3f} "
              f"{r['speedup']:7.2f}x {r['compile_s']:10.1f} {r['warm_compile_s']:7.1f} "
              f"{even:>17} "
              f"{r['max_rel_param_diff']:13.1e}")
    if not args.quick:
        write_json(args.output, {"command": command_line(), "rows": rows, "repeats": args.repeats,
                                 "steps": args.steps, "threads": args.threads,
                                 "hardware": hardware(), "git": git_describe(),
                                 "torch": torch.__version__})


if __name__ == "__main__":
    main()
