"""Tensor operations per TAGI training step on the small-batch networks, counted, not timed.

    .venv/bin/python bench/tagi/tagi_op_count.py
    PYTHONPATH=<another checkout>/src .venv/bin/python bench/tagi/tagi_op_count.py   # to compare

At batch 5 or 10 a step's time is the fixed cost of each tensor operation (dispatch, a fresh
output, a kernel launch of a few dozen elements), so the count is the figure that load on a
shared machine cannot blur. Counted: every ATen operation dispatched during one forward +
update + backward + step (views included; a Python number wrapped into a tensor is not
counted, though it costs about as much), after three warm-up steps. Prints the count per
network and the five source lines with the most operations.
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dptrain import tagi


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.by_line: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [f for f in traceback.extract_stack() if "/dptrain/" in f.filename]
        where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
        self.by_line[where] += 1
        return func(*args, **(kwargs or {}))


def cases() -> dict[str, tuple]:
    gen = torch.Generator().manual_seed(0)
    hrc = tagi.HRCSoftmax(num_classes=10)
    obs, idx = hrc.encode(torch.randint(0, 10, (32,), generator=gen))
    y5, y10 = torch.randn(5, 1, generator=gen), torch.randn(10, 1, generator=gen)
    return {
        "lstm b5": (lambda: tagi.Sequential(tagi.LSTM(1, 8, 5), tagi.LSTM(8, 8, 5),
                                            tagi.Linear(8 * 5, 1)),
                    torch.randn(5, 5, generator=gen),
                    lambda u, net: u.update(net.output_z_buffer, y5, 0.09,
                                            net.input_delta_z_buffer)),
        "fnn b32": (lambda: tagi.Sequential(tagi.Linear(784, 128), tagi.ReLU(),
                                            tagi.Linear(128, 128), tagi.ReLU(),
                                            tagi.Linear(128, hrc.num_outputs)),
                    torch.rand(32, 784, generator=gen),
                    lambda u, net: u.update_using_indices(net.output_z_buffer, obs, 0.0025, idx,
                                                          net.input_delta_z_buffer)),
        "heteros b10": (lambda: tagi.Sequential(tagi.Linear(1, 128), tagi.ReLU(),
                                                tagi.Linear(128, 128), tagi.ReLU(),
                                                tagi.Linear(128, 2), tagi.EvenExp()),
                        torch.rand(10, 1, generator=gen),
                        lambda u, net: u.update_heteros(net.output_z_buffer, y10,
                                                        net.input_delta_z_buffer)),
    }


def count(build, x, update) -> _Counter:
    tagi.manual_seed(0)
    net = build()
    updater = tagi.OutputUpdater(net.device)

    def step() -> None:
        net(x)
        update(updater, net)
        net.backward()
        net.step()

    for _ in range(3):
        step()
    with _Counter() as counter:
        step()
    return counter


def main() -> None:
    for name, case in cases().items():
        counter = count(*case)
        top = ", ".join(f"{line} {n}" for line, n in counter.by_line.most_common(5))
        print(f"{name:12} {sum(counter.by_line.values()):4d} ops per step  (most: {top})")


if __name__ == "__main__":
    main()
