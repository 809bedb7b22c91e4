"""`dptrain train`: the main job. Parses options, then trains here or launches the processes."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import fields, replace
from pathlib import Path

from dptrain.cli.run import use_threads
from dptrain.cli.train_options import (
    MODELS,
    TrainOptions,
    accepted_keys,
    check_batch_split,
    resolve,
)
from dptrain.dist import DistEnv, resolve_env
from dptrain.dist.job import job_id, stamp
from dptrain.dist.threads import env_threads, this_process_share


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help="train a built-in model data-parallel (the main job)",
        description="Train a TAGI or torch model data-parallel and write a run directory with "
                    "checkpoints, epochs.csv, TensorBoard events, plots and summary.json. With "
                    "no options: a TAGI MLP on the built-in digits, 2 processes on this machine.")
    docs = {f.name: (f.default, f.type) for f in fields(TrainOptions)}
    p.add_argument("--config", metavar="FILE.toml",
                   help=f"options as TOML keys ({', '.join(accepted_keys())}); flags win")
    p.add_argument("--model", metavar="MODEL",
                   help=f"{', '.join(MODELS)}, or PATH.py:FUNCTION: FUNCTION(input_shape, "
                        f"num_outputs) returns a dptrain.tagi.Sequential or a torch.nn.Module "
                        f"(default tagi-mlp)")
    p.add_argument("--dataset", help="digits, digits-image, diabetes, toy1d, toy1d-hetero, "
                   "mnist:DIR, "
                   "fashion-mnist:DIR, cifar10:DIR, csv:PATH, npz:PATH")
    for flag, kind, text in (
            ("nproc", int, "processes on this machine"),
            ("nnodes", int, "nodes; start the same command on each"),
            ("node-rank", int, "this node's rank (static rendezvous; -1: dynamic)"),
            ("epochs", int, "epochs"),
            ("batch-size", int, "global batch per step, split over the processes; tagi-resnet18 "
                                  "defaults to 64 (and --gain to 0.083)"),
            ("seed", int, "seed of the data order, initialisation and every RNG"),
            ("hidden", int, "width of the hidden layers of the MLPs"),
            ("width", int, "channels of the first ResNet stage (64: ResNet18)"),
            ("sigma-v", float, "TAGI observation noise σ_v of the first epoch"),
            ("sigma-v-min", float, "TAGI: σ_v never decays below this"),
            ("sigma-v-decay", float, "TAGI: σ_v at epoch e is max(sigma-v-min, "
                                     "sigma-v · sigma-v-decay^e)"),
            ("gain", float, "TAGI: initial weight and bias std gain (0: the model's)"),
            ("gain-bias", float, "TAGI: initial bias std gain if different (0: as --gain)"),
            ("lr", float, "learning rate (torch models)"),
            ("dropout", float, "torch-mlp: dropout probability after each hidden layer"),
            ("accumulation-steps", int, "torch models: micro-batches per optimizer step"),
            ("checkpoint-every", int, "also checkpoint every STEPS steps (0: epoch ends only)"),
            ("keep-last", int, "checkpoints kept"),
            ("patience", int, "early stopping patience in epochs (0: off)"),
            ("max-restarts", int, "restart the job up to K times; each restart resumes"),
            ("threads", int, "intra-op threads per process (0: OMP_NUM_THREADS if set, else "
                             "each process's share of the cores it may use)"),
            ("timeout", float, "seconds a collective waits for a missing rank")):
        default = docs[flag.replace("-", "_")][0]
        p.add_argument(f"--{flag}", type=kind, help=f"{text} (default {default})")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="rendezvous host:port reachable from every node (needed if --nnodes>1)")
    p.add_argument("--rdzv-id", help="job id of a dynamic rendezvous, shared by all nodes")
    p.add_argument("--precision", help="32 or 64 for TAGI; 32, bf16, fp16 for torch")
    p.add_argument("--strategy", choices=("ddp", "fsdp"), help="torch models (default ddp)")
    p.add_argument("--average", action="store_true", default=None,
                   help="TAGI: average the deltas over ranks (pytagi) instead of summing")
    p.add_argument("--heteroscedastic", action="store_true", default=None,
                   help="TAGI regression: learn the observation noise per input (EvenExp head) "
                        "instead of a fixed σ_v")
    p.add_argument("--augment", action="store_const", const="on", default=None,
                   help="random crop (4-pixel black padding) + horizontal flip of training "
                        "images (default: on for cifar10)")
    p.add_argument("--no-augment", dest="augment", action="store_const", const="off")
    p.add_argument("--out", metavar="DIR",
                   help="run directory (default runs/<model>-<dataset>-<job id or time>)")
    p.add_argument("--resume", choices=("auto", "never"), help="default auto")
    p.add_argument("--monitor", help="metric for early stopping (default test_error/test_rmse)")
    p.add_argument("--fail-at", metavar="RANK:STEP,...",
                   help="fault injection: that rank SIGKILLs itself before that step (RANK:ckpt:"
                        "STEP: while writing that step's checkpoint); one point per attempt")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    p.set_defaults(func=train_command)


def options_from_args(args: argparse.Namespace) -> TrainOptions:
    """Pure: the resolved options (defaults < --config file < flags); `out` as given."""
    flags = {name: getattr(args, name, None) for name in accepted_keys()}
    return resolve(flags, args.config)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "x"


def run_dir(options: TrainOptions, label: str) -> str:
    """`runs/<model>-<dataset>-<label>`; a dataset PATH or model file adds its file stem."""
    def name(spec: str) -> str:
        kind, sep, rest = spec.partition(":")
        if kind.endswith(".py"):  # PATH.py:FUNCTION
            return f"{Path(kind).stem}.{rest}"
        return f"{kind}-{Path(rest).stem}" if sep and Path(rest).suffix else kind

    return str(Path("runs") / _slug(f"{name(options.model)}-{name(options.dataset)}-{label}"))


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
        from dptrain.cli.train_worker import preflight

        preflight(options)
    if env.launcher != "single" or one_process:
        # Already one of the launcher's processes (torchrun, mpirun, srun), or one is enough.
        from dptrain.cli.train_worker import run_training

        run_training(options)
        return 0
    from dptrain.cli.run import launch, rendezvous_argv

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
