"""Running an exported file (the exported program, or ONNX Runtime) and checking it against
the live model (docs/tutorials/finetune_export.md, Checked when written)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dptrain.errors import ConfigError, ExportError
from dptrain.export.graph import LOGITS, RunGraph, clear_tagi_caches
from dptrain.inference import TrainedRun

BATCH_SIZES = (1, 7)
RTOL, ATOL_SCALE, CLASS_AGREEMENT = 1e-4, 1e-5, 0.99


def metadata_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".json")


def require_onnx() -> None:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as err:
        raise ExportError(f"--format onnx needs the export extra: pip install "
                          f"'dptrain[export]' ({err.name} is missing)") from None


def as_input(x: torch.Tensor, outputs: tuple[str, ...]) -> torch.Tensor:
    """What the graph takes: token ids as int64 for a language model, else float32."""
    return x.long() if outputs == LOGITS else x.float()


def program_callable(program: torch.export.ExportedProgram, outputs: tuple[str, ...]
                     ) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    module = program.module()

    def run_program(x: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return dict(zip(outputs, module(as_input(x, outputs))))
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
    require_onnx()
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def run_session(x: torch.Tensor) -> dict[str, torch.Tensor]:
        got = session.run(list(outputs), {"x": as_input(x, outputs).numpy()})
        return {name: torch.from_numpy(value) for name, value in zip(outputs, got)}
    return run_session


def read_metadata(path: str | Path) -> dict[str, Any]:
    meta = metadata_path(path)
    if not meta.is_file():
        raise ConfigError(f"{path}: no metadata file {meta.name} beside it (written by "
                          f"dptrain export)")
    return json.loads(meta.read_text())


def _checked_inputs(raw: torch.Tensor, outputs: tuple[str, ...]
                    ) -> list[tuple[str, str, torch.Tensor]]:
    """(key, words, inputs) at batch sizes 1 and 7; a language model's at its full context and
    at a shorter one too (its sequence length is dynamic), keyed "7x5" (batch x length)."""
    if outputs != LOGITS:
        return [(str(size), str(size), raw[:size]) for size in BATCH_SIZES]
    full = raw.shape[1]
    lengths = sorted({full, max(1, full // 2 + 1)}, reverse=True)
    return [(f"{size}x{length}", f"{size}, sequence length {length}", raw[:size, :length])
            for size in BATCH_SIZES for length in lengths]


def check(exported: Callable[[torch.Tensor], dict[str, torch.Tensor]], graph: RunGraph,
          run: TrainedRun, raw: torch.Tensor) -> dict[str, float]:
    """Compare `exported` with the live model (module docstring); the largest differences by
    output, or ExportError naming the output and the difference."""
    report: dict[str, float] = {}
    for size, said, x in _checked_inputs(raw, graph.outputs):
        with torch.no_grad():
            live = dict(zip(graph.outputs, graph(x)))
        clear_tagi_caches(run)
        got = exported(x)
        for name, expected in live.items():
            value = got[name].to(expected.dtype)
            if value.shape != expected.shape:
                raise ExportError(f"export check: output {name} has shape "
                                  f"{tuple(value.shape)} at batch size {said}, the live "
                                  f"model's {tuple(expected.shape)}")
            if name == "probs" and run.kind == "tagi":
                continue  # judged by the class it picks, below
            diff = (value - expected).abs()
            allowed = RTOL * expected.abs() + ATOL_SCALE * expected.abs().max().clamp_min(1e-12)
            if bool((diff > allowed).any()) or not bool(torch.isfinite(value).all()):
                raise ExportError(f"export check: output {name} differs from the live model at "
                                  f"batch size {said}: max |difference| "
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
