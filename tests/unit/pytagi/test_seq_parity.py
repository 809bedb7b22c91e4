"""Parity with the pytagi 0.2.1 wheel on the recorded cases of tests/data/pytagi_fixtures_seq.npz
(harness: tests/unit/pytagi/parity.py; recorder: tests/data/make_pytagi_fixtures.py, family
"seq"): an Embedding with a padding id in front of Linear layers, and an SLSTM stack run
over a series one step per call, smoothed with pytagi's smoother."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dptrain.tagi import SLSTM, Embedding, Linear, ReLU, Sequential, SLinear
from tests.unit.pytagi.parity import (RTOL, SEQ_FIXTURES, Case, Result, load_case,
                                     load_initial_parameters, replay, standard_update)

#: Every test here compares what this machine computes with pytagi's steps recorded on another
#: machine (tests/data), at a tolerance (RTOL) that its kernels cannot break: docs/design.md,
#: contract 12.
pytestmark = pytest.mark.recorded

F64 = torch.float64
DTYPES = pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])


def _emb_linear(dtype):
    return Sequential(Embedding(6, 3, input_size=3, scale=0.7, padding_idx=0), Linear(9, 4),
                      ReLU(), Linear(4, 2), dtype=dtype)


def _embedding_variance_rule(net: Sequential, case: Case, k: int, result: Result) -> None:
    """The deliberate difference (docs/tagi.md, Departures from pytagi): pytagi's backward
    proposes Δv_W = v_W Σ δv; ours is v_W² Σ δv, i.e. pytagi's recorded value times the
    v_W the step started from. (step() leaves the deltas in place, so they are still there.)"""
    before = case.init if k == 0 else case.after(k - 1)
    intended = case.deltas(k)["0.delta_var_w"] * before["0.var_w"]
    result.check(dict(net.named_delta_tensors())["0.delta_var_w"], intended,
                 f"step{k} rule 0.delta_var_w")


@DTYPES
def test_embedding_replay_matches_pytagi(dtype):
    """Outputs, every delta and the parameters after two steps (the cap binds on the table:
    |Δm|/bar up to 1.5), and the eval forward. The one recorded difference is the table's
    Δv, which the recorder handed to pytagi's step() in the corrected form, so everything
    after it is compared as is."""
    net = _emb_linear(dtype)
    case = load_case("emb_linear", SEQ_FIXTURES)
    assert (case["x0"] == 0).any() and len(np.unique(case["x0"])) < case["x0"].size, \
        "the case must hold the padding id and repeated ids"
    result = replay(net, case, on_step=_embedding_variance_rule)
    result.assert_ok(expected_failures={"step0 0.delta_var_w", "step1 0.delta_var_w"})


SMOOTHER_STEPS = 8  # the recorder's first pass; two more steps follow the smoother


def _slstm_stack(dtype):
    return Sequential(SLSTM(3, 4, 1), SLSTM(4, 4, 1), SLinear(4, 1), dtype=dtype)


def _replay_series(net: Sequential, case: Case, rtol: float = RTOL) -> Result:
    """pytagi's time-series loop on the recorded series: every step's output, deltas and
    parameters; before the smoother the carried states, then `smoother()`'s output and every
    SLSTM's smoothed states; two steps after it (they start from zero states) and an eval
    forward."""
    result = Result(case.name)
    load_initial_parameters(net, case)
    slstms = {path: layer for path, layer in net.named_leaves() if isinstance(layer, SLSTM)}
    for k in range(SMOOTHER_STEPS + 2):
        if k == SMOOTHER_STEPS:
            for path, layer in slstms.items():
                for name in ("mu_h", "var_h", "mu_c", "var_c"):
                    result.check(getattr(layer, f"{name}_prior"), case[f"carried/{path}.{name}"],
                                 f"carried {path}.{name}", rtol)
            mu, var = net.smoother()
            assert mu.shape == (SMOOTHER_STEPS, 1, 1)
            result.check(mu, case["smooth/out_mu"], "smooth out_mu", rtol)
            result.check(var, case["smooth/out_var"], "smooth out_var", rtol)
            for path, layer in slstms.items():
                for name in ("mu_h", "var_h", "mu_c", "var_c"):
                    result.check(getattr(layer, f"{name}_smooths"),
                                 case[f"smooth/{path}.{name}"], f"smooth {path}.{name}", rtol)
        mu, var = net(case[f"x{k}"])
        result.check(mu, case[f"step{k}/out_mu"], f"step{k} out_mu", rtol)
        result.check(var, case[f"step{k}/out_var"], f"step{k} out_var", rtol)
        standard_update(net, case, k)
        net.backward()
        for key, value in sorted(case.deltas(k).items()):
            result.check(dict(net.named_delta_tensors())[key], value, f"step{k} {key}", rtol)
        net.step()
        for key, value in sorted(case.after(k).items()):
            result.check(dict(net.named_parameter_tensors())[key], value,
                         f"step{k} after {key}", rtol)
    net.eval()
    mu, var = net(case["x_eval"])
    result.check(mu, case["eval/out_mu"], "eval out_mu", rtol)
    result.check(var, case["eval/out_var"], "eval out_var", rtol)
    return result


@DTYPES
def test_slstm_series_and_smoother_match_pytagi(dtype):
    """Eight steps of one series (a missing target at step 2), the smoother, two steps after
    it; every comparison within 1e-5 of pytagi."""
    case = load_case("slstm_smoother", SEQ_FIXTURES)
    assert np.isnan(case["y2"]).all()
    result = _replay_series(_slstm_stack(dtype), case)
    result.assert_ok()
    assert len(result.checked) == 10 * 26 + 8 + 10 + 2  # steps, carried, smoothed, eval


def test_the_smoother_replay_notices_a_missing_reset():
    """Without the reset of the carried states at the end of smoother(), the steps after it
    differ from pytagi: the fixture pins the reset."""
    net = _slstm_stack(F64)
    for layer in net.layers[:2]:
        layer.reset_lstm_states = lambda: None
    result = _replay_series(net, load_case("slstm_smoother", SEQ_FIXTURES))
    assert "step8 out_mu" in result.failures and "step7 out_mu" not in result.failures
