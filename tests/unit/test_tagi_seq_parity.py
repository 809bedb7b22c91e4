"""Parity with the pytagi 0.2.1 wheel on the recorded cases of tests/data/pytagi_fixtures_seq.npz
(harness: tests/unit/pytagi_parity.py; recorder: tests/data/make_pytagi_fixtures.py, family
"seq"): an Embedding with a padding id in front of Linear layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dptrain.tagi import Embedding, Linear, ReLU, Sequential
from tests.unit.pytagi_parity import SEQ_FIXTURES, Case, Result, load_case, replay

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
