"""The built-in model registry, user model files, the σ_v schedule and image augmentation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dptrain.cli.train import options_from_args, run_dir
from dptrain.cli.main import build_parser
from dptrain.data import load_dataset
from dptrain.data.datasets.images import ImageDataset, augmentation_draws, crop_flip
from dptrain.data.datasets.synthetic import write_synthetic_cifar10, write_synthetic_mnist
from dptrain.errors import ConfigError
from dptrain.models import MODELS, ModelOptions, build_model, check_input
from dptrain.learners.tagi_learner import TagiLearner
from dptrain.models.user_file import load_user_model, model_file_sha256

SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32), (64,)]


def _forward(model, kind: str, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(x)[0] if kind == "tagi" else model(x)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("shape", SHAPES)
def test_every_builtin_model_is_sized_from_the_data(name, shape):
    spec = MODELS[name]
    if "resnet" in name and shape in ((1, 28, 28),):
        with pytest.raises(ConfigError, match="multiple of 8"):
            check_input(name, shape)
        return
    sequence_model = "series" in spec.family.data and "images" not in spec.family.data
    if sequence_model and len(shape) > 2:  # (lookback, features) at most
        with pytest.raises(ConfigError, match=rf"model {name} takes windows of a time series"):
            check_input(name, shape)
        return
    if spec.takes_tokens:  # a language model: (block-size,) ids in, logits at every position
        if len(shape) != 1:
            with pytest.raises(ConfigError, match=rf"model {name} takes windows of token ids"):
                check_input(name, shape)
            return
        # torch: a logit per token; TAGI: the hierarchical softmax's outputs (11 for 10 tokens)
        outputs = 11 if spec.kind == "tagi" else 10
        model = build_model(name, shape, outputs,
                            ModelOptions(width=8, layers=1, heads=2, vocab_size=10))
        out = _forward(model, spec.kind, torch.randint(0, 10, (3, *shape)))
        assert tuple(out.reshape(3, *shape, -1).shape) == (3, *shape, outputs)
        return
    outputs = 11 if spec.kind == "tagi" else 10
    model = build_model(name, shape, outputs, ModelOptions(width=4, hidden=16))
    out = _forward(model, spec.kind, torch.randn(3, *shape))
    assert tuple(out.shape) == (3, outputs)


def test_image_models_refuse_non_images_in_one_line():
    for name in ("tagi-cnn", "torch-cnn", "torch-resnet18"):
        with pytest.raises(ConfigError, match=rf"model {name} takes images.*shape \(10,\)"):
            check_input(name, (10,))
    with pytest.raises(ConfigError, match="unknown model 'tagi-vgg'"):
        check_input("tagi-vgg", (1, 8, 8))
    check_input("tagi-mlp", (10,))  # flat models take anything


def test_torch_resnet18_is_the_cifar_resnet18():
    net = build_model("torch-resnet18", (3, 32, 32), 10)
    assert sum(p.numel() for p in net.parameters()) == 11_173_962  # the usual CIFAR ResNet18
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in net.modules())


def test_resnet_defaults_and_flags(tmp_path):
    parser = build_parser()
    opts = options_from_args(parser.parse_args(["train", "--model", "tagi-resnet18",
                                                "--out", str(tmp_path)]))
    assert (opts.batch_size, opts.sigma_v, opts.gain) == (64, 0.05, 0.083)
    opts = options_from_args(parser.parse_args([
        "train", "--model", "tagi-resnet18", "--batch-size", "8", "--gain", "0.5",
        "--sigma-v-min", "0.01", "--sigma-v-decay", "0.9", "--no-augment", "--out", "x"]))
    assert (opts.batch_size, opts.gain, opts.sigma_v_decay, opts.augment) == (8, 0.5, 0.9, "off")
    with pytest.raises(ConfigError, match="sigma-v-decay in \\(0, 1\\]"):
        options_from_args(parser.parse_args(["train", "--sigma-v-decay", "1.5", "--out", "x"]))


def test_gain_scales_the_initial_variances():
    from dptrain.tagi import manual_seed
    manual_seed(0)
    one = build_model("tagi-mlp", (4,), 2, ModelOptions(hidden=8)).state_dict()
    manual_seed(0)
    small = build_model("tagi-mlp", (4,), 2, ModelOptions(hidden=8, gain_weight=0.5,
                                                          gain_bias=0.25)).state_dict()
    torch.testing.assert_close(small["0.var_w"], one["0.var_w"] * 0.25)
    torch.testing.assert_close(small["0.var_b"], one["0.var_b"] * 0.0625)


# ------------------------------------------------------------------------ user model files
USER_MODELS = '''
import torch
from dptrain.tagi import Linear, ReLU, Sequential

def tagi_net(input_shape, num_outputs):
    return Sequential(Linear(64, 16), ReLU(), Linear(16, num_outputs))

def torch_net(input_shape, num_outputs):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, num_outputs))

def too_wide(input_shape, num_outputs):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, num_outputs + 1))

def not_a_model(input_shape, num_outputs):
    return 42
'''


def test_user_model_files(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(USER_MODELS)
    kw = dict(task="classification", num_classes=10, num_targets=None, seed=0)
    tagi = load_user_model(f"{path}:tagi_net", (64,), **kw)
    assert (tagi.kind, tagi.num_outputs) == ("tagi", 11)  # the HRC width, not the classes
    gradient = load_user_model(f"{path}:torch_net", (64,), **kw)
    assert (gradient.kind, gradient.num_outputs) == ("torch", 10)
    for spec, message in [
        (f"{tmp_path}/nope.py:f", "model file not found"),
        (f"{path}:missing", "has no function 'missing' \\(it defines: not_a_model, tagi_net, "
                            "too_wide, torch_net\\)"),
        (f"{path}:too_wide", "outputs 11 values per sample, the learner needs 10"),
        (f"{path}:not_a_model", "returned a int; expected a dptrain.tagi.Sequential"),
    ]:
        with pytest.raises(ConfigError, match=message) as info:
            load_user_model(spec, (64,), **kw)
        assert "\n" not in str(info.value)
    assert model_file_sha256(path) == __import__("hashlib").sha256(path.read_bytes()).hexdigest()


DTENSOR_MODEL = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_module

def sharded(input_shape, num_outputs):
    model = torch.nn.Sequential(torch.nn.Linear(input_shape[0], 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, num_outputs))
    return distribute_module(model, init_device_mesh("cpu", (1,)))
"""


