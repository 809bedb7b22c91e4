"""TorchLearner in one process (no process group): configuration, step arithmetic, precision,
metrics, checkpoints, and bad input (docs/design.md, contracts 1, 3 and 6 at world size 1)."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
from torch import nn

from dptrain.runtime import init_distributed, resolve_env
from dptrain.errors import CheckpointError, ConfigError
from dptrain.learners import AllReduceBatchNorm, Learner, TorchLearner, TorchLearnerConfig
from dptrain.learners import torch_learner
from dptrain.learners.batchnorm import convert_sync_batchnorm

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)


@pytest.fixture
def runtime():
    return init_distributed(resolve_env({}))


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))


def _classifier(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _regression(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 10, generator=g), torch.randn(n, 5, generator=g)


def _labels(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _ready(runtime, model=None, loss=None, opt=SGD, **kw) -> TorchLearner:
    learner = TorchLearner(_mlp() if model is None else model, loss or nn.MSELoss(), opt, **kw)
    learner.setup(runtime)
    return learner


def _max_diff(a, b) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("strategy", "zero3"), ("precision", "16"), ("precision", 32), ("task", "ranking"),
    ("accumulation_steps", 0), ("accumulation_steps", 1.5), ("accumulation_steps", True),
    ("max_grad_norm", 0.0), ("max_grad_norm", float("inf")), ("sync_batchnorm", "yes"),
])
def test_bad_config_names_the_field_and_value(field, value):
    """Contract 6: a bad option says which field and what it got."""
    with pytest.raises(ConfigError, match=f"{field}.*{value!r}"):
        TorchLearnerConfig(**{field: value})
    with pytest.raises(ConfigError, match=field):
        TorchLearner(_mlp(), nn.MSELoss(), SGD, **{field: value})


def test_from_config_and_protocol():
    config = TorchLearnerConfig(strategy="fsdp", accumulation_steps=2, precision="bf16")
    learner = TorchLearner.from_config(_mlp(), nn.MSELoss(), SGD, config)
    assert learner.config == config and learner.is_sharded
    assert isinstance(learner, Learner)


def test_task_from_the_loss_or_an_error_asking_for_it():
    assert TorchLearner(_mlp(), nn.CrossEntropyLoss(), SGD).task == "classification"
    assert TorchLearner(_mlp(), torch.nn.functional.mse_loss, SGD).task == "regression"
    assert TorchLearner(_mlp(), lambda o, t: o.sum(), SGD, task="regression").task == "regression"
    with pytest.raises(ConfigError, match="task='classification'"):
        TorchLearner(_mlp(), lambda o, t: o.sum(), SGD)


def test_fp16_on_cpu_is_a_clear_error(runtime):
    learner = TorchLearner(_mlp(), nn.MSELoss(), SGD, precision="fp16")
    with pytest.raises(ConfigError, match="fp16.*CUDA.*bf16"):
        learner.setup(runtime)


def test_use_before_setup_and_setup_twice(runtime):
    learner = TorchLearner(_mlp(), nn.MSELoss(), SGD)
    with pytest.raises(RuntimeError, match="setup"):
        learner.train_step(_regression(4))
    with pytest.raises(RuntimeError, match="setup"):
        learner.state_dict()
    learner.setup(runtime)
    with pytest.raises(RuntimeError, match="already"):
        learner.setup(runtime)


def test_optimizer_factory_must_return_an_optimizer(runtime):
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        _ready(runtime, opt=lambda params: list(params))


# -- bad batches --------------------------------------------------------------------------------


@pytest.mark.parametrize("batch, error, match", [
    (torch.zeros(4, 10), TypeError, "pair"),
    ((torch.zeros(4, 10),), TypeError, "length 1"),
    ((torch.zeros(4, 10), [0, 1, 2, 3]), TypeError, "tensors"),
    ((torch.zeros(4, 10), torch.zeros(3, 5)), ValueError, r"\(4, 10\) and \(3, 5\)"),
    ((torch.zeros(0, 10), torch.zeros(0, 5)), ValueError, "empty batch"),
    ((torch.zeros(4, 10), torch.zeros(4)), ValueError, "differ in shape"),
])
def test_bad_batches_fail_loudly(runtime, batch, error, match):
    """Contract 6, including a regression target that MSE would silently broadcast."""
    learner = _ready(runtime)
    with pytest.raises(error, match=match):
        learner.train_step(batch)


def test_non_finite_loss_raises_before_the_step(runtime):
    """Contract 6: NaN inputs never reach the parameters."""
    learner = _ready(runtime)
    before = learner.model_state_dict()
    x, y = _regression(4)
    x[2, 3] = float("nan")
    with pytest.raises(FloatingPointError,
                       match=r"not finite on rank\(s\) 0 \(here: nan\); no rank"):
        learner.train_step((x, y))
    assert _max_diff(learner.model_state_dict(), before) == 0.0


# -- step arithmetic -----------------------------------------------------------------------------


def _reference_steps(model, loss_fn, batches, opt, *, max_grad_norm=None, scheduler=None):
    model = copy.deepcopy(model)
    optimizer = opt(model.parameters())
    schedule = scheduler(optimizer) if scheduler else None
    norms = []
    for x, y in batches:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        if max_grad_norm:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        optimizer.step()
        if schedule:
            schedule.step()
    return model, norms


@pytest.mark.parametrize("k, n", [(3, 10), (4, 2), (1, 7)])
def test_accumulation_equals_one_step_on_the_whole_batch(runtime, k, n):
    """Contract 1: uneven micro-batches (10 -> 4/3/3) are weighted by size; k > batch uses
    one sample per micro-batch."""
    learner = _ready(runtime, accumulation_steps=k)
    batches = [_regression(n, seed) for seed in range(3)]
    for b in batches:
        learner.train_step(b)
    ref, _ = _reference_steps(_mlp(), nn.MSELoss(), batches, SGD)
    assert _max_diff(learner.model_state_dict(), ref.state_dict()) < 1e-6


def test_clipping_and_scheduler_per_optimizer_step(runtime):
    sched = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    learner = _ready(runtime, max_grad_norm=0.05, accumulation_steps=2, scheduler_factory=sched)
    batches = [_regression(6, seed) for seed in range(3)]
    norms = [learner.train_step(b)["grad_norm"][0] for b in batches]
    ref, ref_norms = _reference_steps(_mlp(), nn.MSELoss(), batches, SGD, max_grad_norm=0.05,
                                      scheduler=sched)
    assert _max_diff(learner.model_state_dict(), ref.state_dict()) < 1e-6
    assert norms == pytest.approx(ref_norms, rel=1e-5) and min(norms) > 0.05, "clipping applied"
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    assert learner.num_optimizer_steps == 3


def test_metrics_are_sums_and_counts(runtime):
    learner = _ready(runtime, model=_classifier(), loss=nn.CrossEntropyLoss(),
                     accumulation_steps=2)
    x, y = _labels(9)
    train = learner.train_step((x, y))
    assert set(train) == {"loss", "error"} and train["loss"][1] == 9.0
    assert train["error"][1] == 9.0 and 0 <= train["error"][0] <= 9
    model = copy.deepcopy(learner.module).eval()
    with torch.no_grad():
        logits = model(x)
    metrics = learner.eval_step((x, y))
    assert metrics["loss"][0] == pytest.approx(nn.functional.cross_entropy(logits, y).item() * 9,
                                               rel=1e-6)
    assert metrics["error"] == (float((logits.argmax(1) != y).sum()), 9.0)
    empty = learner.eval_step((x[:0], y[:0]))
    assert set(empty) == set(metrics), "the same metric names for an empty batch"
    assert all(value == (0.0, 0.0) for value in empty.values())
    regression = _ready(runtime).eval_step(_regression(4))
    assert set(regression) == {"loss", "mse"} and regression["mse"][1] == 20


def test_eval_step_changes_nothing(runtime):
    learner = _ready(runtime, model=_classifier(), loss=nn.CrossEntropyLoss())
    learner.train_step(_labels(8))
    before = copy.deepcopy(learner.module.state_dict())
    learner.eval_step(_labels(8, seed=1))
    after = learner.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "BatchNorm stats untouched"


def test_bf16_autocast_trains(runtime):
    learner = _ready(runtime, model=_classifier(), loss=nn.CrossEntropyLoss(), precision="bf16")
    losses = [learner.train_step(_labels(32))["loss"][0] for _ in range(10)]
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in learner.module.parameters())


def test_fp16_scaler_path(runtime, monkeypatch):
    """The GradScaler path (unscale before clipping, skip-aware scheduler, scaler state in
    checkpoints), run on CPU by allowing fp16 there for the test: no CUDA in CI."""
    monkeypatch.setattr(torch_learner, "FP16_DEVICE_TYPES", ("cuda", "cpu"))
    sched = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.9)

    def make():
        return _ready(runtime, precision="fp16", max_grad_norm=1.0, scheduler_factory=sched,
                      opt=ADAM)
    learner = make()
    for seed in range(2):
        learner.train_step(_regression(8, seed))
    state = copy.deepcopy(learner.state_dict())
    assert state["extra"]["scaler"]["scale"] > 0
    for seed in range(2, 4):
        learner.train_step(_regression(8, seed))
    other = make()
    other.load_state_dict(state)
    for seed in range(2, 4):
        other.train_step(_regression(8, seed))
    assert _max_diff(learner.model_state_dict(), other.model_state_dict()) == 0.0


# -- checkpoints --------------------------------------------------------------------------------


def _resume_pair(runtime, make, steps_before, steps_after, batch):
    first = make()
    first.setup(runtime)
    for s in range(steps_before):
        first.train_step(batch(s))
    snapshot = copy.deepcopy(first.state_dict())
    for s in range(steps_before, steps_before + steps_after):
        first.train_step(batch(s))
    second = make(seed=11)
    second.setup(runtime)
    second.load_state_dict(snapshot)
    for s in range(steps_before, steps_before + steps_after):
        second.train_step(batch(s))
    return first, second


def test_resume_from_state_dict_is_bit_identical(runtime):
    """Contract 3: Adam, scheduler, clipping, accumulation, BatchNorm buffers."""
    def make(seed=0):
        return TorchLearner(_classifier(seed), nn.CrossEntropyLoss(), ADAM, max_grad_norm=1.0,
                            accumulation_steps=2, scheduler_factory=functools.partial(
                                torch.optim.lr_scheduler.ExponentialLR, gamma=0.8))
    first, second = _resume_pair(runtime, make, 3, 3, lambda s: _labels(8, s))
    a, b = first.model_state_dict(), second.model_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert second.num_optimizer_steps == 6


def test_model_state_dict_is_a_plain_copy(runtime):
    learner = _ready(runtime)
    state = learner.model_state_dict()
    _mlp(seed=4).load_state_dict(state)
    learner.train_step(_regression(4))
    assert not torch.equal(state["0.weight"], learner.module[0].weight.detach()), "a copy"


def test_load_state_dict_accepts_ddp_prefixes(runtime):
    learner = _ready(runtime)
    state = learner.state_dict()
    state["model"] = {f"module.{k}": v.clone() + 1 for k, v in state["model"].items()}
    learner.load_state_dict(state)
    assert torch.equal(learner.module[0].bias, state["model"]["module.0.bias"])


def test_bad_checkpoints_raise_checkpoint_error(runtime, tmp_path):
    """Contract 6: wrong format, strategy, shapes, or scheduler presence."""
    learner = _ready(runtime)
    good = learner.state_dict()
    with pytest.raises(CheckpointError, match="format"):
        learner.load_state_dict({"weights": 1})
    with pytest.raises(CheckpointError, match="strategy='fsdp'"):
        learner.load_state_dict({**good, "strategy": "fsdp"})
    wide = _ready(runtime, model=nn.Sequential(nn.Linear(10, 12), nn.ReLU(), nn.Linear(12, 5)))
    with pytest.raises(CheckpointError, match="does not fit"):
        wide.load_state_dict(good)
    scheduled = _ready(runtime, scheduler_factory=functools.partial(
        torch.optim.lr_scheduler.StepLR, step_size=1))
    with pytest.raises(CheckpointError, match="lacks scheduler"):
        scheduled.load_state_dict(good)
    with pytest.raises(CheckpointError, match="no .metadata"):
        learner.load_sharded(tmp_path / "missing")


def test_sharded_checkpoint_round_trip_in_one_process(runtime, tmp_path):
    """Contract 3 through save_sharded/load_sharded, including a save before the first step:
    torch's state-dict API creates Adam state with a zero-lr step, which must neither change
    the run that saved nor be restored into the run that loads."""
    def make(seed=0):
        return TorchLearner(_mlp(seed), nn.MSELoss(), ADAM, strategy="fsdp")
    batches = [_regression(8, s) for s in range(4)]
    untouched = make()
    untouched.setup(runtime)
    for b in batches:
        untouched.train_step(b)

    saver = make()
    saver.setup(runtime)
    saver.save_sharded(tmp_path / "step0")
    assert not saver.optimizer.state
    for b in batches[:2]:
        saver.train_step(b)
    saver.save_sharded(tmp_path / "step2")
    for b in batches[2:]:
        saver.train_step(b)
    for name, done in (("step0", 0), ("step2", 2)):
        loader = make(seed=3)
        loader.setup(runtime)
        loader.load_sharded(tmp_path / name)
        for b in batches[done:]:
            loader.train_step(b)
        assert _max_diff(loader.model_state_dict(), untouched.model_state_dict()) == 0.0, name
    assert _max_diff(saver.model_state_dict(), untouched.model_state_dict()) == 0.0


# -- global-batch BatchNorm -----------------------------------------------------------------------


def test_all_reduce_batchnorm_alone_is_batchnorm():
    """At world size 1 (and in eval) it is BatchNorm, with the same state-dict names."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Flatten(),
                          nn.BatchNorm1d(3 * 36))
    reference = copy.deepcopy(model)
    converted = convert_sync_batchnorm(model, torch.device("cpu"))
    assert isinstance(converted[1], AllReduceBatchNorm)
    assert isinstance(converted[3], AllReduceBatchNorm)
    assert converted.state_dict().keys() == reference.state_dict().keys()
    x = torch.randn(5, 1, 8, 8)
    assert torch.allclose(converted(x), reference(x))
    assert _max_diff(converted.state_dict(), reference.state_dict()) == 0.0
    with pytest.raises(ValueError, match="at least|expects input"):
        AllReduceBatchNorm(3)(torch.zeros(3))


