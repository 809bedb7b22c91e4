"""The whole TAGI training step as one compiled program (`Sequential.compile()`) vs the eager loop.

    .venv/bin/python bench/tagi/tagi_compiled_step.py --cpp-wrapper   # writes the JSON below
    .venv/bin/python bench/tagi/tagi_compiled_step.py --quick         # smoke run, writes nothing
    .venv/bin/python bench/tagi/tagi_compiled_step.py --threads 2 [--no-thread-rule] --output F
        # eager on 2 threads; compiled with the engine's thread rule (or without: 2 threads)
    .venv/bin/python bench/tagi/tagi_compiled_step.py --native --cpp-wrapper --case 'lstm b5' ...
        # the native step (LSTM, Linear and ReLU stacks) beside inductor's two programs

(bench/results/tagi_compiled_step.json)

Cases: the FNN 784-128-128-11 (HRC) at batch 32, heteroscedastic regression at batch 10, and
pytagi's LSTM example network at batch 5, 64 and 256, and a wider LSTM (two layers of 64 over
24 steps, as a forecasting model) at batch 32 and 128. Two networks from the same seed, one
stepped by the eager pytagi loop, one by `net.compile(...)`, alternating repeats of the same
batches (which goes first alternates too), one thread; a figure is the median over repeats,
with the spread (min-max over repeats) printed beside it, as the machine may be shared, and
the median CPU time per step of this process (which leaves out the time other work held the
core).
With --cpp-wrapper a third network, compiled with inductor's C++ wrapper, joins the
alternation ("compiled" is then the Python wrapper); with --native, one stepped by the native
library (native.py, where the network is one it does; its compile time is the library's
build in a fresh cache for the first such case, and ~0 after: the build is cached). "compiled"
and "compiled_cpp" are always inductor's programs. Per case: eager and compiled ms per step,
their ratio, compile time (first compiled step minus an eager one, fresh inductor cache), break-even steps (compile time / time saved per step),
resident memory added by compiling, and the largest parameter difference after the first
compiled step relative to the largest parameter.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
os.environ.setdefault("DPTRAIN_NATIVE_CACHE", tempfile.mkdtemp(prefix="native-"))

import torch  # noqa: E402

from dptrain import tagi  # noqa: E402
from dptrain.tagi.compiled import SINGLE_THREAD_WORK, CompiledStep  # noqa: E402
from dptrain.tagi.native import NotNative, check_network  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS, command_line, git_describe, hardware, write_json  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "tagi_compiled_step.json"
VARIANTS = {"compiled", "compiled_cpp", "native"}


def _lstm():
    return tagi.Sequential(tagi.LSTM(1, 8, 5), tagi.LSTM(8, 8, 5), tagi.Linear(40, 1))


def _wide_lstm():
    return tagi.Sequential(tagi.LSTM(2, 64, 24), tagi.LSTM(64, 64, 24), tagi.Linear(64 * 24, 1))


def cases() -> dict[str, tuple]:
    """name: (build, update, batch, input width, target width)."""
    hrc = tagi.HRCSoftmax(num_classes=10)
    def fnn() -> tagi.Sequential:
        return tagi.Sequential(tagi.Linear(784, 128), tagi.ReLU(), tagi.Linear(128, 128),
                               tagi.ReLU(), tagi.Linear(128, hrc.num_outputs))

    def heteros() -> tagi.Sequential:
        return tagi.Sequential(tagi.Linear(1, 128), tagi.ReLU(), tagi.Linear(128, 128),
                               tagi.ReLU(), tagi.Linear(128, 2), tagi.EvenExp())

    return {"fnn b32": (fnn, "indices", 32, 784, hrc.num_outputs),
            "heteros b10": (heteros, "heteros", 10, 1, 2),
            "lstm b5": (_lstm, "plain", 5, 5, 1), "lstm b64": (_lstm, "plain", 64, 5, 1),
            "lstm b256": (_lstm, "plain", 256, 5, 1),
            "lstm h64 b32": (_wide_lstm, "plain", 32, 48, 1),
            "lstm h64 b128": (_wide_lstm, "plain", 128, 48, 1)}


def _native_applies(net: tagi.Sequential, update: str) -> bool:
    try:
        check_network(net, update)
    except NotNative:
        return False
    return True


def batches(update: str, batch: int, width: int, out: int, count: int = 20) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(count):
        x = torch.randn(batch, width, generator=g)
        if update == "indices":
            rows.append((x, torch.randn(batch, 4, generator=g), 0.0025,
                         torch.randint(1, out + 1, (batch, 4), generator=g)))
        else:
            rows.append((x, torch.randn(batch, out // 2 if update == "heteros" else out,
                                        generator=g), 0.09, None))
    return rows


#: CPU seconds of the last `run` (this process's: on a shared machine the wall time also
#: counts the time other work held the core)
LAST_CPU_SECONDS = [0.0]


def run(step, data, first: int, count: int) -> float:
    start, cpu_start = time.perf_counter(), time.process_time()
    for k in range(first, first + count):
        x, y, var_y, idx = data[k % len(data)]
        step(x, y, var_y, idx)
    LAST_CPU_SECONDS[0] = time.process_time() - cpu_start
    return time.perf_counter() - start


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(name: str, repeats: int, steps: int, cpp_wrapper: bool = False,
            thread_rule: bool = True, native: bool = False) -> dict:
    """Eager vs compiled (and, with `cpp_wrapper`, compiled with inductor's C++ wrapper; with
    `native`, the native step), all stepped in one alternating sequence."""
    build, update, batch, width, out = cases()[name]
    tagi.manual_seed(0)
    eager = build().compile(update, backend="eager")  # dynamo's "eager" is never used:
    eager._give_up("the eager reference")  # this CompiledStep runs the plain pytagi loop
    steppers = {"eager": eager}
    for variant, options in (("compiled", {"cpp_wrapper": False}),
                             ("compiled_cpp", {"cpp_wrapper": True})):
        if variant == "compiled_cpp" and not cpp_wrapper:
            continue
        tagi.manual_seed(0)
        steppers[variant] = CompiledStep(build(), update, options=options,
                                         single_thread_work=SINGLE_THREAD_WORK
                                         if thread_rule else None, native=False)
    tagi.manual_seed(0)
    network = build()
    if native and _native_applies(network, update):
        steppers["native"] = CompiledStep(network, update, native=True)
    data = batches(update, batch, width, out)
    for step in steppers.values():
        run(step, data, 0, 1)  # the first step is eager
    eager_s = run(eager, data, 1, 1)
    row: dict = {"case": name, "batch": batch}
    for variant, step in steppers.items():
        if variant == "eager":
            continue
        before = rss_mib()
        compile_s = max(0.0, run(step, data, 1, 1) - eager_s)  # (a cached build: ~0)
        a, b = eager.net.flat_params, step.net.flat_params
        row[variant] = {"compile_s": compile_s, "compile_rss_mib": rss_mib() - before,
                        "max_rel_param_diff": float((a - b).abs().max() / a.abs().max()),
                        "fallback": step.fallback_reason}
    times: dict[str, list[float]] = {k: [] for k in steppers}
    cpu: dict[str, list[float]] = {k: [] for k in steppers}
    position = 2
    for r in range(repeats):
        order = list(steppers) if r % 2 == 0 else list(steppers)[::-1]
        for which in order:
            times[which].append(1e3 * run(steppers[which], data, position, steps) / steps)
            cpu[which].append(1e3 * LAST_CPU_SECONDS[0] / steps)
        position += steps
    row["eager_ms"] = statistics.median(times["eager"])
    row["eager_ms_range"] = [min(times["eager"]), max(times["eager"])]
    row["eager_cpu_ms"] = statistics.median(cpu["eager"])
    for variant in row.keys() & VARIANTS:
        ms = statistics.median(times[variant])
        saved = (row["eager_ms"] - ms) / 1e3
        cpu_ms = statistics.median(cpu[variant])
        row[variant].update(ms=ms, ms_range=[min(times[variant]), max(times[variant])],
                            cpu_ms=cpu_ms, cpu_speedup=row["eager_cpu_ms"] / cpu_ms,
                            speedup=row["eager_ms"] / ms,
                            break_even_steps=row[variant]["compile_s"] / saved
                            if saved > 0 else None)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=200, help="training steps per repeat")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="2 repeats of 20 steps; writes nothing")
    p.add_argument("--case", action="append", choices=list(cases()),
                   help="run only this case (repeatable; default all)")
    p.add_argument("--cpp-wrapper", action="store_true",
                   help="also inductor's cpp_wrapper (the program's glue as C++, not Python), "
                        "in the same alternation")
    p.add_argument("--native", action="store_true",
                   help="also the native step (LSTM, Linear, ReLU and EvenExp stacks), in the "
                        "same alternation")
    p.add_argument("--no-thread-rule", action="store_true",
                   help="compiled steps on --threads whatever their size (default: a small "
                        "step's program on one thread, SINGLE_THREAD_WORK)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 2, 20
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.case or list(cases()):
        rows.append(measure(name, args.repeats, args.steps, args.cpp_wrapper,
                            not args.no_thread_rule, args.native))
        r = rows[-1]
        print(f"{name:12} eager {r['eager_ms']:.3f} ms {r['eager_ms_range']} "
              f"(CPU {r['eager_cpu_ms']:.3f} ms)", flush=True)
        for variant in sorted(VARIANTS):
            if variant in r:
                v = r[variant]
                even = "never" if v["break_even_steps"] is None else f"{v['break_even_steps']:.0f}"
                print(f"  {variant:12} {v['ms']:.3f} ms {v['ms_range']} {v['speedup']:.2f}x "
                      f"(CPU {v['cpu_ms']:.3f} ms, {v['cpu_speedup']:.2f}x), "
                      f"compile {v['compile_s']:.1f} s, break-even {even} steps, "
                      f"+{v['compile_rss_mib']:.0f} MiB, diff {v['max_rel_param_diff']:.1e}",
                      flush=True)
    if not args.quick:
        write_json(args.output, {"command": command_line(), "rows": rows, "repeats": args.repeats,
                                 "steps": args.steps, "threads": args.threads,
                                 "thread_rule": not args.no_thread_rule,
                                 "cpp_wrapper": args.cpp_wrapper, "native": args.native,
                                 "hardware": hardware(), "git": git_describe(),
                                 "torch": torch.__version__})


if __name__ == "__main__":
    main()