def test_a_model_of_dtensors_is_refused_in_one_line(tmp_path):
    """Scope (README, docs/index.md): dptrain is data parallel only. A model file whose parameters are already
    DTensors (built here for real: a one-process gloo group on a FileStore, a 1-device CPU
    mesh) is refused by `load_user_model` with one line that says so and where to go instead,
    before any worker starts. Mutation tried: removing the check, which lets the DTensor model
    through (the test then fails on the missing ConfigError)."""
    import torch.distributed as dist

    path = tmp_path / "sharded.py"
    path.write_text(DTENSOR_MODEL)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match=r"parameter '0.weight' is a DTensor; dptrain does "
                                              r"data parallelism only") as info:
            load_user_model(f"{path}:sharded", (6,), task="regression", num_classes=None,
                            num_targets=2)
    finally:
        dist.destroy_process_group()
    message = str(info.value)
    assert "\n" not in message and "torchtitan" in message


# ------------------------------------------------------------------------------ σ_v schedule
def test_sigma_v_schedule_and_its_checkpoint():
    from dptrain.tagi import Linear, Sequential
    learner = TagiLearner(Sequential(Linear(2, 3)), task="classification", num_classes=2,
                          sigma_v=0.5, sigma_v_min=0.2, sigma_v_decay=0.8)
    values = []
    for epoch in range(6):
        learner.set_epoch(epoch)
        values.append(learner.sigma_v)
    assert values == pytest.approx([0.5, 0.4, 0.32, 0.256, 0.2048, 0.2])
    state = learner.state_dict()
    other = TagiLearner(Sequential(Linear(2, 3)), task="classification", num_classes=2)
    other.load_state_dict(state)
    assert other.sigma_v == pytest.approx(0.2) and other.sigma_v_at(3) == pytest.approx(0.256)


# ------------------------------------------------------------------------------ image data
def test_images_stay_uint8_and_batches_equal_the_normalised_floats(tmp_path):
    write_synthetic_mnist(tmp_path / "m", num_train=20, num_test=10)
    write_synthetic_cifar10(tmp_path / "c", num_train=20, num_test=10)
    for spec in (f"mnist:{tmp_path / 'm'}", f"cifar10:{tmp_path / 'c'}"):
        split = load_dataset(spec)
        assert isinstance(split.train, ImageDataset) and split.train.raw.dtype == torch.uint8
        idx = torch.tensor([3, 1, 7])
        x, y = split.train[idx]
        assert x.dtype == torch.float32
        torch.testing.assert_close(x, split.x_norm.apply(split.train.raw[idx].float()))
        assert split.train.x.shape == (20, *split.input_shape)
        x0, _ = split.train[3]
        torch.testing.assert_close(x0, x[0])


