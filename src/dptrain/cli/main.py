"""`dptrain` command line: one subcommand per module, each registering itself."""

from __future__ import annotations

import argparse
import sys

from dptrain._version import __version__
from dptrain.cli import env as env_cmd
from dptrain.cli import export as export_cmd
from dptrain.cli import generate as generate_cmd
from dptrain.cli import predict as predict_cmd
from dptrain.cli import run as run_cmd
from dptrain.cli import train as train_cmd
from dptrain.cli import tune as tune_cmd
from dptrain.errors import DptrainError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dptrain", description="Data-parallel training of "
                                     "gradient and TAGI learners on torch.distributed.")
    parser.add_argument("--version", action="version", version=f"dptrain {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in (train_cmd, tune_cmd, run_cmd, predict_cmd, generate_cmd, export_cmd,
                   env_cmd):
        module.add_parser(subparsers)
    return parser


def _rank_prefix() -> str:
    """"rank R: " when this process is one of several (started by torchrun, mpirun, srun), so
    that each rank's line says whose it is."""
    from dptrain.runtime import resolve_env

    try:
        env = resolve_env()
    except DptrainError:  # the launcher's variables may be what was wrong
        return ""
    return f"rank {env.rank}: " if env.is_distributed else ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DptrainError as err:
        text = str(err)
        prefix = _rank_prefix()
        if text.startswith(prefix):  # the message names its rank already
            prefix = ""
        print(f"dptrain {args.command}: error: {prefix}{text}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"dptrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
