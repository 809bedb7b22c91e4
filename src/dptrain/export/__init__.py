"""Export a trained run for deployment: `dptrain export RUN_DIR --format pt2|onnx --out FILE`.

    from dptrain.export import export_run, load_exported

    written = export_run("runs/tagi-mlp-digits-1", "onnx", "model.onnx")   # checked, or raises
    exported = load_exported("model.onnx")                              # ONNX Runtime
    outputs = exported(raw_inputs)          # {"probs": (B, K), "mu": (B, N), "var": (B, N)}

The exported graph is the model `load_run` uses with the run's input normalisation folded in:
raw inputs in (as `TrainedRun.predict` takes them), a dynamic batch dimension. Its outputs:

    torch, classification   probs (softmax)
    torch, regression       mean (data units)
    TAGI, classification    probs (the closed form below), mu, var (the output layer's moments)
    TAGI, regression        mean, var (data units; var includes the observation noise σ_v²)

TAGI class probabilities are deterministic: the hierarchical softmax of the output moments,
P(class) = Π_c Φ(±m_n / sqrt(1/α² + v_n)) over the class's tree nodes (α = 3), the same rule
whose values `load_run` reports as its mean probabilities. `load_run` also reports their
variance from 256 draws of the outputs; the graph gives mu and var instead, from which
`dptrain predict FILE` draws the same variance outside the graph.

Every export is checked when written: the exported program (and, for .onnx, ONNX Runtime)
against the live model at batch sizes 1 and 7 of the run's test inputs, moments to rtol 1e-4
with an absolute tolerance of 1e-5 times the output's largest magnitude; TAGI class
probabilities must pick `load_run`'s class for at least 99 % of the test samples. A metadata
file `FILE.json` beside it says what goes in and comes out.
"""

from dptrain.export.check import check, load_exported, metadata_path, read_metadata
from dptrain.export.graph import RunGraph, output_names
from dptrain.export.predict import predict_exported
from dptrain.export.write import FORMATS, Written, export_run

__all__ = ["FORMATS", "RunGraph", "Written", "check", "export_run", "load_exported",
           "metadata_path", "output_names", "predict_exported",
           "read_metadata"]
