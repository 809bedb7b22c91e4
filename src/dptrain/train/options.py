"""The options of a training job: `FitOptions` (the Trainer's), and `TrainOptions`, the union of
every component's config that `dptrain train` takes, one flag and one TOML key per field.

    from dptrain.train.options import TrainOptions, run_record

    options = TrainOptions(model="tagi-cnn", dataset="digits-image", epochs=3)
    options.sections().model           # its ModelConfig, for dptrain.learners.build
    options.sections().fit             # its FitOptions, for the Trainer's TrainConfig
    run_record(options)                # what defines the run, stored in every checkpoint

`TrainOptions` stays one flat dataclass: the command line, a TOML file, options.json and the
run record are flat, one name per option (`model` is the model's name there, `epochs` the
epochs). Each component is handed its own section (`TrainOptions.sections`), never the union.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from dptrain.data import world_sizes_dividing
from dptrain.data.config import NO_VALIDATION, DataConfig
from dptrain.runtime.launch import LaunchConfig
from dptrain.errors import ConfigError
from dptrain.learners.config import LearnerConfig, ModelConfig, refuse_torch_options
from dptrain.learners.build import model_defaults
from dptrain.models import kind_of
from dptrain.options import (
    bad_value,
    check_at_least,
    check_unset_or_at_least,
    defines_run,
    pick,
    resumable,
)
from dptrain.train.faults import FailAt
from dptrain.train.init_from import InitOptions
from dptrain.user_code import file_sha256


UNSET_AS_ZERO = ("max_steps", "val_every", "val_batches", "lr_decay_steps", "peak_flops",
                 "checkpoint_every", "patience")
"""`FitOptions` that may be unset: None. Before None, dptrain wrote unset as 0 (in flags, TOML
files, options.json and run records), and users still may: 0 given is read as None
(`FitOptions.__post_init__`, and `zero_as_unset` for a saved run record)."""


def zero_as_unset(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` (options by name) with 0 for an option of `UNSET_AS_ZERO` read as None."""
    return {name: None if name in UNSET_AS_ZERO and value == 0 else value
            for name, value in values.items()}


@dataclass(frozen=True, kw_only=True)
class FitOptions:
    """How long to train, on which global batch, and where and how often to checkpoint."""

    epochs: int = field(default=10, metadata=resumable())
    """Epochs to train (not used with max-steps)."""
    max_steps: int | None = field(default=None, metadata=resumable(metavar="STEPS"))
    """End the run at this global (optimizer) step, mid-epoch if so (unset or 0: after epochs
    epochs); the schedule is then counted in steps: warmup, lr-step-size and milestones in
    steps, the decay over lr-decay-steps."""
    val_every: int | None = field(default=None, metadata=resumable(metavar="STEPS"))
    """Validate every this many global steps and at the run's end, instead of at epoch ends
    (unset or 0); best/ and early stopping (patience counted in validation points) follow
    these points, each writes a checkpoint and a row of steps.csv; the test part is evaluated
    at the end."""
    val_batches: int | None = None
    """Validate on this many global batches (batch-size samples each) of the validation part,
    a seeded choice, the same at every validation point and on every world size (unset or 0:
    all of it)."""
    lr_decay_steps: int | None = None
    """Torch models with max-steps: the step at which cosine, linear or wsd reaches min-lr and
    stays (unset or 0: max-steps)."""
    peak_flops: float | None = field(default=None, metadata=resumable(metavar="FLOP/S"))
    """Peak FLOP/s of one device for the model FLOPs utilisation (mfu) of a model that declares
    its FLOPs per token (unset or 0: CUDA: the device's from a table; CPU: what a matrix
    multiply reaches here, measured at the start)."""
    batch_size: int = 32
    """Global batch of one step, split evenly over the processes (each takes its local
    share)."""
    seed: int = 0
    """Seed of the data order, the initialisation and every RNG."""
    out: str = field(default="", metadata=resumable(metavar="DIR"))
    """Run directory; empty: runs/<model>-<dataset>-<time>, or -<job id> under a launcher that
    names the job (torchrun's run id, Slurm's or OpenMPI's job id)."""
    checkpoint_every: int | None = field(default=None, metadata=resumable())
    """Also checkpoint every this many steps (unset or 0: at epoch ends only)."""
    keep_last: int = field(default=3, metadata=resumable())
    """Checkpoints kept (the best one is kept besides)."""
    resume: Literal["auto", "never"] = field(default="auto", metadata=resumable(choices=True))
    """auto: continue from the newest valid checkpoint in the run directory; never: refuse a
    directory that holds checkpoints."""
    patience: int | None = field(default=None, metadata=resumable())
    """Stop after this many epochs without a better monitored metric (unset or 0: never)."""
    monitor: str = ""
    """Metric for early stopping and the best checkpoint, a val_* one (validation chooses,
    test reports; --val-size); empty: val_error (classification) or val_rmse (regression;
    val_series_nrmse on several time series, each series weighed alike).
    A *log_likelihood* metric is maximised, others minimised."""
    fail_at: str = field(default="", metadata=resumable(metavar="RANK:STEP,..."))
    """Fault injection: RANK:STEP (that rank SIGKILLs itself before that step) or RANK:ckpt:STEP
    (while writing that step's checkpoint); comma-separated, one point per attempt of the job."""
    progress: bool = field(default=True, metadata=resumable(negative="no-progress"))
    """Show a progress bar on rank 0."""

    def __post_init__(self) -> None:
        for name, value in zero_as_unset({n: getattr(self, n) for n in UNSET_AS_ZERO}).items():
            object.__setattr__(self, name, value)  # one form of unset: None
        check_at_least(self, ("epochs", "batch_size", "keep_last"), 1)
        check_unset_or_at_least(self, ("max_steps", "val_every", "val_batches",
                                       "lr_decay_steps", "checkpoint_every", "patience"), 1)
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise bad_value(self, "peak_flops", "FLOP/s > 0, or 0 to leave it unset (measured "
                                                "or from a table)")
        if self.resume not in ("auto", "never"):
            raise bad_value(self, "resume", "auto or never")
        if self.fail_at:
            FailAt.parse(self.fail_at)


