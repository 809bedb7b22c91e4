"""The registry's ResNets at ImageNet sizes: ImageNet's stem from 128 pixels up, CIFAR's below,
torch-resnet50, and pytagi's ImageNet ResNet18 stem for tagi-resnet18."""

from __future__ import annotations

import pytest
import torch

from dptrain.errors import ConfigError
from dptrain.models import ModelOptions, build_model, check_input
from dptrain.tagi import AvgPool2d, Conv2d


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_the_torch_resnets_are_the_usual_imagenet_ones_at_224():
    # torchvision's resnet18 and resnet50 have exactly these many parameters for 1000 classes
    assert _count(build_model("torch-resnet18", (3, 224, 224), 1000)) == 11_689_512
    assert _count(build_model("torch-resnet50", (3, 224, 224), 1000)) == 25_557_032
    small = build_model("torch-resnet50", (3, 32, 32), 10)
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in small.modules())
    assert small[1].kernel_size == (3, 3)  # CIFAR's stem below 128 pixels


@pytest.mark.parametrize("name", ["torch-resnet18", "torch-resnet50", "tagi-resnet18"])
def test_a_small_resnet_runs_on_imagenet_sized_images(name):
    model = build_model(name, (3, 128, 128), 11 if name.startswith("tagi") else 10,
                        ModelOptions(width=4))
    model.eval()
    x = torch.randn(2, 3, 128, 128)
    with torch.no_grad():
        out = model(x)[0] if name.startswith("tagi") else model(x)
    assert out.shape == (2, 11 if name.startswith("tagi") else 10)


def test_tagi_resnet18_takes_pytagis_imagenet_stem():
    net = build_model("tagi-resnet18", (3, 224, 224), 11, ModelOptions(width=8))
    stem = net.layers[0]
    assert isinstance(stem, Conv2d) and stem.kernel_size == 6 and stem.window.stride == 2
    assert isinstance(net.layers[3], AvgPool2d) and net.layers[3].window.padding_type == 2
    assert isinstance(net.layers[-2], AvgPool2d) and net.layers[-2].window.kernel == 7


def test_imagenet_sized_resnets_need_a_multiple_of_32():
    check_input("torch-resnet50", (3, 224, 224))
    with pytest.raises(ConfigError, match="multiple of 32 pixels .* after a 4x smaller stem"):
        check_input("tagi-resnet18", (3, 200, 200))