def test_crop_pads_with_raw_black_and_flip_mirrors():
    raw = torch.arange(2 * 1 * 4 * 4, dtype=torch.uint8).reshape(2, 1, 4, 4) + 1
    # offset 0 takes the 2-pixel padding's corner: raw zeros top-left
    out = crop_flip(raw, torch.tensor([0, 2]), torch.tensor([0, 2]),
                    torch.tensor([False, True]), pad=2)
    assert out[0, 0, :2, :].eq(0).all() and out[0, 0, :, :2].eq(0).all()
    torch.testing.assert_close(out[0, 0, 2:, 2:], raw[0, 0, :2, :2])
    torch.testing.assert_close(out[1, 0], raw[1, 0].flip(-1))  # centred crop, mirrored


def test_augmentation_depends_on_seed_epoch_and_index_only(tmp_path):
    write_synthetic_cifar10(tmp_path, num_train=40, num_test=10)
    split = load_dataset(f"cifar10:{tmp_path}")
    aug = split.train.with_augmentation(seed=3)
    aug.set_epoch(2)
    whole, _ = aug[torch.arange(40)]
    parts = torch.cat([aug[torch.tensor([i])][0] for i in range(39, -1, -1)]).flip(0)
    assert torch.equal(whole, parts)  # the same image whatever batch it falls in
    dy, dx, flip = augmentation_draws(3, 2, torch.arange(4000))
    assert set(dy.tolist()) == set(range(9)) and set(dx.tolist()) == set(range(9))
    assert 0.45 < flip.float().mean() < 0.55
    aug.set_epoch(3)
    assert not torch.equal(aug[torch.arange(40)][0], whole)
    assert not torch.equal(split.train[torch.arange(40)][0], whole)  # test/plain: untouched
    assert np.isclose(float(split.train.raw.float().mean()), float(aug.raw.float().mean()))


def _describe(layer) -> str:
    """A compact spelling of a TAGI layer, to compare with pytagi's ResNet18 listing."""
    from dptrain.tagi import AvgPool2d, BatchNorm2d, Conv2d, Linear, MixtureReLU
    if isinstance(layer, Conv2d):
        w = layer.window
        return f"C{layer.in_channels}>{layer.out_channels}k{w.kernel}s{w.stride}p{w.padding}" \
               f"t{w.padding_type}{'b' if layer.bias else ''}"
    if isinstance(layer, MixtureReLU):
        return "M"
    if isinstance(layer, BatchNorm2d):
        return "B"
    if isinstance(layer, AvgPool2d):
        return f"A{layer.kernel_size}"
    if isinstance(layer, Linear):
        return f"L{layer.input_size}>{layer.output_size}"
    return type(layer).__name__


def test_tagi_resnet18_is_pytagis_cifar10_resnet18():
    """Layer by layer as pytagi's `resnet18_cifar10`: 3x3 conv (no bias) - MixtureReLU -
    BatchNorm2d everywhere, stride-2 convs with padding_type 2, 2x2 stride-2 projections,
    AvgPool2d(4), Linear(512, 11); initial weight variances scaled by gain² = 0.083²."""
    from dptrain.tagi import ResNetBlock, manual_seed
    manual_seed(0)
    net = build_model("tagi-resnet18", (3, 32, 32), 11, ModelOptions(gain_weight=0.083))
    plan = []
    for layer in net.layers:
        if isinstance(layer, ResNetBlock):
            main = " ".join(_describe(x) for x in layer.main.layers)
            short = "" if layer.short is None else \
                " | " + " ".join(_describe(x) for x in layer.short.layers)
            plan.append(f"[{main}{short}]")
        else:
            plan.append(_describe(layer))
    cbm = "C{0}>{1}k3s1p1t1 M B C{1}>{1}k3s1p1t1 M B"
    down = "C{0}>{1}k3s2p1t2 M B C{1}>{1}k3s1p1t1 M B | C{0}>{1}k2s2p0t1 M B"
    assert plan == ["C3>64k3s1p1t1", "M", "B",
                    f"[{cbm.format(64, 64)}]", f"[{cbm.format(64, 64)}]",
                    f"[{down.format(64, 128)}]", f"[{cbm.format(128, 128)}]",
                    f"[{down.format(128, 256)}]", f"[{cbm.format(256, 256)}]",
                    f"[{down.format(256, 512)}]", f"[{cbm.format(512, 512)}]",
                    "A4", "L512>11"]
    # He init: v_w = (gain · sqrt(1 / (C k²)))², for the stem C k² = 27
    mean_var = net.state_dict()["0.var_w"].mean().item()
    assert mean_var == pytest.approx((0.083 ** 2) / 27, rel=1e-5)


def test_default_run_directory_of_a_model_file_stays_under_runs():
    opts = options_from_args(build_parser().parse_args(
        ["train", "--model", "/tmp/somewhere/my_models.py:small_cnn"]))
    assert run_dir(opts, "20261123-101500") == "runs/my_models.small_cnn-digits-20261123-101500"
