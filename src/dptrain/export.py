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

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptrain._version import __version__
from dptrain.data import load_dataset
from dptrain.data.config import DataConfig, load_split
from dptrain.data.loader import fetch_batch
from dptrain.data.normalisation import as_record
from dptrain.errors import ConfigError, ExportError
from dptrain.inference import Prediction, TrainedRun, class_probabilities, load_run, raw_inputs
from dptrain.options import pick
from dptrain.tagi import HRCSoftmax, base, lstm, split_heteros
from dptrain.train import checkpoint as ckpt

FORMATS = ("pt2", "onnx")
BATCH_SIZES = (1, 7)
RTOL, ATOL_SCALE, CLASS_AGREEMENT = 1e-4, 1e-5, 0.99
CHECKED_SAMPLES = 512
"""Test samples on which TAGI class agreement is checked."""


# ------------------------------------------------------------------------------- the graph
class RunGraph(nn.Module):
    """Raw inputs -> the run's decoded outputs (module docstring), as plain tensor arithmetic."""

    def __init__(self, run: TrainedRun, model: Any | None = None) -> None:
        super().__init__()
        self.run = [run]  # a list: not a submodule (a TAGI network is no nn.Module)
        model = run.model if model is None else model
        if run.kind == "torch":
            self.model = model.eval()
        else:
            self.tagi = [model]
        norm = run.x_norm
        self.register_buffer("x_mean", norm.mean.float() if norm is not None else torch.zeros(()))
        self.register_buffer("x_std", norm.std.float() if norm is not None else torch.ones(()))
        self.outputs = output_names(run)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        run = self.run[0]
        x = (x.float() - self.x_mean) / self.x_std
        if run.kind == "torch":
            out = self.model(x).float()
            if run.task == "classification":
                return (torch.softmax(out, dim=1),)
            return (run._to_data_units(out, None)[0],)
        net = self.tagi[0]
        mu, var = net(x.to(net.dtype))
        if run.task == "classification":
            return run.hrc.probabilities(mu, var), mu, var
        if run.model_config.heteroscedastic:
            pred = split_heteros(mu, var)
            return run._to_data_units(pred.mean, pred.total_var)
        return run._to_data_units(mu, var + run._sigma_v ** 2)


def output_names(run: TrainedRun) -> tuple[str, ...]:
    if run.kind == "torch":
        return ("probs",) if run.task == "classification" else ("mean",)
    return ("probs", "mu", "var") if run.task == "classification" else ("mean", "var")


def _clear_tagi_caches(run: TrainedRun, graph: RunGraph | None = None) -> None:
    """TAGI layers cache m_W² + v_W between forwards: a cache filled while tracing would hold
    a tracer's tensor, and one filled before would be baked into the graph as a constant."""
    if run.kind != "tagi":
        return
    for model in (run.model, *(graph.tagi if graph is not None else ())):
        for layer in model.descendants():
            if hasattr(layer, "clear_cache"):
                layer.clear_cache()


# ----------------------------------------------------------------------------- exporting
@dataclass(frozen=True)
class Written:
    path: Path
    metadata: dict[str, Any]