# -- compile ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_compile_trains_like_eager(runtime):
    """`compile=True` (`--compile` for torch models): the training forward and backward through
    torch.compile (inductor) give the eager learner's parameters, BatchNorm statistics and
    metrics, to float32 rounding of fused code; the state keeps the module's own keys."""
    learners = [_ready(runtime, _classifier(), nn.CrossEntropyLoss(), compile=compile)
                for compile in (False, True)]
    for step in range(3):
        want, got = (learner.train_step(_labels(16, seed=step)) for learner in learners)
        assert want.keys() == got.keys()
        for key in want:
            assert got[key][0] == pytest.approx(want[key][0], rel=1e-5, abs=1e-6), key
    eager, compiled = (learner.model_state_dict() for learner in learners)
    assert eager.keys() == compiled.keys()
    assert _max_diff(eager, compiled) < 1e-5
    assert learners[1]._compile_checked and learners[1]._train_forward is not learners[1]._wrapped


def test_compile_refused_trains_eagerly_after_one_line(runtime, tmp_path, monkeypatch, caplog):
    """A compiler that fails (here inductor's C++ compiler, a real build failure in a fresh
    cache) switches the training forward to eager at the first step, with one warning line,
    and the learner trains as the eager one does."""
    import torch._inductor.config as inductor_config
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    learners = [_ready(runtime, _classifier(), nn.CrossEntropyLoss(), compile=compile)
                for compile in (False, True)]
    with inductor_config.patch({"cpp.cxx": (None, "false")}), \
            caplog.at_level(logging.WARNING, logger="dptrain.learners.torch_learner"):
        for step in range(2):
            want, got = (learner.train_step(_labels(16, seed=step)) for learner in learners)
            for key in want:
                assert got[key][0] == pytest.approx(want[key][0], rel=1e-6), key
    # dptrain's own lines: inductor itself may log the codegen error too, or not, depending on
    # what an earlier compile in this process left in its caches (seen when this file runs
    # alone: torch._inductor.scheduler's "Error in codegen ...").
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("dptrain")]
    assert len(lines) == 1 and "training eagerly" in lines[0] and "\n" not in lines[0]
    assert learners[1]._train_forward is learners[1]._wrapped
    assert _max_diff(learners[0].model_state_dict(), learners[1].model_state_dict()) == 0.0
    torch._dynamo.reset()
