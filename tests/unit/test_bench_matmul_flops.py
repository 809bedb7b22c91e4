"""The FNN benchmark's matmul fraction divides our time by the time of the products it counts:
the products the matmul runner performs must be exactly those the FLOP count assumes, and the
TAGI engine must perform the same ones (torch's FLOP counter as the independent oracle)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from dptrain import tagi

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "pytagi" / "tagi_vs_pytagi.py"


def _bench_module():
    path = list(sys.path)  # the script puts bench/ on it, for its shared `common` package
    try:
        spec = importlib.util.spec_from_file_location("tagi_vs_pytagi", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module


def _addmm_inplace_flops(self_shape, mat1_shape, mat2_shape, *_, out_shape=None, **__) -> int:
    rows, inner = mat1_shape
    return 2 * rows * inner * mat2_shape[1]


def _counted(fn) -> int:
    # The counter knows addmm but not its in-place form, which the engine uses for v_A (m_W² +
    # v_W)ᵀ: same product, same formula.
    inplace = {torch.ops.aten.addmm_: _addmm_inplace_flops}
    with FlopCounterMode(display=False, custom_mapping=inplace) as counter:
        fn()
    return counter.get_total_flops()


def test_counted_flops_are_the_products_of_a_tagi_step():
    bench = _bench_module()
    layers, batch = ((20, 12), (12, 12), (12, 11)), 5
    runner = bench.MatmulBench(layers, [batch], threads=torch.get_num_threads(), seed=0)
    assert bench.linear_flops(bench.FNN_LAYERS, 1, True) == 1_051_904  # the documented count
    assert bench.linear_flops(bench.FNN_LAYERS, 1, False) == 508_160
    for train in (True, False):
        want = bench.linear_flops(layers, batch, train)
        assert _counted(lambda: runner._products(batch, train)) == want
    # The engine's own step: forward + index update + backward + step, and an eval forward.
    tagi.manual_seed(0)
    net = tagi.Sequential(tagi.Linear(20, 12), tagi.ReLU(), tagi.Linear(12, 12), tagi.ReLU(),
                          tagi.Linear(12, 11))
    updater, hrc = tagi.OutputUpdater(), tagi.HRCSoftmax(10)
    x = torch.randn(batch, 20)
    obs, idx = hrc.encode(torch.arange(batch))

    def step():
        net(x)
        updater.update_using_indices(net.output_z_buffer, obs, 0.05**2, idx,
                                     net.input_delta_z_buffer)
        net.backward()
        net.step()

    assert _counted(step) == bench.linear_flops(layers, batch, True)
    net.eval()
    assert _counted(lambda: net(x)) == bench.linear_flops(layers, batch, False)
