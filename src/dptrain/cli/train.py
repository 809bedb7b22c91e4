"""`dptrain train`: the main job. Parses options, then trains here or launches the processes."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from dptrain.cli.run import launch, rendezvous_argv, use_threads
from dptrain.cli.train_options import accepted_keys, add_option_flags, resolve
from dptrain.dist import DistEnv, resolve_env
from dptrain.dist.job import job_id, stamp
from dptrain.dist.threads import env_threads, this_process_share
from dptrain.train.job import preflight, run_dir, run_training
from dptrain.train.options import TrainOptions, check_batch_split


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help="train a built-in model data-parallel (the main job)",
        description="Train a TAGI or torch model data-parallel and write a run directory with "
                    "checkpoints, epochs.csv, TensorBoard events, plots and summary.json. With "
                    "no options: a TAGI MLP on the built-in digits, 2 processes on this machine.")
    p.add_argument("--config", metavar="FILE.toml",
                   help=f"options as TOML keys ({', '.join(accepted_keys())}); flags win")
    add_option_flags(p)
    p.set_defaults(func=train_command)


def options_from_args(args: argparse.Namespace) -> TrainOptions:
    """Pure: the resolved options (defaults < --config file < flags); `out` as given."""
    flags = {name: getattr(args, name, None) for name in accepted_keys()}
    return resolve(flags, args.config)


def with_run_dir(options: TrainOptions, env: DistEnv,
                 environ: dict[str, str] | None = None) -> TrainOptions:
    """`options` with its run directory: --out when given; under a launcher the job's id when
    it names one (a restarted attempt finds the directory again), else "" for rank 0 to decide
    once the processes run; started here, the time now."""
    if options.out:
        return options
    if env.launcher == "single":
        return replace(options, out=run_dir(options, stamp()))
    job = job_id(env.launcher, environ)
    return replace(options, out=run_dir(options, job) if job else "")


def job_world_size(options: TrainOptions, env: DistEnv) -> tuple[int, str]:
    """The world size the job will really have, and where it comes from: the launcher's when
    one started this process (whatever --nproc says), else the processes started here."""
    if env.launcher != "single":
        return env.world_size, f"from {env.launcher}"
    nnodes = options.nnodes
    if nnodes > 1:
        return options.nproc * nnodes, f"--nnodes {nnodes} x --nproc {options.nproc}"
    return options.nproc, f"--nproc {options.nproc}"


def train_command(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    env = resolve_env()
    check_batch_split(options.batch_size, *job_world_size(options, env))
    options = with_run_dir(options, env)
    one_process = options.nproc == 1 and options.nnodes == 1 and options.max_restarts == 0
    if options.threads:
        use_threads(options.threads)
    elif one_process and env.launcher == "single" and env_threads(os.environ) is None:
        # The one process of the job: every core it may use (a cgroup quota included, which
        # torch's own default ignores). Launched workers get theirs from launch() or the group.
        use_threads(this_process_share(1, launcher_side=True).threads)
    if env.launcher == "single" and not one_process:
        # A bad dataset, model file or model/dataset pair is one line here, before any worker
        # starts (the workers check it again, for launchers that start them directly).
        preflight(options)
    if env.launcher != "single" or one_process:
        # Already one of the launcher's processes (torchrun, mpirun, srun), or one is enough.
        run_training(options)
        return 0
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    options_file = out / "options.json"
    options_file.write_text(options.to_json())
    rendezvous = rendezvous_argv(options.nnodes,
                                 None if options.node_rank < 0 else options.node_rank,
                                 options.rdzv_endpoint or None, options.rdzv_id)
    argv = [f"--nproc-per-node={options.nproc}", f"--max-restarts={options.max_restarts}",
            *rendezvous, "-m", "dptrain.cli.train_worker", str(options_file)]
    return launch(argv, options.nproc, command="train",
                  rdzv_endpoint=options.rdzv_endpoint or None, nnodes=options.nnodes)