def export_run(run_dir: str | Path, fmt: str, out: str | Path, *, which: str = "best"
               ) -> Written:
    """Export the model `load_run(run_dir, which=which)` uses to `out`, check it against the
    live model, and write the metadata beside it. Raises ExportError in one line."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    run = load_run(run_dir, which=which)
    if run.kind == "tagi":
        run.model.eval()
        run.model.check_inputs = False  # its NaN check reads a value on the host
        refuse_recurrent(run)
    graph = RunGraph(run).eval()
    # Traced on a copy: tracing may leave a tracer's tensors in a TAGI network's buffers,
    # and the check runs the live model after it.
    traced = RunGraph(run, copy.deepcopy(run.model)).eval()
    split = run.load_data()
    raw = raw_inputs_of(split)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.{os.getpid()}.tmp{out.suffix}")
    try:
        with torch.no_grad():
            program = _write(traced, run, raw[:max(BATCH_SIZES)], fmt, tmp)
        # .pt2: the file as written, read back; .onnx: the program it was made from, and
        written = load_exported(tmp, fmt=fmt, outputs=graph.outputs) if fmt == "pt2" else \
            program_callable(program, graph.outputs)
        checks = check(written, graph, run, raw)
        if fmt == "onnx":  # and what deployments run: ONNX Runtime on the written file
            checks.update({f"onnxruntime_{k}": v for k, v in check(
                load_exported(tmp, fmt=fmt, outputs=graph.outputs), graph, run, raw).items()})
        metadata = _metadata(run, fmt, graph.outputs, which, checks)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        _clear_tagi_caches(run)
    meta_path = metadata_path(out)
    meta_path.write_text(json.dumps(metadata, indent=1))
    return Written(out, metadata)


def refuse_recurrent(run: TrainedRun) -> None:
    """A TAGI LSTM carries its hidden and cell states from one call to the next (a forecast
    feeds its predictions back through them): no single graph of one input is that model."""
    for path, layer in run.model.named_leaves():
        if isinstance(layer, lstm.LSTM):
            raise ExportError(f"{run.run_dir}: layer {path} ({type(layer).__name__}) cannot be "
                              f"exported: it carries its state from one call to the next")


def raw_inputs_of(split: Any) -> torch.Tensor:
    """The test part's inputs in the data's own units (the first CHECKED_SAMPLES)."""
    test = split.test
    if hasattr(test, "x"):
        return raw_inputs(test, split.x_norm)[:CHECKED_SAMPLES]
    samples = [test[i][0] for i in range(min(len(test), CHECKED_SAMPLES))]
    x = torch.stack(samples)
    return split.x_norm.invert(x) if split.x_norm is not None else x


def metadata_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".json")


def _write(graph: RunGraph, run: TrainedRun, example: torch.Tensor, fmt: str, tmp: Path
           ) -> torch.export.ExportedProgram:
    """Write the graph to `tmp`; the exported program (ONNX's is made from one)."""
    batch = torch.export.Dim("batch", min=1)
    _clear_tagi_caches(run, graph)
    with torch.no_grad():
        graph(example)  # fills the TAGI engine's constant caches with real tensors first
    caches = {id(c): (c, dict(c)) for c in _engine_caches(run)}
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    torch_log.setLevel(logging.CRITICAL)  # a failed trace logs its graph: the error says it
    try:
        # A failed trace prints its graph to stderr: the one-line error below says it.
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")  # torch's and onnxscript's deprecations
            if fmt == "pt2":
                program = torch.export.export(graph, (example,), dynamic_shapes=({0: batch},))
                torch.export.save(program, tmp)
                return program
            else:
                _require_onnx()
                onnx_program = torch.onnx.export(
                    graph, (example,), dynamo=True, dynamic_shapes=({0: batch},),
                    input_names=["x"], output_names=list(graph.outputs), verbose=False)
                onnx_program.save(str(tmp))
                return onnx_program.exported_program
    except ExportError:
        raise
    except Exception as err:  # noqa: BLE001 - the exporters raise many kinds: name the layer
        raise ExportError(f"{run.run_dir}: {culprit(err, run, graph)} cannot be exported to {fmt} "
                          f"({_first_line(err)})") from err
    finally:
        torch_log.setLevel(level)
        _clear_tagi_caches(run, graph)
        for cache, saved in caches.values():  # what tracing added holds a tracer's tensors
            cache.clear()
            cache.update(saved)


def _engine_caches(run: TrainedRun) -> list[dict]:
    """The TAGI engine's module-level caches of small constant tensors (made once per value,
    dtype and device); a tensor made while tracing and cached there would leak into every
    later forward. Restored after tracing."""
    if run.kind != "tagi":
        return []
    found = [base._CONSTANTS, base._SIGNED_INVERSES, lstm._INDICATORS, lstm._COV_PAIRS]
    if getattr(run, "hrc", None) is not None:
        found.append(run.hrc._on_device)
    return found


def _require_onnx() -> None:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as err:
        raise ExportError(f"--format onnx needs the export extra: pip install "
                          f"'dptrain[export]' ({err.name} is missing)") from None


def _first_line(err: BaseException) -> str:
    while err.__cause__ is not None and "torch.export" in str(err).split("\n", 1)[0]:
        err = err.__cause__
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]


