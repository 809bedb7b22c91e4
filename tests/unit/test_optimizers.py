"""Optimizers of torch runs (docs/reference/gradient_learner.md, Optimizers and schedules): the weight-decay
groups follow torchvision's `set_weight_decay` rule, decay shrinks exactly what it should, LARS
is the paper's update, label smoothing is torch's, and the EMA is its recursion."""

from __future__ import annotations

import torch
from torch import nn

from dptrain.data import load_digits
from dptrain.runtime import init_distributed
from dptrain.learners.build import create_learner, task_loss
from dptrain.learners.config import LearnerConfig, ModelConfig
from dptrain.learners.lars import Lars
from dptrain.models import ModelOptions, build_model
from dptrain.learners.optim import OptimizerSpec, param_groups
from dptrain.learners.torch_learner import TorchLearner

TORCHVISION_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
                     nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm)


def torchvision_groups(model: nn.Module, wd: float) -> dict[str, list[nn.Parameter]]:
    """torchvision references/classification/utils.py `set_weight_decay(model, wd,
    norm_weight_decay=0.0, custom_keys_weight_decay=[("bias", 0.0)])`, reconstructed from its
    rule (the reference scripts are in no wheel): a walk over modules with their prefixes; a
    parameter whose name matches a custom key goes to that key's group, else a normalisation
    module's to "norm", else to "other"."""
    groups: dict[str, list[nn.Parameter]] = {"other": [], "norm": [], "bias": []}

    def add(module: nn.Module, prefix: str = "") -> None:
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if name == "bias":  # key "bias" has no ".", so it is matched against the name
                groups["bias"].append(p)
            elif isinstance(module, TORCHVISION_NORMS):
                groups["norm"].append(p)
            else:
                groups["other"].append(p)
        for child_name, child in module.named_children():
            add(child, f"{prefix}.{child_name}" if prefix else child_name)

    add(model)
    return groups


def _resnet18() -> nn.Module:
    torch.manual_seed(0)
    return build_model("torch-resnet18", (3, 32, 32), 10, ModelOptions(width=8))


def test_decay_groups_are_torchvisions_on_a_resnet18():
    model = _resnet18()
    expected = torchvision_groups(model, 5e-5)
    ours = param_groups(model, 5e-5)
    assert [g["weight_decay"] for g in ours] == [5e-5, 0.0]
    ids = [[id(p) for p in g["params"]] for g in ours]
    assert ids[0] == [id(p) for p in expected["other"]]  # the same parameters, same order
    assert sorted(ids[1]) == sorted(id(p) for p in expected["norm"] + expected["bias"])
    # 20 BatchNorms: their weights by the norm rule, their biases (and the head's) by the key
    assert len(expected["norm"]) == 20 and len(expected["bias"]) == 21 and expected["other"]
    # With the flag: torch's own default, one decayed group of everything.
    everything = param_groups(model, 5e-5, decay_norm_and_bias=True)
    assert [len(g["params"]) for g in everything] == [len(list(model.parameters()))]


