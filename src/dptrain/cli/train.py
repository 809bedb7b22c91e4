"""`dptrain train`: the main job. Parses options, then trains here or launches the processes.

Its flags and TOML keys are generated from the fields of `TrainOptions`: a field's docstring is
its flag's help, its default's type the flag's type; a bool field is a switch (`--average`, or
`--no-progress` for one that defaults to on); an on/off field has a flag for each (`--augment`,
`--no-augment`). Values resolve as defaults < the model's tuned defaults < a TOML file < flags
given on the command line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import tomllib
from dataclasses import MISSING, Field, fields, replace
from pathlib import Path
from typing import Any

from dptrain.data.config import NO_VALIDATION
from dptrain.runtime import DistEnv, resolve_env
from dptrain.runtime.job import job_id, stamp
from dptrain.runtime.threads import env_threads, this_process_share
from dptrain.errors import ConfigError
from dptrain.launcher import job_end
from dptrain.launcher.launch import launch
from dptrain.launcher.rendezvous import rendezvous_argv, rendezvous_conf
from dptrain.launcher.worker_env import use_threads
from dptrain.learners.build import model_defaults
from dptrain.options import field_docs, flag, literal_choices, value_type
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


FIRST_KEYS = ("model", "dataset", "nproc", "epochs", "batch_size", "seed")
"""Shown first in help texts and error messages: what a run is mostly told."""


def option_fields() -> list[Field]:
    """The fields of `TrainOptions`, the most used first."""
    by_name = {f.name: f for f in fields(TrainOptions)}
    return [by_name[n] for n in FIRST_KEYS] + [f for n, f in by_name.items()
                                               if n not in FIRST_KEYS]


def accepted_keys() -> list[str]:
    return [f.name for f in option_fields()]


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option (two for an on/off one); each defaults to None, meaning "not given"."""
    docs = field_docs(TrainOptions)
    for f in option_fields():
        text = docs[f.name].replace("%", "%%")
        meta, default = f.metadata, f.default
        if isinstance(default, bool):
            if default:
                parser.add_argument(f"--{meta['negative']}", dest=f.name, action="store_false",
                                    default=None, help=f"turn off: {text}")
            else:
                parser.add_argument(f"--{flag(f.name)}", action="store_true", default=None,
                                    help=text)
            continue
        if meta.get("negative"):
            parser.add_argument(f"--{flag(f.name)}", action="store_const", const="on",
                                default=None, help=f"{text} (default {default})")
            parser.add_argument(f"--{meta['negative']}", dest=f.name, action="store_const",
                                const="off")
            continue
        # An option that may be unset (None) says what unset means in its help instead.
        shown = f" (default {default})" if default not in ("", None, MISSING) else ""
        choices = literal_choices(TrainOptions, f.name) if meta.get("choices") else None
        parser.add_argument(f"--{flag(f.name)}", type=value_type(TrainOptions, f.name),
                            choices=choices, metavar=meta.get("metavar"), help=text + shown)


def _coerce(name: str, value: Any) -> Any:
    """Check a TOML value's type against the field's (TOML has real types); an option that may
    be unset takes its type's values, 0 among them (which `TrainOptions` reads as unset)."""
    default, kind = getattr(TrainOptions(), name), value_type(TrainOptions, name)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value, ok = str(value), True  # precision = 32 written as a number
        elif isinstance(value, bool) and default in ("auto", "on", "off"):
            value, ok = ("on" if value else "off"), True  # compile = true (an on/off option)
        elif isinstance(value, list) and all(isinstance(v, (int, float))
                                             and not isinstance(v, bool) for v in value):
            value, ok = ",".join(f"{v:g}" for v in value), True  # milestones = [30, 60, 80]
    if not ok:
        raise ConfigError(f"key {name!r}: expected a {kind.__name__}, got {value!r}")
    return value


