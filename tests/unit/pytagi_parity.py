"""Parity harness: replay a case recorded from the pytagi 0.2.1 wheel on a dptrain network.

tests/data/pytagi_fixtures.npz (made by tests/data/make_pytagi_fixtures.py, whose docstring
describes the keys) holds, per case, pytagi's initial parameters, two training steps (inputs,
observations, outputs, every layer's deltas, the parameters after `step()`, BatchNorm
statistics) and an eval forward. A test builds the same architecture with dptrain's layers and
calls::

    case = load_case("cnn")
    net = Sequential(Conv2d(2, 3, 3, padding=1, in_width=6, in_height=6), ..., dtype=F64)
    result = replay(net, case)              # loads case.init, runs the two steps and the eval
    result.assert_ok()                      # every comparison within ~1e-5 relative

Layer paths are the fixture's ("3", "2.main.0", "2.short.0"), which are also dptrain's
`state_dict` paths. `replay(..., on_step=...)` adds case-specific comparisons (e.g. BatchNorm
running statistics, via `compare`), `update=...` replaces the standard output update, and
`result.assert_ok(expected_failures=...)` documents a deliberate difference from pytagi: the
named comparisons must fail (so the test notices when they stop differing) and the test then
checks our intended value itself.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from dptrain.tagi import OutputUpdater, Sequential

FIXTURES = Path(__file__).resolve().parent.parent / "data" / "pytagi_fixtures.npz"
PARAM_NAMES = ("mu_w", "var_w", "mu_b", "var_b")
#: pytagi computes in float32; our float64 replay agrees to a few 1e-7 on these small nets.
RTOL = 1e-5


@lru_cache(maxsize=1)
def _all_arrays() -> dict[str, np.ndarray]:
    with np.load(FIXTURES) as data:
        return {key: data[key] for key in data.files}


def case_names() -> list[str]:
    return sorted({key.split("/", 1)[0] for key in _all_arrays()})


@dataclass(frozen=True)
class Case:
    """One recorded case; `case["x0"]` is the array stored as `<name>/x0`."""

    name: str
    arrays: dict[str, np.ndarray]

    def __getitem__(self, key: str) -> np.ndarray:
        return self.arrays[key]

    def group(self, prefix: str) -> dict[str, np.ndarray]:
        """Arrays directly under `<prefix>/` (not in deeper folders), keyed by the rest."""
        cut = len(prefix) + 1
        return {key[cut:]: value for key, value in self.arrays.items()
                if key.startswith(prefix + "/") and "/" not in key[cut:]}

    @property
    def init(self) -> dict[str, np.ndarray]:
        """`<layer>.<mu_w|var_w|mu_b|var_b>` right after pytagi's first forward."""
        return self.group("init")

    def deltas(self, k: int) -> dict[str, np.ndarray]:
        """`<layer>.<delta_mu_w|...>` after step k's backward (out_mu/out_var excluded)."""
        return {key: value for key, value in self.group(f"step{k}").items()
                if not key.startswith("out_")}

    def after(self, k: int) -> dict[str, np.ndarray]:
        return self.group(f"step{k}/after")

    def norm(self, k: int) -> dict[str, np.ndarray]:
        """BatchNorm statistics of step k, keyed by pytagi's display name (see the docstring of
        tests/data/make_pytagi_fixtures.py)."""
        return self.group(f"step{k}/norm")


def load_case(name: str) -> Case:
    """The arrays stored under the key prefix `<name>/`."""
    prefix = name + "/"
    arrays = {key[len(prefix):]: value for key, value in _all_arrays().items()
              if key.startswith(prefix)}
    if not arrays:
        raise KeyError(f"no case {name!r} in {FIXTURES.name}; cases: {case_names()}")
    return Case(name, arrays)


def compare(got: torch.Tensor, want: np.ndarray, what: str, rtol: float = RTOL) -> str | None:
    """None if `got` matches pytagi's `want` elementwise within rtol·(|want| + max|want|/10),
    else a one-line description of the worst element.

    The absolute part (a tenth of the array's scale) keeps float32 cancellation in pytagi's
    near-zero entries from failing a test; a formula error is far larger than either part.
    """
    got_flat = got.detach().to("cpu", torch.float64).reshape(-1)
    want_flat = torch.from_numpy(np.asarray(want, dtype=np.float64)).reshape(-1)
    if got_flat.numel() != want_flat.numel():
        return f"{what}: {got_flat.numel()} values, pytagi has {want_flat.numel()}"
    scale = want_flat.abs().max().item() if want_flat.numel() else 0.0
    err = (got_flat - want_flat).abs()
    bound = rtol * (want_flat.abs() + 0.1 * scale) + 1e-30
    if bool((err <= bound).all()):
        return None
    worst = int(torch.argmax(err / bound))
    return (f"{what}: index {worst}: ours {got_flat[worst].item():.9g}, pytagi "
            f"{want_flat[worst].item():.9g} (|diff| {err[worst].item():.3g}, "
            f"scale {scale:.3g})")


