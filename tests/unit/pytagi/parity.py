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
checks our intended value itself. `result.largest_error()` is the worst relative error seen
(the measure `compare` bounds), and `cap_report(case)` says how hard the recorded steps pushed
the step cap and the variance floor, so a test can insist that a case still exercises them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from dptrain.tagi import Layer, OutputUpdater, Sequential, cap_factor
from dptrain.tagi.base import VAR_FLOOR

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "pytagi_fixtures.npz"
#: The LSTM cases (make_pytagi_fixtures.py --family lstm): `load_case(name, LSTM_FIXTURES)`.
LSTM_FIXTURES = FIXTURES.with_name("pytagi_fixtures_lstm.npz")
#: The Embedding and SLSTM cases (make_pytagi_fixtures.py --family seq).
SEQ_FIXTURES = FIXTURES.with_name("pytagi_fixtures_seq.npz")
PARAM_NAMES = ("mu_w", "var_w", "mu_b", "var_b")
#: pytagi computes in float32, so its own rounding bounds the agreement: our float64 and float32
#: replays both stay within 1e-5 of it on every case (worst seen about 7e-6) except the one
#: named in test_tagi_parity_branches.py, where a float32 sum with cancellation in the wheel
#: loses more. A float64 replay cannot be held tighter than the wheel's float32 arithmetic.
RTOL = 1e-5


@lru_cache(maxsize=4)
def _all_arrays(fixtures: Path = FIXTURES) -> dict[str, np.ndarray]:
    with np.load(fixtures) as data:
        return {key: data[key] for key in data.files}


def case_names(fixtures: Path = FIXTURES) -> list[str]:
    return sorted({key.split("/", 1)[0] for key in _all_arrays(fixtures)})


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


def load_case(name: str, fixtures: Path = FIXTURES) -> Case:
    """The arrays stored under the key prefix `<name>/` of the file `fixtures`."""
    prefix = name + "/"
    arrays = {key[len(prefix):]: value for key, value in _all_arrays(fixtures).items()
              if key.startswith(prefix)}
    if not arrays:
        raise KeyError(f"no case {name!r} in {fixtures.name}; cases: {case_names(fixtures)}")
    return Case(name, arrays)


def relative_error(got: torch.Tensor, want: np.ndarray) -> tuple[float, int]:
    """(the largest |got − want| / (|want| + max|want|/10), its flat index); inf for a shape
    mismatch.

    The absolute part (a tenth of the array's scale) keeps float32 cancellation in pytagi's
    near-zero entries from failing a test; a formula error is far larger than either part.
    """
    got_flat = got.detach().to("cpu", torch.float64).reshape(-1)
    want_flat = torch.from_numpy(np.asarray(want, dtype=np.float64)).reshape(-1)
    if got_flat.numel() != want_flat.numel():
        return math.inf, -1
    if not want_flat.numel():
        return 0.0, -1
    scale = want_flat.abs().max().item()
    ratio = (got_flat - want_flat).abs() / (want_flat.abs() + 0.1 * scale + 1e-30)
    worst = int(torch.argmax(ratio))
    return ratio[worst].item(), worst


def compare(got: torch.Tensor, want: np.ndarray, what: str, rtol: float = RTOL) -> str | None:
    """None if `got` matches pytagi's `want` elementwise within rtol·(|want| + max|want|/10)
    (see `relative_error`), else a one-line description of the worst element."""
    error, worst = relative_error(got, want)
    if error <= rtol:
        return None
    got_flat = got.detach().to("cpu", torch.float64).reshape(-1)
    want_flat = np.asarray(want, dtype=np.float64).reshape(-1)
    if worst < 0:
        return f"{what}: {got_flat.numel()} values, pytagi has {want_flat.size}"
    return (f"{what}: index {worst}: ours {got_flat[worst].item():.9g}, pytagi "
            f"{want_flat[worst]:.9g} (relative error {error:.3g}, bound {rtol:.3g})")


@dataclass
class Result:
    """What `replay` compared: `checked` names every comparison, `failures` the failed ones,
    `errors` the relative error of each; `looser` holds the comparisons allowed a larger bound
    than the one passed to `check`."""

    case: str
    checked: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    looser: dict[str, float] = field(default_factory=dict)

    def record(self, what: str, problem: str | None) -> None:
        self.checked.append(what)
        if problem is not None:
            self.failures[what] = problem

    def check(self, got: torch.Tensor, want: np.ndarray, what: str, rtol: float = RTOL) -> None:
        self.errors[what] = relative_error(got, want)[0]
        self.record(what, compare(got, want, what, max(rtol, self.looser.get(what, rtol))))

    def largest_error(self, exclude: Collection[str] = ()) -> tuple[float, str]:
        """(the largest relative error of any comparison but `exclude`, that comparison)."""
        return max((error, what) for what, error in self.errors.items() if what not in exclude)

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

