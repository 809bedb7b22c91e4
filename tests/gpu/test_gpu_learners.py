"""Both learners train on the device, through the process group the runtime picks there: NCCL
over two ranks on a machine with at least two GPUs, world size 1 on one GPU, gloo over two
ranks on the CPU. Then fp16 autocast with its GradScaler (CUDA only) and pinned host memory
copied without blocking (CUDA only).

TagiLearner's step on the device must equal a float64 single-process CPU step on the whole
batch to 1e-5 (sum mode: N ranks step like one process on the global batch; docs/tagi.md,
Data-parallel TAGI). TorchLearner's Adam step divides by the gradient's own size, so a
float32 rounding can flip a near-zero gradient's update; its loss (computed before the step)
is compared instead, and the step must have moved every parameter tensor on the device.
"""

from __future__ import annotations

import math

import pytest
import torch

from dptrain.data import load_dataset
from dptrain.runtime import init_distributed
from dptrain.learners.build import create_learner
from dptrain.learners.config import LearnerConfig, ModelConfig
from tests._world import run_world
from tests.gpu.conftest import HAS_CUDA, NO_CUDA
from tests.unit.pytagi.parity import relative_error

pytestmark = pytest.mark.gpu

BATCH = 16
MODELS = ("tagi-cnn", "torch-cnn")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    split = load_dataset("digits-image")
    return split.train.x[:BATCH], split.train.y[:BATCH]


def _learner(model: str, precision: str = "32"):
    split = load_dataset("digits-image")
    return create_learner(ModelConfig(model=model, precision=precision), LearnerConfig(),
                          split, seed=0)