def test_a_zero_gradient_sgd_step_shrinks_decayed_weights_by_exactly_one_minus_lr_wd():
    """lr and wd powers of two: p - lr*(wd*p) and p*(1 - lr*wd) are then the same real number,
    rounded once each, so bit-equal; excluded tensors do not move at all."""
    model = _resnet18()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = OptimizerSpec(name="sgd", lr=0.5, weight_decay=2.0 ** -4).for_module(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    modules = dict(model.named_modules())
    decayed = excluded = 0
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if leaf == "bias" or isinstance(modules[owner], TORCHVISION_NORMS):
            assert torch.equal(p, before[name]), name
            excluded += 1
        else:
            assert torch.equal(p, before[name] * (1 - 0.5 * 2.0 ** -4)), name
            decayed += 1
    assert decayed and excluded


def test_lars_is_the_papers_update():
    """You et al. 2017, Algorithm 1, two steps by hand in float64."""
    torch.manual_seed(1)
    w0 = torch.randn(5, 3, dtype=torch.float64)
    grads = [torch.randn(5, 3, dtype=torch.float64) for _ in range(2)]
    lr, m, beta, eta = 0.7, 0.9, 1e-3, 0.02
    w = nn.Parameter(w0.clone())
    bias = nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = Lars([{"params": [w]}, {"params": [bias], "weight_decay": 0.0}], lr=lr, momentum=m,
               weight_decay=beta, trust_coefficient=eta)
    ref, v, ref_b, v_b = w0.clone(), torch.zeros_like(w0), torch.ones(3, dtype=torch.float64), 0
    for g in grads:
        w.grad, bias.grad = g.clone(), g[0].clone()
        opt.step()
        local = eta * ref.norm() / (g.norm() + beta * ref.norm())
        v = m * v + lr * local * (g + beta * ref)
        ref = ref - v
        v_b = m * v_b + lr * g[0]  # undecayed: plain momentum SGD
        ref_b = ref_b - v_b
    torch.testing.assert_close(w.detach(), ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(bias.detach(), ref_b, rtol=1e-12, atol=1e-14)


def _digits_learner(**options) -> TorchLearner:
    learner = create_learner(ModelConfig(model="torch-mlp", hidden=16), LearnerConfig(**options),
                             load_digits(), seed=0)
    learner.setup(init_distributed())
    return learner


def test_the_label_smoothed_loss_is_torchs_and_evaluation_reports_the_plain_one():
    split = load_digits()
    x, y = split.train.x[:64], split.train.y[:64]
    learner = _digits_learner(label_smoothing=0.1)
    assert isinstance(learner.loss_fn, nn.CrossEntropyLoss)
    assert learner.loss_fn.label_smoothing == 0.1
    with torch.no_grad():
        logits = learner.module(x)
    smoothed = nn.CrossEntropyLoss(label_smoothing=0.1)(logits, y)
    # The closed form: (1 - e) x cross-entropy + e x mean over classes of -log p.
    logp = logits.log_softmax(1)
    by_hand = (0.9 * -logp.gather(1, y[:, None]).squeeze(1) - 0.1 * logp.mean(1)).mean()
    torch.testing.assert_close(smoothed, by_hand)
    evaluated = learner.eval_step((x, y))["loss"]
    plain = nn.CrossEntropyLoss()(logits, y)
    assert abs(evaluated[0] / evaluated[1] - plain.item()) < 1e-6
    trained = learner.train_step((x, y))["loss"]  # the step's loss, before it updates
    assert abs(trained[0] / trained[1] - smoothed.item()) < 1e-6
    assert task_loss("classification").label_smoothing == 0.0


def test_the_ema_is_its_closed_form_recursion():
    """ema_0 = w_0; after optimizer step k with k % every == 0: ema = d ema + (1 - d) w_k."""
    split = load_digits()
    decay, every = 0.75, 2
    learner = _digits_learner(optimizer="sgd", lr=0.1, momentum=0.9, ema=decay,
                              ema_every=every)
    expected = {n: t.detach().double().clone() for n, t in learner.module.state_dict().items()}
    for k in range(1, 6):
        learner.train_step((split.train.x[32 * k:32 * k + 32], split.train.y[32 * k:32 * k + 32]))
        if k % every == 0:
            for name, w in learner.module.state_dict().items():
                expected[name] = decay * expected[name] + (1 - decay) * w.double()
    ema = learner.ema_state_dict()
    assert ema.keys() == expected.keys()
    for name, value in ema.items():
        torch.testing.assert_close(value.double(), expected[name], rtol=1e-6, atol=1e-7)
    first = next(iter(ema))
    assert not torch.equal(ema[first], learner.module.state_dict()[first])  # it did average
    metrics = learner.eval_step((split.test.x[:50], split.test.y[:50]))
    assert {"ema_loss", "ema_error", "loss", "error"} <= metrics.keys()
    assert learner.step_scalars() == {"lr": 0.1}


def test_a_user_factory_keeps_working_and_cannot_be_mixed_with_a_schedule():
    import functools
    import pytest

    from dptrain.errors import ConfigError
    from dptrain.learners.schedule import LrSchedule

    model = nn.Linear(4, 2)
    learner = TorchLearner(model, nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.25))
    learner.setup(init_distributed())
    learner.train_step((torch.randn(8, 4), torch.randn(8, 2)))
    assert learner.optimizer.param_groups[0]["lr"] == 0.25 and learner.step_scalars() == \
        {"lr": 0.25}
    scheduled = TorchLearner(nn.Linear(4, 2), nn.MSELoss(),
                             functools.partial(torch.optim.SGD, lr=1.0),
                             lr_schedule=LrSchedule(peak=1.0, total_steps=4, warmup_steps=2,
                                                    warmup_start=0.5))
    scheduled.setup(init_distributed())
    applied = []
    for _ in range(4):
        scheduled.train_step((torch.randn(8, 4), torch.randn(8, 2)))
        applied.append(scheduled.step_scalars()["lr"])
    assert applied == [0.5, 0.75, 1.0, 1.0]
    with pytest.raises(ConfigError, match="not both"):
        TorchLearner(nn.Linear(4, 2), nn.MSELoss(), functools.partial(torch.optim.SGD, lr=1.0),
                     lr_schedule=LrSchedule(peak=1.0, total_steps=4),
                     scheduler_factory=lambda o: torch.optim.lr_scheduler.StepLR(o, 1))