def read_toml(path: Path | str) -> dict[str, Any]:
    """The options a TOML file sets, hyphens or underscores; unknown keys are an error."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return table_options(raw.get("train", raw), path)  # at the top level or under [train]


def table_options(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """The options of a TOML table, type-checked; an unknown key is an error naming `path`."""
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in accepted_keys():
            raise ConfigError(f"{path}: unknown key {key!r}; accepted: "
                              f"{', '.join(accepted_keys())}")
        out[name] = _coerce(name, value)
    return out


def resolve(flags: dict[str, Any], config_file: str | None) -> TrainOptions:
    """Defaults < the model's own defaults < TOML file < flags given on the command line (those
    not None)."""
    merged = read_toml(config_file) if config_file else {}
    merged.update({k: v for k, v in flags.items() if v is not None})
    if merged.get("val_size") == NO_VALIDATION:
        raise ConfigError(f"--val-size {NO_VALIDATION}: no validation part would leave the "
                          f"test part to choose the best epoch; only a run started before "
                          f"validation parts resumes so (dptrain sees to it): give a count or "
                          f"a fraction, or auto")
    merged = {**model_defaults(merged.get("model", TrainOptions.model),
                               merged.get("dataset", TrainOptions.dataset)), **merged}
    return TrainOptions(**merged)


def options_from_args(args: argparse.Namespace) -> TrainOptions:
    """Pure: the resolved options (defaults < --config file < flags); `out` as given."""
    flags = {name: getattr(args, name, None) for name in accepted_keys()}
    return resolve(flags, args.config)


def with_run_dir(options: TrainOptions, env: DistEnv,
                 environ: dict[str, str] | None = None) -> TrainOptions:
    """`options` with its run directory: --out when given; under a launcher the job's id when
    it names one (a restarted attempt finds the directory again), else "" for rank 0 to decide
    once the processes run; started here on one node, the time now; on several nodes "": their
    agents agree on one label (each node's clock would name another directory)."""
    if options.out:
        return options
    if env.launcher == "single":
        one_node = options.nodes.max_nodes == 1
        return replace(options, out=run_dir(options, stamp()) if one_node else "")
    job = job_id(env.launcher, environ)
    return replace(options, out=run_dir(options, job) if job else "")


def job_world_sizes(options: TrainOptions, env: DistEnv) -> list[tuple[int, str]]:
    """The world sizes the job may really have, each with where it comes from: the launcher's
    when one started this process (whatever --nproc says), else the processes started here on
    each number of nodes (an elastic job: from MIN to MAX)."""
    if env.launcher != "single":
        return [(env.world_size, f"from {env.launcher}")]
    nodes = options.nodes
    if nodes.max_nodes == 1:
        return [(options.nproc, f"--nproc {options.nproc}")]
    return [(options.nproc * n, f"{n} node(s) of --nnodes {nodes} x --nproc {options.nproc}")
            for n in range(nodes.min_nodes, nodes.max_nodes + 1)]


def train_command(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    env = resolve_env()
    for world_size, source in job_world_sizes(options, env):
        check_batch_split(options.batch_size, world_size, source)
    options = with_run_dir(options, env)
    one_process = options.nproc == 1 and options.nodes.max_nodes == 1 and \
        options.max_restarts == 0
    if options.threads:
        use_threads(options.threads)
    elif one_process and env.launcher == "single" and env_threads(os.environ) is None:
        # The one process of the job: every core it may use (a cgroup quota included, which
        # torch's own default ignores). Launched workers get theirs from launch() or the group.
        use_threads(this_process_share(1, launcher_side=True).threads)
    end_record = job_end.record_path(options.out, options.rdzv_id) \
        if options.nodes.elastic and env.launcher == "single" else None
    ended = job_end.report("train", end_record)
    if ended is not None:  # a node that comes after its elastic job ended: nothing to join
        return ended
    if env.launcher == "single" and not one_process:
        # A bad dataset, model file or model/dataset pair is one line here, before any worker
        # starts (the workers check it again, for launchers that start them directly).
        preflight(options)
    if env.launcher != "single" or one_process:
        # Already one of the launcher's processes (torchrun, mpirun, srun), or one is enough.
        run_training(options)
        return 0
    if options.out:
        out = Path(options.out)
        out.mkdir(parents=True, exist_ok=True)
        options_file = out / "options.json"
    else:  # the nodes' agents name the directory: the options wait elsewhere until then
        options_file = Path(tempfile.mkdtemp(prefix="dptrain-options-")) / "options.json"
    # Atomically: with a shared run directory another node's workers may be reading it.
    tmp = options_file.with_name(f".options.json.{os.getpid()}.tmp")
    tmp.write_text(options.to_json())
    os.replace(tmp, options_file)
    rendezvous = rendezvous_argv(options.nodes,
                                 None if options.node_rank < 0 else options.node_rank,
                                 options.rdzv_endpoint or None, options.rdzv_id,
                                 options.rdzv_backend)
    dynamic = options.node_rank < 0 and (options.nodes.max_nodes > 1 or
                                         options.rdzv_backend == "etcd")
    argv = [f"--nproc-per-node={options.nproc}", f"--max-restarts={options.max_restarts}",
            *rendezvous, "-m", "dptrain.cli.train_worker", str(options_file)]
    try:
        return launch(argv, options.nproc, command="train",
                      rdzv_endpoint=options.rdzv_endpoint or None,
                      max_nodes=options.nodes.max_nodes,
                      rdzv_conf=rendezvous_conf(options.rdzv_conf, options.timeout,
                                                options.rdzv_backend) if dynamic else None,
                      end_record=end_record, rdzv_backend=options.rdzv_backend)
    finally:
        if not options.out:
            shutil.rmtree(options_file.parent, ignore_errors=True)
