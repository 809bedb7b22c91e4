"""`dptrain export RUN_DIR --format pt2|onnx`: a trained run's model for deployment, checked
against the live model when written (the logic: `dptrain.export`)."""

from __future__ import annotations

import argparse
import sys

from dptrain.export import FORMATS, export_run


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export", help="export a trained run's model (torch.export .pt2 or ONNX)",
        description="Write the model of a dptrain train run (its best checkpoint, else its "
                    "last) with its input normalisation folded in and a dynamic batch "
                    "dimension, as a torch.export program (.pt2) or an ONNX file, and a "
                    "metadata file FILE.json beside it. TAGI models export their moment "
                    "propagation: output means and variances, and class probabilities by a "
                    "closed form (docs/tutorials/finetune_export.md). The export is checked "
                    "against the live model at batch sizes 1 and 7 (and ONNX Runtime for "
                    ".onnx).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a dptrain train run")
    p.add_argument("--format", choices=FORMATS, default="pt2",
                   help="pt2: a torch.export program; onnx: an ONNX file (default: pt2)")
    p.add_argument("--which", choices=("best", "last"), default="best",
                   help="which checkpoint (default: best, else the last)")
    p.add_argument("--out", metavar="FILE", help="default: model.pt2 or model.onnx here")
    p.add_argument("--no-ema", dest="ema", action="store_false",
                   help="a run with --ema: export its live weights, not their average")
    p.set_defaults(func=export_command)


def export_command(args: argparse.Namespace) -> int:
    out = args.out or f"model.{args.format}"
    written = export_run(args.run_dir, args.format, out, which=args.which, ema=args.ema)
    meta = written.metadata
    for note in written.notes:
        print(f"dptrain export: {note}", file=sys.stderr)
    checked = ", ".join(f"{k} {v:.3g}" for k, v in meta["checked"].items()
                        if k != "batch_sizes")
    # a language model's sequence length is dynamic too: checked at two (keys b7x8, b7x5)
    lengths = " at two sequence lengths each" if meta["outputs"] == ["logits"] else ""
    print(f"dptrain export: {meta['model']} of {args.run_dir} ({meta['checkpoint']}) -> "
          f"{written.path} ({args.format}; outputs {', '.join(meta['outputs'])}); checked "
          f"against the live model at batch sizes 1 and 7{lengths}: {checked}; metadata "
          f"{written.path}.json")
    return 0
