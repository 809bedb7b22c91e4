"""`export_run`: write a run's graph as a torch.export program or an ONNX file, check it, and
write its metadata beside it."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dptrain._version import __version__
from dptrain.data.config import DataConfig
from dptrain.data.normalisation import as_record
from dptrain.errors import ConfigError, ExportError
from dptrain.fingerprint import params_sha256
from dptrain.export.check import (
    BATCH_SIZES,
    check,
    load_exported,
    metadata_path,
    program_callable,
    require_onnx,
)
from dptrain.export.graph import (
    LOGITS,
    RunGraph,
    clear_tagi_caches,
    culprit,
    engine_caches,
    refuse_recurrent,
)
from dptrain.inference import TrainedRun, load_run
from dptrain.options import pick
from dptrain.train import checkpoint as ckpt

FORMATS = ("pt2", "onnx")


@dataclass(frozen=True)
class Written:
    path: Path
    metadata: dict[str, Any]
    notes: tuple[str, ...] = ()
    """How the run was loaded (`TrainedRun.notes`)."""


def export_run(run_dir: str | Path, fmt: str, out: str | Path, *, which: str = "best",
               ema: bool = True) -> Written:
    """Export the model `load_run(run_dir, which=which, ema=ema)` uses to `out`, check it
    against the live model, and write the metadata beside it. Raises ExportError in one
    line."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    run = load_run(run_dir, which=which, ema=ema)
    if run.kind == "tagi":
        run.model.eval()
        run.model.check_inputs = False  # its NaN check reads a value on the host
        refuse_recurrent(run)
    graph = RunGraph(run).eval()
    # Traced on a copy: tracing may leave a tracer's tensors in a TAGI network's buffers,
    # and the check runs the live model after it.
    traced = RunGraph(run, copy.deepcopy(run.model)).eval()
    raw = run.examples()
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
        clear_tagi_caches(run)
    meta_path = metadata_path(out)
    meta_tmp = meta_path.with_name(f".{meta_path.name}.{os.getpid()}.tmp")
    meta_tmp.write_text(json.dumps(metadata, indent=1))
    os.replace(meta_tmp, meta_path)
    return Written(out, metadata, run.notes)


def _dynamic_shapes(graph: RunGraph, example: torch.Tensor) -> tuple[dict, ...]:
    """The batch dimension; for a language model the sequence length too, up to its context
    (the example's, the longest: the model refuses more)."""
    batch = torch.export.Dim("batch", min=1)
    if graph.outputs != LOGITS:
        return ({0: batch},)
    return ({0: batch, 1: torch.export.Dim("seq", min=1, max=example.shape[1])},)


def _write(graph: RunGraph, run: TrainedRun, example: torch.Tensor, fmt: str, tmp: Path
           ) -> torch.export.ExportedProgram:
    """Write the graph to `tmp`; the exported program (ONNX's is made from one)."""
    dynamic = _dynamic_shapes(graph, example)
    clear_tagi_caches(run, graph)
    with torch.no_grad():
        graph(example)  # fills the TAGI engine's constant caches with real tensors first
    caches = {id(c): (c, dict(c)) for c in engine_caches(run)}
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    torch_log.setLevel(logging.CRITICAL)  # a failed trace logs its graph: the error says it
    try:
        # A failed trace prints its graph to stderr: the one-line error below says it.
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")  # torch's and onnxscript's deprecations
            if fmt == "pt2":
                program = torch.export.export(graph, (example,), dynamic_shapes=dynamic)
                torch.export.save(program, tmp)
                return program
            else:
                require_onnx()
                onnx_program = torch.onnx.export(
                    graph, (example,), dynamo=True, dynamic_shapes=dynamic,
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
        clear_tagi_caches(run, graph)
        for cache, saved in caches.values():  # what tracing added holds a tracer's tensors
            cache.clear()
            cache.update(saved)


def _first_line(err: BaseException) -> str:
    while err.__cause__ is not None and "torch.export" in str(err).split("\n", 1)[0]:
        err = err.__cause__
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]


def _metadata(run: TrainedRun, fmt: str, outputs: tuple[str, ...], which: str,
              checks: dict[str, float]) -> dict[str, Any]:
    weights = run.model.state_dict()
    shape = run.data.input_shape
    language_model = outputs == LOGITS
    inputs = {"shape": ["batch", "seq"], "dtype": "int64", "max_seq": shape[0],
              "units": "token ids of the vocabulary below"} if language_model else \
        {"shape": ["batch", *shape], "dtype": "float32",
         "units": "raw (the data's own)"}
    return {
        "format": fmt, "inputs": {"x": inputs},
        "outputs": list(outputs), "task": run.task, "kind": run.kind,
        "class_names": None if language_model or run.data.class_names is None
        else list(run.data.class_names),
        "vocabulary": run.vocabulary.to_json() if language_model else None,
        "input_shape": list(shape),
        "normalisation": as_record(run.x_norm, run.y_norm),
        "probability_rule": ("hierarchical softmax of the output moments (docs/"
                             "finetune_export.md)" if run.kind == "tagi" and run.num_classes else None),
        "sigma_v": run._sigma_v if run.kind == "tagi" else None,
        "run_dir": str(run.run_dir), "checkpoint": str(run.checkpoint), "which": which,
        "model": run.model_config.model, "dataset": run.dataset,
        "data": asdict(pick(DataConfig, ckpt.validate(run.checkpoint).meta["config"]
                            ["record"])),
        "params_sha256": params_sha256(weights),
        "weights": "ema" if run.averaged else "live",
        "dptrain_version": __version__, "torch_version": torch.__version__,
        "checked": {"batch_sizes": list(BATCH_SIZES), **checks},
    }
