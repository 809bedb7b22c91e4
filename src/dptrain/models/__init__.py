"""Model families, one module each, and the registry that knows them by name.

    from dptrain.models import build_model, get_model

    spec = get_model("tagi-cnn")                      # kind "tagi", its family, defaults
    net = build_model("tagi-cnn", (1, 28, 28), 11)    # a dptrain.tagi.Sequential
    cnn = build_model("torch-resnet18", (3, 32, 32), 10, ModelOptions(width=8))  # nn.Module

`num_outputs` is the output width the learner needs: the hierarchical-softmax width for TAGI
classification (`HRCSoftmax(num_classes).num_outputs`, 11 for 10 classes), the number of classes
for torch classification, the number of targets for regression. `check_input(name,
input_shape)` says, in one line, why a model cannot take a shape, so the command line can
refuse a dataset before any worker starts. docs/howto/model_family.md adds a family.
"""

from dptrain.models.cnn import CNN_GAIN, cnn_default_gain
from dptrain.models.data_spec import DataSpec, SeriesLayout
from dptrain.models.gpt import tagi_gpt
from dptrain.models.registry import (
    FAMILIES,
    MODELS,
    build_model,
    family_blocks,
    check_input,
    check_model_options,
    get_model,
    kind_of,
    metric_extras,
    model_names,
    register,
)
from dptrain.models.resnet import IMAGENET_STEM_FROM
from dptrain.models.shapes import image_shape
from dptrain.models.spec import Family, Kind, MetricExtras, ModelOptions, ModelSpec, num_outputs

__all__ = ["CNN_GAIN", "DataSpec", "FAMILIES", "Family", "IMAGENET_STEM_FROM", "Kind",
           "MODELS", "MetricExtras", "ModelOptions", "ModelSpec", "SeriesLayout",
           "build_model", "check_input", "check_model_options", "cnn_default_gain", "family_blocks", "get_model", "image_shape", "kind_of", "metric_extras",
           "model_names", "num_outputs", "register", "tagi_gpt"]
