"""The options of `dptrain train`: one dataclass filled from defaults, a TOML file, then flags.

Kept apart from the command so that tests (and the worker processes, which read the resolved
options as JSON) use it without argparse or processes.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError
from dptrain.learners.models import MODELS as _REGISTRY
from dptrain.learners.models import TAGI_MODELS, TORCH_MODELS
from dptrain.learners import user_model
from dptrain.learners.user_model import is_model_file
from dptrain.train.faults import FailAt

MODELS = tuple(_REGISTRY)
PRECISIONS = ("32", "64", "bf16", "fp16")
AUGMENT = ("auto", "on", "off")

RESUMABLE_OPTIONS = frozenset({
    "epochs", "patience", "checkpoint_every", "keep_last", "timeout", "max_restarts",
    "progress", "fail_at", "out", "resume",
    # How the processes are launched, not what they compute: epoch-end checkpoints resume on
    # any world size, and the Trainer itself refuses a mid-epoch one saved on another.
    "nproc", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "threads",
})
"""Options that may change when a run resumes. Every other option defines the run (new options
too, unless added here): a checkpoint written with other values is refused."""

@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """Everything `dptrain train` can be told. Flag `--batch-size` is field `batch_size`, etc."""

    model: str = "tagi-mlp"
    """A built-in model of dptrain.learners.models (tagi-mlp, tagi-cnn, tagi-resnet18,
    torch-mlp, torch-cnn, torch-resnet18) or PATH.py:FUNCTION, the user's own."""
    dataset: str = "digits"
    """A dataset spelling of dptrain.data.load_dataset (digits, toy1d, mnist:DIR, ...)."""
    nproc: int = 2
    """Processes on this machine (one per device)."""
    epochs: int = 10
    batch_size: int = 32
    """Global batch per step, split evenly over the processes."""
    seed: int = 0
    precision: str = "32"
    """TAGI: 32 or 64 (float64); torch: 32, bf16, fp16 (CUDA)."""
    hidden: int = 128
    """Width of the hidden layers of the built-in MLPs."""
    width: int = 64
    """Channels of the first ResNet stage (64: the usual ResNet18; small for quick tests)."""
    sigma_v: float = 0.05
    """TAGI observation noise σ_v (normalised units) of the first epoch."""
    sigma_v_min: float = 0.0
    """σ_v schedule: σ_v at epoch e (from 0) is max(sigma_v_min, sigma_v · sigma_v_decay^e)."""
    sigma_v_decay: float = 1.0
    gain: float = 0.0
    """TAGI: gain of the initial weight (and bias) standard deviations; 0: the model's default
    (1, or 0.083 for tagi-resnet18)."""
    gain_bias: float = 0.0
    """TAGI: gain of the biases if different from gain; 0: as gain."""
    augment: str = "auto"
    """Random crop (4-pixel black padding) and horizontal flip of training images: on, off, or
    auto (on for cifar10)."""
    average: bool = False
    """TAGI data-parallel mode: False sums the deltas (large-batch update), True averages."""
    heteroscedastic: bool = False
    """TAGI regression: learn the observation noise per input (EvenExp head); σ_v unused."""
    lr: float = 3e-3
    """Learning rate of the torch recipes' optimizer (Adam)."""
    dropout: float = 0.0
    """torch-mlp: dropout probability after each hidden layer (0: none)."""
    strategy: str = "ddp"
    """Torch models: ddp (replicated) or fsdp (FSDP2 fully_shard, sharded checkpoints)."""
    accumulation_steps: int = 1
    """Torch models: micro-batches per optimizer step (one all-reduce per step)."""
    out: str = ""
    """Run directory; empty: runs/<model>-<dataset>-<time>, or -<job id> under a launcher that
    names the job (torchrun's run id, Slurm's or OpenMPI's job id)."""
    checkpoint_every: int = 0
    """Also checkpoint every this many steps (0: only at epoch ends)."""
    keep_last: int = 3
    resume: str = "auto"
    patience: int = 0
    """Early stopping after this many epochs without improvement (0: off)."""
    monitor: str = ""
    """Metric for early stopping and the best checkpoint; empty: test_error or test_rmse."""
    max_restarts: int = 0
    """torchrun restarts after a failure; each restart resumes from the last checkpoint."""
    fail_at: str = ""
    """Fault injection: RANK:STEP (that rank SIGKILLs itself before that step) or RANK:ckpt:STEP
    (while writing that step's checkpoint); comma-separated, one point per attempt of the job."""
    progress: bool = True
    timeout: float = 300.0
    """Seconds a collective (or the start-up rendezvous) waits for a missing rank before every
    rank fails with an error naming the operation."""
    nnodes: int = 1
    """Nodes of the job: start `dptrain train` on each with the same options and rdzv_endpoint."""
    node_rank: int = -1
    """This node's rank, 0 .. nnodes-1 (static rendezvous); -1: torch assigns it (dynamic)."""
    rdzv_endpoint: str = ""
    """HOST:PORT every node reaches (node 0's, for a static rendezvous); needed when nnodes > 1."""
    rdzv_id: str = "dptrain"
    """Job id of a dynamic rendezvous, the same on every node."""
    threads: int = 0
    """Intra-op threads per process; 0: OMP_NUM_THREADS if set, else each process's share of the
    cores it may use (docs/design.md, Threads per rank)."""

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ConfigError:
            return ConfigError(f"{name.replace('_', '-')}: expected {allowed}, "
                               f"got {getattr(self, name)!r}")

        if self.model not in MODELS and not is_model_file(self.model):
            raise bad("model", f"one of {', '.join(MODELS)}, or PATH.py:FUNCTION")
        if self.precision not in PRECISIONS:
            raise bad("precision", f"one of {', '.join(PRECISIONS)}")
        if self.model in TAGI_MODELS and self.precision not in ("32", "64"):
            raise ConfigError(f"precision {self.precision} is for torch models; TAGI takes 32 "
                              f"or 64")
        if self.heteroscedastic and self.model in TORCH_MODELS:
            raise ConfigError(f"heteroscedastic is for TAGI models; {self.model} is a torch "
                              f"model")
        if self.model in TORCH_MODELS and self.precision == "64":
            raise ConfigError("precision 64 is for TAGI models; torch models take 32, bf16, fp16")
        if self.strategy not in ("ddp", "fsdp"):
            raise bad("strategy", "ddp or fsdp")
        for name in ("nproc", "epochs", "batch_size", "hidden", "width", "keep_last",
                     "accumulation_steps"):
            if getattr(self, name) < 1:
                raise bad(name, "an integer >= 1")
        if self.nnodes < 1:
            raise bad("nnodes", "an integer >= 1")
        if not -1 <= self.node_rank < self.nnodes:
            raise bad("node_rank", f"a node rank in [0, {self.nnodes}) (or -1: dynamic)")
        if self.nnodes > 1 and ":" not in self.rdzv_endpoint:
            raise ConfigError(f"nnodes {self.nnodes} needs rdzv-endpoint HOST:PORT, the same on "
                              f"every node, got {self.rdzv_endpoint!r}")
        for name in ("checkpoint_every", "patience", "max_restarts", "threads"):
            if getattr(self, name) < 0:
                raise bad(name, "an integer >= 0")
        if self.timeout <= 0:
            raise bad("timeout", "a number of seconds > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise bad("dropout", "a probability in [0, 1)")
        if self.dropout and self.model != "torch-mlp":
            raise ConfigError(f"dropout is for the torch-mlp model, not {self.model}")
        if self.sigma_v <= 0 or self.lr <= 0:
            raise ConfigError(f"sigma-v and lr must be > 0, got {self.sigma_v} and {self.lr}")
        if self.sigma_v_min < 0 or not 0 < self.sigma_v_decay <= 1:
            raise ConfigError(f"sigma-v-min must be >= 0 and sigma-v-decay in (0, 1], got "
                              f"{self.sigma_v_min} and {self.sigma_v_decay}")
        if self.gain < 0 or self.gain_bias < 0:
            raise ConfigError(f"gain and gain-bias must be > 0 (or 0 for the model's default), "
                              f"got {self.gain} and {self.gain_bias}")
        if self.augment not in AUGMENT:
            raise bad("augment", "on, off or auto")
        if self.resume not in ("auto", "never"):
            raise bad("resume", "auto or never")
        if self.resume == "never" and self.max_restarts:
            raise ConfigError("max-restarts restarts the job from its checkpoints, which "
                              "--resume never forbids: use one or the other")
        if self.fail_at:
            FailAt.parse(self.fail_at)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> TrainOptions:
        return cls(**json.loads(text))

def check_batch_split(batch_size: int, world_size: int, source: str) -> None:
    """The global batch splits evenly over the job's real world size (`source` says whose)."""
    if batch_size % world_size:
        raise ConfigError(f"batch-size {batch_size} must be divisible by the world size "
                          f"{world_size} ({source}): every process takes an equal share")


def model_file_sha256(model: str) -> str | None:
    """sha256 of the file of a `PATH.py:FUNCTION` model spelling; None for a built-in name.

    A user's model file defines the run by its content, wherever it lies.
    """
    if not user_model.is_model_file(model):
        return None
    return user_model.model_file_sha256(model.rpartition(":")[0])


def run_record(options: TrainOptions) -> dict[str, Any]:
    """The options that define the run (all but RESUMABLE_OPTIONS), stored in every checkpoint
    and compared when the run resumes."""
    record = {k: v for k, v in asdict(options).items() if k not in RESUMABLE_OPTIONS}
    digest = model_file_sha256(options.model)
    if digest is not None:
        record["model_sha256"] = digest
    return record


def accepted_keys() -> list[str]:
    return [f.name for f in fields(TrainOptions)]

def _coerce(name: str, value: Any) -> Any:
    """Check a TOML value's type against the field's default (TOML has real types)."""
    default = getattr(TrainOptions(), name)
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value, ok = str(value), True  # precision = 32 written as a number
    if not ok:
        raise ConfigError(f"key {name!r}: expected a {type(default).__name__}, got {value!r}")
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
    raw = raw.get("train", raw)  # keys may sit at the top level or under [train]
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
    spec = _REGISTRY.get(merged.get("model", TrainOptions.model))
    if spec is not None:
        merged = {**spec.defaults, **merged}
    return TrainOptions(**merged)


def model_kind(model: str) -> str | None:
    """"tagi" or "torch" for a built-in model; None for a model file (known once built)."""
    spec = _REGISTRY.get(model)
    return None if spec is None else spec.kind