@dataclass(frozen=True)
class Sections:
    """A job's options, one component's config each: what each component is handed."""

    model: ModelConfig
    """The network and its sizes (`dptrain.learners.build.create_model`)."""
    data: DataConfig
    """The dataset and its split (`dptrain.data.config.load_split`)."""
    learner: LearnerConfig
    """The learner: optimizer and schedule, or TAGI's σ_v (`create_learner`)."""
    fit: FitOptions
    """How long and on which batch, checkpoints and validation (the Trainer's `TrainConfig`,
    field for field, and the schedule's `RunLength`)."""
    launch: LaunchConfig
    """Processes, nodes and rendezvous (`dptrain train`'s launcher)."""
    init: InitOptions
    """Starting from another run's weights (`dptrain.train.init_from`)."""


SECTIONS = {"model": ModelConfig, "data": DataConfig, "learner": LearnerConfig,
            "fit": FitOptions, "launch": LaunchConfig, "init": InitOptions}
"""Each section's component, by section name (`Sections`' fields)."""

COMPONENTS = tuple(SECTIONS.values())
"""The parts of `TrainOptions`, in the order they validate."""


@dataclass(frozen=True, kw_only=True)
class TrainOptions(InitOptions, LaunchConfig, FitOptions, LearnerConfig, DataConfig,
                   ModelConfig):
    """Everything `dptrain train` can be told: every component's fields, each validated by its
    own component. Flag `--batch-size` is field `batch_size`, TOML key `batch_size` or
    `batch-size`."""

    def __post_init__(self) -> None:
        for component in COMPONENTS:
            component.__post_init__(self)
        if kind_of(self.model) == "tagi":
            refuse_torch_options(self.part(LearnerConfig), self.model)
        if self.nodes.elastic and not self.out:
            raise ConfigError(f"nnodes {self.nnodes} (elastic) needs out DIR, the same on every "
                              f"node and on a filesystem they share: a node that joins resumes "
                              f"from the run's checkpoints there")
        check_steps(self)
        if self.resume == "never" and self.max_restarts:
            raise ConfigError("max-restarts restarts the job from its checkpoints, which "
                              "--resume never forbids: use one or the other")

    def part(self, component: type) -> Any:
        """This job's config of one component (`ModelConfig`, `DataConfig`, ...)."""
        return pick(component, self)

    def sections(self) -> Sections:
        """This job's config of each component, the section each is handed."""
        return Sections(**{name: self.part(component) for name, component in SECTIONS.items()})

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> TrainOptions:
        return cls(**json.loads(text))


RESUMABLE_OPTIONS = frozenset(f.name for f in fields(TrainOptions) if not defines_run(f))
"""Options that may change when a run resumes; every other option defines the run."""

RUN_DEFAULTS = {f.name: f.default for f in fields(TrainOptions)
                if defines_run(f) and f.default is not dataclasses.MISSING}
