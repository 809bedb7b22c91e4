"""TorchLearner on 2 real gloo ranks: docs/design.md, 1 (equivalence), 2 (identical replicas),
3 (exact resume), for DDP and FSDP2, plus a sharded checkpoint loaded on a different world size.

Each world runs many checks (a world costs ~4 s to start); ranks return what they measured and
the parent asserts, naming the rank.
"""

from __future__ import annotations

import copy
import functools
import warnings
import weakref
from datetime import timedelta

import pytest
import torch
from torch import nn

from dptrain.runtime import (DistEnv, Runtime, barrier, init_distributed, resolve_env,
                          shutdown_distributed)
from dptrain.learners import AllReduceBatchNorm, TorchLearner
from dptrain.learners.optim import OptimizerSpec
from dptrain.learners.schedule import LrSchedule
from tests._world import run_world

pytestmark = pytest.mark.dist
TOL = 1e-6


def _runtime(rank: int, world_size: int) -> Runtime:
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                  node_rank=0, master_addr="127.0.0.1", master_port=0, launcher="env")
    return Runtime(env, "gloo", torch.device("cpu"), timedelta(seconds=30))


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))


def _cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 64, 10))


def _regression_data(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 10, generator=g), torch.randn(n, 5, generator=g)


def _image_data(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(n, 1, 8, 8, generator=g) * 2 + 1, torch.randint(0, 10, (n,), generator=g)


def _shard(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple:
    b = batch[0].shape[0] // world_size
    return tuple(t[rank * b:(rank + 1) * b] for t in batch)


SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _reference(model: nn.Module, loss_fn, batches, *, opt=SGD, max_grad_norm=None,
               scheduler=None) -> nn.Module:
    """One process, the whole global batch, mean loss: what N ranks must reproduce."""
    model = copy.deepcopy(model)
    optimizer = opt(model.parameters())
    schedule = scheduler(optimizer) if scheduler else None
    for x, y in batches:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        if schedule:
            schedule.step()
    return model


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _train(learner: TorchLearner, data, steps, rank, world_size) -> list[dict]:
    return [learner.train_step(_shard(data(s, 16), rank, world_size)) for s in steps]


# ---------------------------------------------------------------------------------------------
# DDP


def _ddp_checks(rank: int, world_size: int) -> dict:
    out: dict = {}
    rt = _runtime(rank, world_size)
    mse, ce = nn.MSELoss(), nn.CrossEntropyLoss()

    # Equivalence: 2 ranks x batch 8 == 1 process x batch 16, two steps with momentum.
    learner = TorchLearner(_mlp(), mse, SGD)
    learner.setup(rt)
    _train(learner, _regression_data, range(2), rank, world_size)
    ref = _reference(_mlp(), mse, [_regression_data(s, 16) for s in range(2)])
    out["ddp_vs_global"] = _max_diff(learner.model_state_dict(), ref.state_dict())

    # Accumulation over k=3 (local batch 10 splits 4/3/3) == one step on the global batch of 20;
    # a comm hook counts DDP's gradient all-reduces: one bucket, so one per optimizer step.
    learner = TorchLearner(_mlp(), mse, SGD, accumulation_steps=3)
    learner.setup(rt)
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        return allreduce_hook(None, bucket)

    learner.wrapped.register_comm_hook(None, counting_hook)
    counts = []
    for s in range(2):
        learner.train_step(_shard(_regression_data(s, 20), rank, world_size))
        counts.append(len(calls))
    out["allreduce_counts"] = counts
    ref = _reference(_mlp(), mse, [_regression_data(s, 20) for s in range(2)])
    out["accumulation_vs_global"] = _max_diff(learner.model_state_dict(), ref.state_dict())

    # SyncBatchNorm: running statistics and parameters equal those of the global batch.
    learner = TorchLearner(_cnn(), ce, SGD, sync_batchnorm=True)
    learner.setup(rt)
    out["converted"] = isinstance(learner.module[1], AllReduceBatchNorm)
    _train(learner, _image_data, range(2), rank, world_size)
    ref = _reference(_cnn(), ce, [_image_data(s, 16) for s in range(2)])
    out["syncbn_vs_global"] = _max_diff(learner.model_state_dict(), ref.state_dict())
    out["syncbn_state"] = learner.model_state_dict()

    # Replicas bit-identical after several steps on different data: plain BatchNorm (buffers
    # differ per rank until broadcast), Adam, clipping, a scheduler and bf16 autocast.
    learner = TorchLearner(_cnn(), ce, functools.partial(torch.optim.Adam, lr=1e-2),
                           scheduler_factory=functools.partial(torch.optim.lr_scheduler.StepLR,
                                                               step_size=2),
                           max_grad_norm=0.5, precision="bf16", accumulation_steps=2)
    learner.setup(rt)
    metrics = _train(learner, _image_data, range(4), rank, world_size)
    out["replica_state"] = learner.model_state_dict()
    out["replica_metrics"] = metrics[-1]

    # Eval is local for DDP: rank 0 evaluates more batches than rank 1 without hanging.
    x, y = _image_data(99, 16)
    out["eval"] = [learner.eval_step((x, y)) for _ in range(3 if rank == 0 else 1)][-1]
    barrier()
    reference_model = copy.deepcopy(learner.module).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = reference_model(x)
    out["eval_errors_expected"] = float((logits.argmax(1) != y).sum())

    # Exact resume: continue vs restore a snapshot into a fresh learner (other init) and redo.
    def make() -> TorchLearner:
        return TorchLearner(_mlp(seed=7 if made else 0), mse,
                            functools.partial(torch.optim.Adam, lr=1e-2),
                            scheduler_factory=functools.partial(
                                torch.optim.lr_scheduler.ExponentialLR, gamma=0.9),
                            max_grad_norm=1.0, accumulation_steps=2)
    made: list = []
    first = make()
    made.append(first)
    first.setup(rt)
    _train(first, _regression_data, range(3), rank, world_size)
    snapshot = copy.deepcopy(first.state_dict())
    _train(first, _regression_data, range(3, 6), rank, world_size)
    second = make()
    second.setup(rt)
    second.load_state_dict(snapshot)
    _train(second, _regression_data, range(3, 6), rank, world_size)
    a, b = first.model_state_dict(), second.model_state_dict()
    out["resume_bit_identical"] = all(torch.equal(a[k], b[k]) for k in a)
    out["resume_lr"] = (first.optimizer.param_groups[0]["lr"],
                        second.optimizer.param_groups[0]["lr"])
    out["plain_state"] = a

    # A NaN input on rank 1 only: its gradient reaches both ranks through the all-reduce, so
    # both must stop at the same step with the parameters as they were, and can go on after.
    learner = TorchLearner(_mlp(), mse, SGD)
    learner.setup(rt)
    _train(learner, _regression_data, range(1), rank, world_size)
    before = copy.deepcopy(learner.model_state_dict())
    x, y = _shard(_regression_data(1, 16), rank, world_size)
    if rank == 1:
        x = x.clone()
        x[0, 0] = float("nan")
    try:
        learner.train_step((x, y))
    except FloatingPointError as err:
        out["nan_error"] = (type(err).__name__, str(err))
    out["nan_unchanged"] = _max_diff(learner.model_state_dict(), before)
    _train(learner, _regression_data, range(2, 3), rank, world_size)
    out["nan_then_state"] = learner.model_state_dict()
    return out


# ---------------------------------------------------------------------------------------------
# FSDP2


ADAM = functools.partial(torch.optim.Adam, lr=1e-2)
HALVING = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)


def _fsdp_learner(seed: int = 0) -> TorchLearner:
    return TorchLearner(_mlp(seed), nn.MSELoss(), ADAM, strategy="fsdp", accumulation_steps=2,
                        max_grad_norm=1.0, scheduler_factory=HALVING)


def _fsdp_checks(rank: int, world_size: int, ckpt_dir: str) -> dict:
    out: dict = {}
    rt = _runtime(rank, world_size)
    mse, ce = nn.MSELoss(), nn.CrossEntropyLoss()

    # Equivalence with accumulation and clipping: FSDP on 2 ranks == 1 process, global batch.
    learner = _fsdp_learner()
    learner.setup(rt)
    out["sharded"] = type(learner.module[0].weight).__name__
    _train(learner, _regression_data, range(2), rank, world_size)
    ref = _reference(_mlp(), mse, [_regression_data(s, 16) for s in range(2)], opt=ADAM,
                     max_grad_norm=1.0, scheduler=HALVING)
    out["fsdp_vs_global"] = _max_diff(learner.model_state_dict(), ref.state_dict())

    # Sharded checkpoint at step 2, then continue; a fresh learner (other init) restores it and
    # redoes the same steps: bit-identical.
    learner.save_sharded(ckpt_dir)
    out["saved_state"] = learner.model_state_dict()
    _train(learner, _regression_data, [2], rank, world_size)
    out["after_step3"] = learner.model_state_dict()
    _train(learner, _regression_data, [3], rank, world_size)
    restored = _fsdp_learner(seed=5)
    restored.setup(rt)
    restored.load_sharded(ckpt_dir)
    _train(restored, _regression_data, [2, 3], rank, world_size)
    a, b = learner.model_state_dict(), restored.model_state_dict()
    out["resume_bit_identical"] = all(torch.equal(a[k], b[k]) for k in a)

    # Full (unsharded) state_dict round trip on FSDP.
    snapshot = copy.deepcopy(learner.state_dict())
    before = learner.model_state_dict()
    _train(learner, _regression_data, [4], rank, world_size)
    learner.load_state_dict(snapshot)
    out["full_state_roundtrip"] = _max_diff(learner.model_state_dict(), before)

    # FSDP with global-batch BatchNorm == 1 process on the global batch.
    bn = TorchLearner(_cnn(), ce, SGD, strategy="fsdp", sync_batchnorm=True)
    bn.setup(rt)
    _train(bn, _image_data, range(2), rank, world_size)
    ref = _reference(_cnn(), ce, [_image_data(s, 16) for s in range(2)])
    out["fsdp_syncbn_vs_global"] = _max_diff(bn.model_state_dict(), ref.state_dict())

    # Eval is collective under FSDP: a rank with nothing left passes an empty batch.
    x, y = _image_data(50, 10)
    part = (x[:7], y[:7]) if rank == 0 else (x[:0], y[:0])
    rest = (x[7:], y[7:]) if rank == 0 else (x[:0], y[:0])
    out["eval"] = [bn.eval_step(part), bn.eval_step(rest)]
    ref.eval()
    with torch.no_grad():
        logits = ref(x)
    out["eval_expected"] = (ce(logits, y).item() * 10, float((logits.argmax(1) != y).sum()))
    out.update(_fsdp_ema_checks(rt, rank, world_size, ckpt_dir + "-ema"))
    return out


def _ema_learner(seed: int = 0, strategy: str = "fsdp") -> TorchLearner:
    """SGD with decay groups, warmup, EMA every step, global BatchNorm."""
    return TorchLearner(_cnn(seed), nn.CrossEntropyLoss(),
                        OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, weight_decay=1e-2),
                        strategy=strategy, sync_batchnorm=True, ema_decay=0.5,
                        lr_schedule=LrSchedule(peak=0.1, total_steps=6, warmup_steps=2,
                                               kind="cosine"))