def culprit(err: BaseException, run: TrainedRun, graph: RunGraph) -> str:
    """The innermost layer of the model on the failing call's stack ("layer 3 (Conv2d)"), from
    the tracebacks of the error and its causes; else the model's name."""
    names = _layer_names(graph.model if run.kind == "torch" else graph.tagi[0], run.kind)
    found = None
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        tb = err.__traceback__
        while tb is not None:
            obj = tb.tb_frame.f_locals.get("self")
            if obj is not None and id(obj) in names:
                found = obj
            tb = tb.tb_next
        err = err.__cause__ or err.__context__
    if found is None:
        return f"the model {run.model_config.model}"
    return f"layer {names[id(found)]} ({type(found).__name__})"


def _layer_names(model: Any, kind: str) -> dict[int, str]:
    if kind == "torch":
        return {id(m): name for name, m in model.named_modules() if name}
    return {id(layer): path for path, layer in model.named_leaves()}


# ------------------------------------------------------------------------ loading, checking
def program_callable(program: torch.export.ExportedProgram, outputs: tuple[str, ...]
                     ) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    module = program.module()

    def run_program(x: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return dict(zip(outputs, module(x.float())))
    return run_program


def load_exported(path: str | Path, *, fmt: str | None = None,
                  outputs: tuple[str, ...] | None = None
                  ) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    """A callable raw inputs -> {output name: tensor} for an exported file: its exported
    program (.pt2), or an ONNX Runtime session (.onnx)."""
    path = Path(path)
    fmt = fmt or path.suffix.lstrip(".")
    if outputs is None:
        outputs = tuple(read_metadata(path)["outputs"])
    if fmt == "pt2":
        return program_callable(torch.export.load(str(path)), outputs)
    if fmt != "onnx":
        raise ConfigError(f"{path}: an exported model ends in .pt2 or .onnx")
    _require_onnx()
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def run_session(x: torch.Tensor) -> dict[str, torch.Tensor]:
        got = session.run(list(outputs), {"x": x.float().numpy()})
        return {name: torch.from_numpy(value) for name, value in zip(outputs, got)}
    return run_session


def read_metadata(path: str | Path) -> dict[str, Any]:
    meta = metadata_path(path)
    if not meta.is_file():
        raise ConfigError(f"{path}: no metadata file {meta.name} beside it (written by "
                          f"dptrain export)")
    return json.loads(meta.read_text())


def check(exported: Callable[[torch.Tensor], dict[str, torch.Tensor]], graph: RunGraph,
          run: TrainedRun, raw: torch.Tensor) -> dict[str, float]:
    """Compare `exported` with the live model (module docstring); the largest differences by
    output, or ExportError naming the output and the difference."""
    report: dict[str, float] = {}
    for size in BATCH_SIZES:
        x = raw[:size]
        with torch.no_grad():
            live = dict(zip(graph.outputs, graph(x)))
        _clear_tagi_caches(run)
        got = exported(x)
        for name, expected in live.items():
            value = got[name].to(expected.dtype)
            if value.shape != expected.shape:
                raise ExportError(f"export check: output {name} has shape "
                                  f"{tuple(value.shape)} at batch size {size}, the live "
                                  f"model's {tuple(expected.shape)}")
            if name == "probs" and run.kind == "tagi":
                continue  # judged by the class it picks, below
            diff = (value - expected).abs()
            allowed = RTOL * expected.abs() + ATOL_SCALE * expected.abs().max().clamp_min(1e-12)
            if bool((diff > allowed).any()) or not bool(torch.isfinite(value).all()):
                raise ExportError(f"export check: output {name} differs from the live model at "
                                  f"batch size {size}: max |difference| "
                                  f"{diff.max().item():.3g} (allowed rtol {RTOL:g}, atol "
                                  f"{allowed.min().item():.3g})")
            report[f"{name}_max_abs_diff_b{size}"] = max(
                report.get(f"{name}_max_abs_diff_b{size}", 0.0), diff.max().item())
    if run.kind == "tagi" and run.task == "classification":
        expected_labels = run.predict(raw)[0].argmax(1)
        labels = torch.cat([exported(raw[i:i + 256])["probs"].argmax(1)
                            for i in range(0, len(raw), 256)])
        agreement = (labels == expected_labels).double().mean().item()
        if agreement < CLASS_AGREEMENT:
            raise ExportError(f"export check: output probs picks load_run's class for "
                              f"{100 * agreement:.1f} % of {len(raw)} test samples (needs "
                              f"{100 * CLASS_AGREEMENT:.0f} %)")
        report["class_agreement"] = agreement
    return report


def class_names(split: Any) -> list[str] | None:
    """An image folder's class folder names, else the class ids; None for regression."""
    if split.num_classes is None:
        return None
    files = getattr(split.test, "files", None)
    named = getattr(files, "classes", None)
    return list(named) if named else [str(c) for c in range(split.num_classes)]


def _metadata(run: TrainedRun, fmt: str, outputs: tuple[str, ...], which: str,
              checks: dict[str, float]) -> dict[str, Any]:
    weights = run.model.state_dict()
    split = run.load_data()
    return {
        "format": fmt, "inputs": {"x": {"shape": ["batch", *split.input_shape],
                                        "dtype": "float32", "units": "raw (the data's own)"}},
        "outputs": list(outputs), "task": run.task, "kind": run.kind,
        "class_names": class_names(split),
        "input_shape": list(split.input_shape),
        "normalisation": as_record(run.x_norm, run.y_norm),
        "probability_rule": ("hierarchical softmax of the output moments (docs/"
                             "finetune_export.md)" if run.kind == "tagi" and run.num_classes else None),
        "sigma_v": run._sigma_v if run.kind == "tagi" else None,
        "run_dir": str(run.run_dir), "checkpoint": str(run.checkpoint), "which": which,
        "model": run.model_config.model, "dataset": run.dataset,
        "data": asdict(pick(DataConfig, ckpt.validate(run.checkpoint).meta["config"]
                            ["record"])),
        "params_sha256": ckpt.params_sha256(weights),
        "dptrain_version": __version__, "torch_version": torch.__version__,
        "checked": {"batch_sizes": list(BATCH_SIZES), **checks},
    }


# ------------------------------------------------------------------------------ predicting
def predict_exported(path: str | Path, spec: str | None = None, part: str = "test", *,
                     batch_size: int = 256) -> tuple[Prediction, dict[str, Any]]:
    """`dptrain predict FILE.pt2|FILE.onnx`: the exported model's predictions for a dataset's
    part (default: the run's dataset, named in the metadata), decoded as `load_run` decodes
    them; also the metadata."""
    meta = read_metadata(path)
    exported = load_exported(path)
    if spec is not None:
        split = load_dataset(spec)
    else:  # the run's own data, read with the run's data options (image size, lookback...)
        split = load_split(DataConfig(**{**meta["data"], "augment": "off"}), seed=0)
    dataset = getattr(split, part)
    outputs: dict[str, list[torch.Tensor]] = {}
    targets = []
    for start in range(0, len(dataset), batch_size):
        raw, y = raw_batch(split, dataset, start, batch_size)
        targets.append(y)
        for name, value in exported(raw).items():
            outputs.setdefault(name, []).append(value)
    got = {name: torch.cat(values) for name, values in outputs.items()}
    targets = torch.cat(targets)
    if meta["task"] == "regression":
        if split.y_norm is not None:
            targets = split.y_norm.invert(targets)
        return Prediction(got["mean"], got.get("var"), targets), meta
    var = None
    if meta["kind"] == "tagi":  # the probabilities' variance, drawn as load_run draws it:
        hrc = HRCSoftmax(len(meta["class_names"]))  # per batch, from the same seed
        var = torch.cat([class_probabilities(hrc, mu, v)[1] for mu, v in
                         zip(outputs["mu"], outputs["var"])])
    return Prediction(got["probs"], var, targets), meta


def raw_batch(split: Any, dataset: Any, start: int, batch_size: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples [start, start + batch_size) of `dataset`: inputs in the data's own units (a lazy
    dataset read one batch at a time, as it gives them), and targets."""
    index = torch.arange(start, min(start + batch_size, len(dataset)))
    if hasattr(dataset, "x"):
        raw = getattr(dataset, "raw", None)
        if raw is not None:
            return raw[index], dataset.y[index]
        x, y = dataset.x[index], dataset.y[index]
    else:
        x, y = fetch_batch(dataset, 0, index)
    return (split.x_norm.invert(x) if split.x_norm is not None else x), y