#: pytagi's BatchNorm statistics (tests/data/make_pytagi_fixtures.py) -> our attributes.
NORM_STATS = {"running_mean": "mu_ra", "running_var": "var_ra",
              "batch_mean": "mu_norm_batch", "batch_var": "var_norm_batch"}


def layer_at(net: Sequential, path: str) -> Layer:
    """The layer at a state_dict path such as "3.main.1"."""
    layer: Layer = net
    for part in path.split("."):
        layer = dict(layer.named_children())[part]
    return layer


def norm_statistics_hook(norm_paths: Mapping[str, list[str]], rtol: float = RTOL) -> StepHook:
    """An `on_step` hook comparing BatchNorm statistics: `norm_paths` maps pytagi's display name
    of each top-level layer holding BatchNorms to our BatchNorm paths, in the order pytagi
    concatenates them (main block first, then the shortcut)."""
    def check(net: Sequential, case: Case, k: int, result: Result) -> None:
        want = case.norm(k)
        assert {key.rsplit(".", 1)[0] for key in want} == set(norm_paths), case.name
        for pytagi_name, paths in norm_paths.items():
            for stat, attr in NORM_STATS.items():
                got = torch.cat([getattr(layer_at(net, p), attr).reshape(-1) for p in paths])
                result.check(got, want[f"{pytagi_name}.{stat}"],
                             f"step{k} {pytagi_name}.{stat}", rtol)
    return check


def replay(net: Sequential, case: Case, *, update: Callable[[Sequential, Case, int], None]
           = standard_update, on_step: StepHook | None = None, flat_inputs: bool = False,
           rtol: float = RTOL, looser: Mapping[str, float] | None = None) -> Result:
    """Load the case's initial parameters into `net`, run its two training steps and the eval
    forward, and compare outputs, every layer's deltas and the parameters after each step.

    `flat_inputs` passes the inputs as pytagi's loops do, one flat (B·C·H·W,) array.
    `on_step(net, case, k, result)` runs after step k's `step()` for extra comparisons.
    `looser` maps comparison names (as in `Result.checked`) to a bound above `rtol`, for the
    few entries where the wheel's own float32 rounding is larger; every name must be compared.
    """
    result = Result(case.name, looser=dict(looser or {}))
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
    unused = sorted(set(result.looser) - set(result.checked))
    assert not unused, f"{case.name}: looser bounds for comparisons never made: {unused}"
    return result


@dataclass(frozen=True)
class CapReport:
    """How the recorded `step()` calls of a case met the cap (docs/tagi.md, Capped step):
    the cap factor c(B) of its batch, the largest |Δm| / bar and |Δv| / bar over both steps
    (> 1: the cap bound that change), and how many variances the floor reset, i.e. where
    v_old − min(|Δv|, bar) ≤ 0 with Δv < 0. `ties` counts those exactly at 0 (v_old = bar, e.g.
    v_old = 1/4 with c = 2: exact in any precision, and floored because the rule is ≤ 0);
    `margin` is the smallest distance of any other decreasing variance from 0, relative to
    v_old, so a case can insist that rounding cannot move a variance across the threshold."""

    factor: float
    mean_ratio: float
    var_ratio: float
    floors: int
    ties: int
    margin: float


def cap_report(case: Case) -> CapReport:
    """The cap statistics of a case, from its recorded parameters and deltas only (pytagi's
    side): step 0 starts from `init`, step 1 from `step0/after`. Also checks that every
    floored variance is stored as the floor value."""
    factor = cap_factor(case["x0"].shape[0])
    mean_ratio = var_ratio = 0.0
    floors, ties, margin = 0, 0, math.inf
    for k in (0, 1):
        before = case.init if k == 0 else case.after(0)
        deltas, after = case.deltas(k), case.after(k)
        for key, value in before.items():
            path, name = key.rsplit(".", 1)
            if not name.startswith("var_"):
                continue
            group = name[len("var_"):]
            bar = np.sqrt(value) / factor
            d_mu, d_var = deltas[f"{path}.delta_mu_{group}"], deltas[f"{path}.delta_var_{group}"]
            mean_ratio = max(mean_ratio, float(np.max(np.abs(d_mu) / bar)))
            var_ratio = max(var_ratio, float(np.max(np.abs(d_var) / bar)))
            left = value - np.minimum(np.abs(d_var), bar)  # what a decrease leaves
            shrinking = d_var < 0
            floored = shrinking & (left <= 0)
            assert np.all(np.isclose(after[key][floored], VAR_FLOOR, rtol=1e-6)), key
            floors += int(np.sum(floored))
            ties += int(np.sum(shrinking & (left == 0)))
            off = shrinking & (left != 0)
            if off.any():
                margin = min(margin, float(np.min(np.abs(left[off]) / value[off])))
    return CapReport(factor, mean_ratio, var_ratio, floors, ties, margin)