def _fsdp_ema_checks(rt: Runtime, rank: int, world_size: int, ckpt_dir: str) -> dict:
    """The EMA under FSDP: its shards average, evaluate (collectively), save and reshard."""
    out: dict = {}
    learner = _ema_learner()
    learner.setup(rt)
    out["ema_groups"] = [g["weight_decay"] for g in learner.optimizer.param_groups]
    _train(learner, _image_data, range(2), rank, world_size)
    out["ema_after2"] = learner.ema_state_dict()
    x, y = _image_data(60, 8)
    out["ema_eval"] = learner.eval_step(_shard((x, y), rank, world_size))
    learner.save_sharded(ckpt_dir)
    _train(learner, _image_data, [2], rank, world_size)
    restored = _ema_learner(seed=5)
    restored.setup(rt)
    restored.load_sharded(ckpt_dir)
    _train(restored, _image_data, [2], rank, world_size)
    a, b = learner.ema_state_dict(), restored.ema_state_dict()
    out["ema_resume_bit_identical"] = all(torch.equal(a[k], b[k]) for k in a)
    out["ema_lr"] = restored.step_scalars()["lr"]
    return out


def _shutdown_checks(rank: int, world_size: int) -> dict:
    """Last, since it ends the group: the DDP wrapper (and its reducer) goes before the group."""
    learner = TorchLearner(_mlp(), nn.MSELoss(), SGD)
    learner.setup(_runtime(rank, world_size))
    learner.train_step(_shard(_regression_data(0, 8), rank, world_size))
    wrapper = weakref.ref(learner.wrapped)
    shutdown_distributed()
    try:
        learner.model_state_dict()
        error = ""
    except RuntimeError as err:
        error = str(err)
    return {"wrapper_alive": wrapper() is not None, "error_after_shutdown": error}