def _cpu64(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", torch.float64) for k, v in state.items()}


def _steps(rank: int, world_size: int, backend: str) -> dict:
    """On one rank: each learner takes one step on this rank's share of the batch (every
    world_size-th sample, as the ShardedSampler deals them). Returns what the parent compares.

    TF32 off here too: a spawned rank starts with torch's defaults, not the fixture's."""
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    runtime = init_distributed(backend=backend)
    x, y = _batch()
    out = {"device": str(runtime.device), "backend": runtime.backend}
    for model in MODELS:
        learner = _learner(model)
        learner.setup(runtime)
        before = _cpu64(learner.model_state_dict())
        shard_x = x[rank::world_size].to(runtime.device, non_blocking=True)
        shard_y = y[rank::world_size].to(runtime.device, non_blocking=True)
        metrics = learner.train_step((shard_x, shard_y))
        state = learner.model_state_dict()
        out[model] = {"metrics": metrics, "before": before, "after": _cpu64(state),
                      "devices": sorted({t.device.type for t in state.values()})}
    return out


def _reference(model: str) -> dict:
    """The same step in one CPU process on the whole batch (TAGI in float64)."""
    learner = _learner(model, "64" if model == "tagi-cnn" else "32")
    learner.setup(init_distributed(backend="gloo"))  # world size 1: no group
    metrics = learner.train_step(_batch())
    return {"metrics": metrics, "after": _cpu64(learner.model_state_dict())}


def _world(device: torch.device) -> list[dict]:
    if device.type == "cpu":
        return run_world(_steps, "gloo", world_size=2, init="env", timeout_s=180)
    if torch.cuda.device_count() >= 2:
        return run_world(_steps, "auto", world_size=2, init="env", timeout_s=300)
    return [_steps(0, 1, "auto")]


@pytest.mark.dist
def test_both_learners_train_a_step_on_the_device(device):
    ranks = _world(device)
    expected_backend = "gloo" if device.type == "cpu" else ("nccl" if len(ranks) == 2 else None)
    assert [r["backend"] for r in ranks] == [expected_backend] * len(ranks)
    assert {r["device"].split(":")[0] for r in ranks} == {device.type}
    for model in MODELS:
        ref = _reference(model)
        mine = [r[model] for r in ranks]
        assert all(m["devices"] == [device.type] for m in mine), model
        for r in mine[1:]:  # the replicas agree bit for bit
            assert all(torch.equal(r["after"][k], mine[0]["after"][k]) for k in r["after"])
        after, before = mine[0]["after"], mine[0]["before"]
        loss = sum(m["metrics"]["loss" if model == "torch-cnn" else "log_likelihood"][0]
                   for m in mine)
        want = ref["metrics"]["loss" if model == "torch-cnn" else "log_likelihood"][0]
        assert math.isclose(loss, want, rel_tol=1e-5), (model, loss, want)
        if model == "tagi-cnn":
            errors = {k: relative_error(after[k], ref["after"][k].numpy())[0] for k in after}
            worst = max(errors, key=errors.get)
            assert errors[worst] <= 1e-5, f"{worst}: relative error {errors[worst]:.3g}"
        moved = [k for k in after if after[k].is_floating_point() and
                 not torch.equal(after[k], before[k])]
        weights = [k for k in after if k.endswith(("weight", "mu_w"))]
        assert set(weights) <= set(moved), (model, sorted(set(weights) - set(moved)))


@pytest.mark.skipif(not HAS_CUDA, reason=f"{NO_CUDA}; fp16 autocast with a GradScaler is "
                    "CUDA only (on the CPU TorchLearner refuses precision fp16, use bf16)")
def test_fp16_autocast_with_its_grad_scaler_trains_on_cuda():
    """Half-precision forward, float32 master weights, a scaled backward that the scaler
    unscales before Adam: the loss is the float32 model's to fp16 accuracy, the weights stay
    float32 and finite, and the scaler's scale stays a finite power of two."""
    runtime = init_distributed()
    x, y = (t.to(runtime.device) for t in _batch())
    fp32, fp16 = _learner("torch-cnn"), _learner("torch-cnn", "fp16")
    fp32.setup(runtime)
    fp16.setup(runtime)
    assert fp16.scaler is not None and fp32.scaler is None
    first = [learner.train_step((x, y))["loss"][0] for learner in (fp32, fp16)]
    assert math.isclose(first[1], first[0], rel_tol=1e-2), first
    # The scaler skips a step whose scaled gradients overflow (and halves its scale), so the
    # loss on this batch must come down within a few steps, not after each one.
    losses = [fp16.train_step((x, y))["loss"][0] for _ in range(8)]
    assert all(math.isfinite(v) for v in losses) and min(losses) < first[1], losses
    state = fp16.model_state_dict()
    weights = [v for k, v in state.items() if k.endswith("weight")]
    assert all(w.dtype == torch.float32 and bool(torch.isfinite(w).all()) for w in weights)
    scale = fp16.scaler.get_scale()
    assert math.isfinite(scale) and scale > 0 and math.log2(scale).is_integer(), scale


@pytest.mark.skipif(not HAS_CUDA, reason=f"{NO_CUDA}; page-locked host memory only matters "
                    "for copies to a GPU")
def test_pinned_host_memory_copied_without_blocking_gives_the_same_steps():
    """A batch in pinned memory copied with non_blocking=True (the copy runs on the stream,
    ahead of the step's kernels) trains each learner exactly as a pageable, blocking copy."""
    runtime = init_distributed()
    x, y = _batch()
    pinned_x, pinned_y = x.pin_memory(), y.pin_memory()
    assert pinned_x.is_pinned() and pinned_y.is_pinned()
    deterministic = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True  # bitwise: no atomics in cuDNN's backward
    try:
        _compare_pinned_and_pageable(runtime, (x, y), (pinned_x, pinned_y))
    finally:
        torch.backends.cudnn.deterministic = deterministic


def _compare_pinned_and_pageable(runtime, pageable, pinned) -> None:
    for model in MODELS:
        states = []
        for non_blocking, (bx, by) in ((False, pageable), (True, pinned)):
            learner = _learner(model)
            learner.setup(runtime)
            batch = (bx.to(runtime.device, non_blocking=non_blocking),
                     by.to(runtime.device, non_blocking=non_blocking))
            learner.train_step(batch)
            states.append(_cpu64(learner.model_state_dict()))
        assert all(torch.equal(states[0][k], states[1][k]) for k in states[0]), model