@dataclass
class Result:
    """What `replay` compared: `checked` names every comparison, `failures` the failed ones."""

    case: str
    checked: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)

    def record(self, what: str, problem: str | None) -> None:
        self.checked.append(what)
        if problem is not None:
            self.failures[what] = problem

    def check(self, got: torch.Tensor, want: np.ndarray, what: str, rtol: float = RTOL) -> None:
        self.record(what, compare(got, want, what, rtol))

    def assert_ok(self, expected_failures: Collection[str] = ()) -> None:
        """Every comparison passed, except exactly the `expected_failures` (names as in
        `checked`, e.g. "step0 2.delta_mu_w"), which must fail: a deliberate difference."""
        unknown = sorted(set(expected_failures) - set(self.checked))
        assert not unknown, f"{self.case}: expected failures never compared: {unknown}"
        unexpected = {k: v for k, v in self.failures.items() if k not in expected_failures}
        assert not unexpected, (f"{self.case}: {len(unexpected)} of {len(self.checked)} "
                                "comparisons differ from pytagi:\n  " +
                                "\n  ".join(unexpected.values()))
        agreeing = sorted(set(expected_failures) - set(self.failures))
        assert not agreeing, f"{self.case}: expected to differ from pytagi but agree: {agreeing}"


def load_initial_parameters(net: Sequential, case: Case) -> None:
    """Copy pytagi's initial parameters into `net`; their keys must be exactly the network's
    parameter keys (other state, e.g. running statistics, keeps its value)."""
    state = net.state_dict()
    ours = {key for key in state if key.rsplit(".", 1)[-1] in PARAM_NAMES}
    theirs = set(case.init)
    assert ours == theirs, (f"{case.name}: parameters differ from the fixture: only ours "
                            f"{sorted(ours - theirs)}, only pytagi's {sorted(theirs - ours)}")
    for key in ours:
        state[key] = torch.from_numpy(case.init[key]).reshape(state[key].shape)
    net.load_state_dict(state)


def standard_update(net: Sequential, case: Case, k: int) -> None:
    """pytagi's `OutputUpdater.update` with the recorded observations and noise variances."""
    OutputUpdater(net.device).update(net.output_z_buffer, case[f"y{k}"], case[f"var_y{k}"],
                                     net.input_delta_z_buffer)


StepHook = Callable[[Sequential, Case, int, Result], None]


def replay(net: Sequential, case: Case, *, update: Callable[[Sequential, Case, int], None]
           = standard_update, on_step: StepHook | None = None, flat_inputs: bool = False,
           rtol: float = RTOL) -> Result:
    """Load the case's initial parameters into `net`, run its two training steps and the eval
    forward, and compare outputs, every layer's deltas and the parameters after each step.

    `flat_inputs` passes the inputs as pytagi's loops do, one flat (B·C·H·W,) array.
    `on_step(net, case, k, result)` runs after step k's `step()` for extra comparisons.
    """
    result = Result(case.name)
    load_initial_parameters(net, case)

    def inputs(key: str) -> np.ndarray:
        x = case[key]
        return x.reshape(-1) if flat_inputs else x

    for k in (0, 1):
        net.train()
        mu, var = net(inputs(f"x{k}"))
        result.check(mu, case[f"step{k}/out_mu"], f"step{k} out_mu", rtol)
        result.check(var, case[f"step{k}/out_var"], f"step{k} out_var", rtol)
        update(net, case, k)
        net.backward()
        deltas = dict(net.named_delta_tensors())
        want = case.deltas(k)
        assert set(deltas) == set(want), (f"{case.name} step{k}: delta keys differ: only ours "
                                          f"{sorted(set(deltas) - set(want))}, only pytagi's "
                                          f"{sorted(set(want) - set(deltas))}")
        for key in sorted(want):
            result.check(deltas[key], want[key], f"step{k} {key}", rtol)
        net.step()
        params = dict(net.named_parameter_tensors())
        for key, value in sorted(case.after(k).items()):
            result.check(params[key], value, f"step{k} after {key}", rtol)
        if on_step is not None:
            on_step(net, case, k, result)
    net.eval()
    mu, var = net(inputs("x_eval"))
    result.check(mu, case["eval/out_mu"], "eval out_mu", rtol)
    result.check(var, case["eval/out_var"], "eval out_var", rtol)
    return result