def _all_checks(rank: int, world_size: int, ckpt_dir: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as strict as pytest's filterwarnings, in the ranks too
        return {"ddp": _ddp_checks(rank, world_size),
                "fsdp": _fsdp_checks(rank, world_size, ckpt_dir),
                "shutdown": _shutdown_checks(rank, world_size)}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[str, list[dict], list[dict], list[dict]]:
    """One 2-rank world for every check below: the first DDP/gloo use costs ~5 s per world."""
    ckpt = str(tmp_path_factory.mktemp("torch_learner") / "sharded")
    results = run_world(_all_checks, ckpt, world_size=2, timeout_s=120)
    return (ckpt, [r["ddp"] for r in results], [r["fsdp"] for r in results],
            [r["shutdown"] for r in results])


def _same_on_both_ranks(results: list[dict], key: str) -> None:
    a, b = results[0][key], results[1][key]
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{key}: replicas differ in {differ}"


def test_ddp_step_equals_one_process_on_the_global_batch(world):
    """Contract 1: 2 ranks x batch 8 == 1 process x batch 16 with mean loss (SGD momentum)."""
    for rank, r in enumerate(world[1]):
        assert r["ddp_vs_global"] < TOL, f"rank {rank}"


def test_accumulation_equals_larger_batch_with_one_allreduce_per_step(world):
    """Contract 1: k=3 micro-batches (4/3/3) == one step on the 2x10 batch, and no_sync leaves
    exactly one gradient all-reduce per optimizer step (counted by a DDP comm hook)."""
    for rank, r in enumerate(world[1]):
        assert r["accumulation_vs_global"] < TOL, f"rank {rank}"
        assert r["allreduce_counts"] == [1, 2], f"rank {rank}: all-reduces after steps 1, 2"


def test_sync_batchnorm_uses_global_batch_statistics(world):
    """Contract 1: with sync_batchnorm the running stats and parameters equal those of one
    process on the global batch (torch's SyncBatchNorm cannot run on CPU: ours is used)."""
    for rank, r in enumerate(world[1]):
        assert r["converted"], f"rank {rank}: BatchNorm2d not converted"
        assert r["syncbn_vs_global"] < 1e-5, f"rank {rank}"
    cnn = _cnn()
    cnn.load_state_dict(world[1][0]["syncbn_state"])  # same names as plain BatchNorm2d


def test_replicas_bit_identical_after_several_steps(world):
    """Contract 2: plain BatchNorm on different data, Adam, clipping, bf16, a scheduler."""
    for key in ("syncbn_state", "replica_state", "plain_state"):
        _same_on_both_ranks(world[1], key)
    assert all(r["replica_metrics"]["grad_norm"][1] == 1.0 for r in world[1])


def test_a_nan_loss_on_one_rank_stops_every_rank_with_identical_parameters(world):
    for rank, r in enumerate(world[1]):
        kind, text = r.get("nan_error", (None, "no error raised"))
        assert kind == "NonFiniteLoss", f"rank {rank}: {text}"
        assert "train step 1: the loss is not finite on rank(s) 1" in text, text
        assert ("(here: nan)" in text) == (rank == 1), text
        assert r["nan_unchanged"] == 0.0, f"rank {rank} stepped with a NaN gradient"
    _same_on_both_ranks(world[1], "nan_then_state")


def test_ddp_resume_from_state_dict_is_bit_identical(world):
    """Contract 3: continue vs restore-a-snapshot-into-a-fresh-learner-and-continue."""
    for rank, r in enumerate(world[1]):
        assert r["resume_bit_identical"], f"rank {rank}: restored run diverged"
        assert r["resume_lr"][0] == r["resume_lr"][1], f"rank {rank}: scheduler not restored"


def test_model_state_dict_loads_into_a_plain_module(world):
    state = world[1][0]["plain_state"]
    assert not any(k.startswith("module.") for k in state)
    _mlp(seed=3).load_state_dict(state)


def test_the_ddp_wrapper_is_dropped_before_the_group_is_destroyed(world):
    """Its reducer holds the group from C++; left to interpreter teardown, torch 2.13 aborts
    finished jobs now and then. A learner used after the shutdown says so."""
    for rank, r in enumerate(world[3]):
        assert not r["wrapper_alive"], f"rank {rank}"
        assert "process group was shut down" in r["error_after_shutdown"], f"rank {rank}"


def test_ddp_eval_is_local_and_exact(world):
    """Contract 5: rank 0 evaluates 3 batches, rank 1 one, and nobody hangs."""
    for rank, r in enumerate(world[1]):
        assert r["eval"]["error"] == (r["eval_errors_expected"], 16.0), f"rank {rank}"


def test_fsdp_equals_one_process_and_resumes_bit_identically(world):
    """Contracts 1 and 3 under FSDP2 (accumulation, clipping, Adam, scheduler): parameters are
    sharded DTensors; a save_sharded/load_sharded resume and a full state_dict round trip."""
    for rank, r in enumerate(world[2]):
        where = f"rank {rank}"
        assert r["sharded"] == "DTensor", where
        assert r["fsdp_vs_global"] < TOL, where
        assert r["resume_bit_identical"], where
        assert r["full_state_roundtrip"] == 0.0, where
        assert r["fsdp_syncbn_vs_global"] < 1e-5, where
    for key in ("saved_state", "after_step3"):
        _same_on_both_ranks(world[2], key)


def test_fsdp_eval_with_empty_batches_counts_every_sample_once(world):
    """Contract 5 for a collective eval: ranks without samples pass empty batches."""
    results = world[2]
    loss = sum(m["loss"][0] for r in results for m in r["eval"])
    errors = sum(m["error"][0] for r in results for m in r["eval"])
    count = sum(m["error"][1] for r in results for m in r["eval"])
    assert count == 10 and errors == results[0]["eval_expected"][1]
    assert loss == pytest.approx(results[0]["eval_expected"][0], rel=1e-5)


def test_fsdp_ema_equals_one_process_and_resumes_from_its_shards(world):
    """The EMA of the weights under FSDP (docs/reference/gradient_learner.md, Optimizers and schedules):
    after two steps it equals one process's on the global batch, its evaluation over the
    ranks too, and a sharded checkpoint restores it bit-identically, the schedule with it."""
    single = _ema_learner(strategy="ddp")
    single.setup(init_distributed(resolve_env({})))
    for s in range(2):
        single.train_step(_image_data(s, 16))
    x, y = _image_data(60, 8)
    expected = single.eval_step((x, y))
    for rank, r in enumerate(world[2]):
        assert r["ema_groups"] == [1e-2, 0.0], f"rank {rank}"
        assert _max_diff(r["ema_after2"], single.ema_state_dict()) < 1e-5, f"rank {rank}"
        assert r["ema_resume_bit_identical"], f"rank {rank}"
        # step 2 (from 0): the peak, just after warmup; a step count lost in the checkpoint
        # would have applied warmup's first rate, 0.001
        assert r["ema_lr"] == 0.1
    for key in ("ema_loss", "ema_error"):
        total = sum(r["ema_eval"][key][0] for r in world[2])
        assert total == pytest.approx(expected[key][0], rel=1e-5, abs=1e-6), key
    assert expected["ema_loss"] != expected["loss"]


def test_sharded_checkpoint_from_two_ranks_loads_on_one_process(world):
    """A DCP checkpoint written by 2 ranks loads in 1 process (no process group) with optimizer
    and scheduler state: its next step on the global batch equals the 2-rank run's."""
    ckpt, _, results, _ = world
    single = _fsdp_learner(seed=9)
    single.setup(init_distributed(resolve_env({})))
    single.load_sharded(ckpt)
    assert _max_diff(single.model_state_dict(), results[0]["saved_state"]) == 0.0
    assert single.num_optimizer_steps == 2
    assert single.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)
    single.train_step(_regression_data(2, 16))
    assert _max_diff(single.model_state_dict(), results[0]["after_step3"]) < TOL