"""The default of each option that defines the run: a checkpoint written before an option
existed matches a resume that leaves it at its default (train/resume.py)."""


BEFORE_OPTION = {"val_size": NO_VALIDATION, "hrc_link": "probit", "window_scaling": "off"}
"""For an option whose default changed what a run computes when it came: the value that means
what dptrain did before it existed. A checkpoint whose record lacks the option was written
then; the run resumes with this value (`as_saved`), and the record comparison takes it for
the missing entry (train/resume.py). Runs from before validation parts: no validation part,
the test metric monitored; from before TAGI's link choice: pytagi's probit link; from before
window scaling: each window in its series' standard units."""


BEFORE_MODEL_DEFAULT = {"tagi-lstm": {"heteroscedastic": False, "time_features": "",
                                      "lookback": 24}}
"""For a built-in model whose own default of an option changed what its runs compute: the
value its runs had before. A run whose record holds it (or lacks the option), resumed with
the option left at the model's default, goes on with it (`as_saved`): a tagi-lstm run from
before its learned noise, calendar features and two-day lookback keeps the fixed σ_v, no
covariates and a day's lookback."""


def run_default(options: TrainOptions, name: str) -> Any:
    """The default of option `name` for the model and dataset of `options`: the model's own
    (`model_defaults`), else the option's."""
    return model_defaults(options.model, options.dataset).get(name, RUN_DEFAULTS[name])


def as_saved(options: TrainOptions, saved: dict[str, Any] | None) -> TrainOptions:
    """`options` resuming the run whose checkpoint holds the record `saved`: each option of
    `BEFORE_OPTION` (and of the model's `BEFORE_MODEL_DEFAULT`) that `saved` predates or holds
    at its old value, and that `options` leave at its default, takes its old value, so the run
    goes on as it began. A value given otherwise stays, and the record comparison refuses it,
    naming it."""
    if saved is None:
        return options
    before = {**BEFORE_OPTION, **BEFORE_MODEL_DEFAULT.get(options.model, {})}
    # A saved value equal to the old one: the run was resumed as such before, and goes on so.
    changes = {name: old for name, old in before.items()
               if saved.get(name, old) == old
               and getattr(options, name) == run_default(options, name)}
    return dataclasses.replace(options, **changes) if changes else options


def run_record(options: TrainOptions) -> dict[str, Any]:
    """The options that define the run, stored in every checkpoint and compared when the run
    resumes; a model or dataset file counts by its content (`model_sha256`,
    `dataset_sha256`), wherever it lies."""
    record = {f.name: getattr(options, f.name) for f in fields(options) if defines_run(f)}
    for option, key in (("model", "model_sha256"), ("dataset", "dataset_sha256")):
        digest = file_sha256(getattr(options, option))
        if digest is not None:
            record[key] = digest
    return record


def check_steps(options: TrainOptions) -> None:
    """A run counted in steps, one line per inconsistency: its warmup (in steps) must end before
    the run does; lr-decay-steps needs max-steps and a torch model."""
    decay_steps, max_steps = options.lr_decay_steps, options.max_steps
    if decay_steps is not None and max_steps is None:
        raise ConfigError(f"lr-decay-steps {options.lr_decay_steps} counts the decay in steps of "
                          f"a run counted in steps: give max-steps too")
    if decay_steps is not None and kind_of(options.model) == "tagi":
        raise ConfigError(f"lr-decay-steps is for torch models; {options.model} is a TAGI model "
                          f"(it has no learning rate)")
    if max_steps is not None and options.warmup and max_steps <= options.warmup:
        raise ConfigError(f"max-steps {options.max_steps} is not longer than warmup "
                          f"{options.warmup:g} steps: the run would end before its warmup; train "
                          f"longer or warm up less")
    if decay_steps is not None and options.warmup and decay_steps <= options.warmup:
        raise ConfigError(f"lr-decay-steps {options.lr_decay_steps} is not longer than warmup "
                          f"{options.warmup:g} steps: the decay would end before it starts")


def check_batch_split(batch_size: int, world_size: int, source: str) -> None:
    """The global batch splits evenly over the job's real world size (`source` says whose)."""
    if batch_size % world_size:
        works = ", ".join(map(str, world_sizes_dividing(batch_size)))
        raise ConfigError(f"batch-size {batch_size} must be divisible by the world size "
                          f"{world_size} ({source}): every process takes an equal share; world "
                          f"sizes that work: {works}")
