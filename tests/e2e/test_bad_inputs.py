"""Bad inputs through the CLI, one table: each row's exit status, the one line that names the
problem, and a checkpoint directory from an earlier run left exactly as it was.

Every row starts from a copy of the same finished run (two epochs, checkpoints every 20 steps),
so "no earlier checkpoint was touched" means something for every row. Rows run in this process
(`dptrain.cli.main.main`) unless they need real worker processes; those go through the
launcher and must report the worker's error once, with its rank.
"""

from __future__ import annotations

import gzip
import hashlib
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from dptrain.cli.main import main
from tests._cli import base_env, dptrain_cmd, run
from tests._images import write_digits_folder
from tests.unit.data.test_data_readers import (
    make_mnist,
    write_cifar_binary,
    write_cifar_pickle,
    write_idx,
)

pytestmark = pytest.mark.e2e

# The run every row starts from; a row's own flags come after these and win.
RUN = ["--nproc", "1", "--epochs", "2", "--hidden", "16", "--checkpoint-every", "20",
       "--keep-last", "10", "--no-progress"]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_JOB_ID")


@dataclass
class Case:
    """`args(tmp, out)` -> the flags after `train` (a `run` row gives the whole command)."""

    args: Callable[[Path, Path], list[str]]
    status: int
    line: str
    """Text of the stderr line that names the problem ({out} and {tmp} are filled in)."""
    env: dict[str, str] = field(default_factory=dict)
    processes: bool = False
    """Run through a real launcher (subprocess) instead of in this process."""
    fresh: bool = False
    """Start in an empty run directory (the finished run is of another model)."""
    replaced: tuple[str, ...] = ()
    """Checkpoints the run may rewrite (a broken one it fell back from, and best/)."""


# ------------------------------------------------------------------------------ bad files


def _mnist(tmp: Path, damage: Callable[[Path], None]) -> str:
    make_mnist(tmp / "mnist")
    damage(tmp / "mnist")
    return f"mnist:{tmp / 'mnist'}"


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _set_label(directory: Path, label: int) -> None:
    path = directory / "t10k-labels-idx1-ubyte"
    data = bytearray(path.read_bytes())
    data[8 + 2] = label  # the third test label, after the 8-byte header
    path.write_bytes(bytes(data))


def _gzip_damaged(directory: Path) -> None:
    path = directory / "train-images-idx3-ubyte"
    blob = gzip.compress(path.read_bytes())
    path.unlink()
    (directory / "train-images-idx3-ubyte.gz").write_bytes(blob[: len(blob) // 2])


def _cifar_binary(tmp: Path) -> str:
    write_cifar_binary(tmp / "cifar" / "cifar-10-batches-bin")
    _truncate(tmp / "cifar" / "cifar-10-batches-bin" / "data_batch_2.bin", 3000)
    return f"cifar10:{tmp / 'cifar'}"


def _cifar_pickle(tmp: Path) -> str:
    write_cifar_pickle(tmp / "cifar" / "cifar-10-batches-py")
    _truncate(tmp / "cifar" / "cifar-10-batches-py" / "data_batch_3", 200)
    return f"cifar10:{tmp / 'cifar'}"


def _folder(tmp: Path, damage: Callable[[Path], object]) -> str:
    root = write_digits_folder(tmp / "images", per_class=3)
    damage(root)
    return f"imagefolder:{root}"


def _first(root: Path, part: str, label: int) -> Path:
    return sorted((root / part / f"digit{label}").glob("*.png"))[0]


def _text(tmp: Path, content: bytes) -> str:
    (tmp / "input.txt").write_bytes(content)
    return f"text:{tmp / 'input.txt'}"


def _tokens(tmp: Path, train: bytes, val: bytes) -> str:
    (tmp / "tokens").mkdir()
    (tmp / "tokens" / "train.bin").write_bytes(train)
    (tmp / "tokens" / "val.bin").write_bytes(val)
    (tmp / "tokens" / "meta.json").write_text('{"vocab_size": 10, "dtype": "uint16"}')
    return f"tokens:{tmp / 'tokens'}"


_IDS = (np.arange(200) % 10).astype("<u2")


def _csv(tmp: Path, text: str) -> str:
    (tmp / "table.csv").write_text(text)
    return f"csv:{tmp / 'table.csv'}"


def _series(tmp: Path, values: list[str]) -> str:
    """A one-series CSV (time, value) with these cells."""
    (tmp / "sales.csv").write_text("day,sales\n" + "".join(f"{t},{v}\n"
                                                           for t, v in enumerate(values)))
    return f"series:{tmp / 'sales.csv'}"


def _npz(tmp: Path, **arrays: np.ndarray) -> str:
    np.savez(tmp / "table.npz", **arrays)
    return f"npz:{tmp / 'table.npz'}"


def _rows(n: int, *, nan_at: tuple[int, int] | None = None) -> str:
    values = np.arange(n * 3, dtype=float).reshape(n, 3) / 7
    lines = ["a,b,y"] + [",".join(f"{v:.4f}" for v in row) for row in values]
    if nan_at is not None:
        cells = lines[nan_at[0]].split(",")
        cells[nan_at[1]] = "nan"
        lines[nan_at[0]] = ",".join(cells)
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ checkpoints


def _empty_folder(tmp: Path) -> Path:
    for part in ("train", "val"):
        (tmp / "empty" / part).mkdir(parents=True)
    return tmp / "empty"


def _newest(out: Path) -> Path:
    return sorted((out / "checkpoints").glob("step-*"))[-1]


def _drop_epoch_end(out: Path) -> Path:
    """Leave step-00000080 (mid-epoch 2) as the newest checkpoint; return it."""
    shutil.rmtree(out / "checkpoints" / "step-00000082")
    return _newest(out)


def _no_valid_checkpoint(out: Path, damage: Callable[[Path], None]) -> None:
    for path in (out / "checkpoints").iterdir():
        damage(path)


CASES = {
    # Dataset files (DataError, 3): corrupt, truncated, inconsistent.
    "idx-truncated": Case(lambda t, o: ["--dataset", _mnist(t, lambda d: _truncate(
        d / "train-images-idx3-ubyte", 1000))], 3, "{tmp}/mnist/train-images-idx3-ubyte: "
        "truncated: the header says shape (12, 28, 28), i.e. 9424 bytes, but the (decompressed) "
        "file has 1000"),
    "idx-wrong-magic": Case(lambda t, o: ["--dataset", _mnist(t, lambda d: (
        d / "t10k-images-idx3-ubyte").write_bytes(b"\x12\x34" + (
            d / "t10k-images-idx3-ubyte").read_bytes()[2:]))], 3,
        "t10k-images-idx3-ubyte: wrong magic number"),
    "idx-gzip-truncated": Case(lambda t, o: ["--dataset", _mnist(t, _gzip_damaged)], 3,
                               "train-images-idx3-ubyte.gz: corrupt or truncated gzip file"),
    "idx-label-out-of-range": Case(lambda t, o: ["--dataset", _mnist(
        t, lambda d: _set_label(d, 12))], 3, "labels must be in [0, 10), got 12 at index 2"),
    "idx-label-count": Case(lambda t, o: ["--dataset", _mnist(t, lambda d: write_idx(
        d / "t10k-labels-idx1-ubyte", np.arange(4)))], 3,
        "t10k-labels-idx1-ubyte: 4 labels but {tmp}/mnist/t10k-images-idx3-ubyte holds"),
    "cifar-binary-truncated": Case(lambda t, o: ["--dataset", _cifar_binary(t)], 3,
                                   "data_batch_2.bin: size 3000 bytes is not a positive "
                                   "multiple of"),
    "cifar-pickle-truncated": Case(lambda t, o: ["--dataset", _cifar_pickle(t)], 3,
                                   "data_batch_3: not a readable CIFAR-10 python batch"),
    "csv-ragged": Case(lambda t, o: ["--dataset", _csv(t, "a,b,y\n1,2,3\n4,5\n")], 3,
                       "table.csv: line 3 has 2 columns, expected 3"),
    "csv-not-a-number": Case(lambda t, o: ["--dataset", _csv(t, "a,b,y\n1,2,3\n4,x,6\n")], 3,
                             "table.csv: line 3, column 2: not a number: 'x'"),
    "csv-nan-feature": Case(lambda t, o: ["--dataset", _csv(t, _rows(30, nan_at=(5, 1)))], 3,
                            "table.csv: line 6, column 2: nan"),
    "series-lookback-too-long": Case(lambda t, o: ["--dataset", _series(
        t, [str(v % 7) for v in range(50)]), "--lookback", "60"], 3,
        "sales.csv: lookback 60 + horizon 1 need 61 time steps, but the training part has 35"),
    "series-not-a-number": Case(lambda t, o: ["--dataset", _series(t, ["1", "2", "many"])], 3,
                                "sales.csv: line 4, column 'sales': not a number: 'many'"),
    "series-empty": Case(lambda t, o: ["--dataset", _series(t, ["4"] + [""] * 49),
                                       "--lookback", "5"], 3,
                         "sales.csv: no series has 2 observed values in its training part"),
    "series-covariate-not-a-column": Case(lambda t, o: ["--dataset", _series(
        t, [str(v % 7) for v in range(50)]), "--covariates", "price"], 3,
        "sales.csv: covariate column 'price' is not in the file; its columns: sales"),
    "series-calendar-feature-too-fine": Case(lambda t, o: ["--dataset", "sine",
                                                           "--time-features", "hour"], 2,
        "sine: --time-features hour: the time column is spaced 1 day, too coarse for the hour"),
    "series-forecast-every-too-large": Case(lambda t, o: ["--dataset", "sine",
                                                          "--forecast-every", "233"], 2,
        "sine: --forecast-every 233 is larger than the test part (232 time steps)"),
    "series-forecast-every-negative": Case(lambda t, o: ["--dataset", "sine",
                                                         "--forecast-every", "-1"], 2,
        "forecast-every: expected an integer >= 0, got -1"),
    "series-horizon-zero": Case(lambda t, o: ["--dataset", "sine", "--horizon", "0"], 2,
                                "horizon: expected an integer >= 1, got 0"),
    "csv-empty": Case(lambda t, o: ["--dataset", _csv(t, "")], 3, "table.csv: empty CSV file"),
    "text-whitespace": Case(lambda t, o: ["--dataset", _text(t, b" \n\t\n")], 3,
                            "input.txt: the text is only whitespace"),
    "text-not-utf8": Case(lambda t, o: ["--dataset", _text(t, b"to be or n\xf6t to be\n" * 9)],
                          3, "input.txt: not UTF-8 text: byte 10 (0xf6) invalid start byte"),
    "text-block-longer-than-validation": Case(lambda t, o: [
        "--dataset", _text(t, b"to be or not to be\n" * 20), "--block-size", "64"], 3,
        "input.txt: the validation part: --block-size 64 needs at least 65 tokens (a window "
        "and its last target), but the part has 38"),
    "tokens-size-not-whole-ids": Case(lambda t, o: [
        "--dataset", _tokens(t, _IDS.tobytes() + b"\0", _IDS.tobytes())], 3,
        "train.bin: 401 bytes is not a whole number of uint16 ids (2 bytes each)"),
    "tokens-id-past-vocabulary": Case(lambda t, o: [
        "--dataset", _tokens(t, _IDS.tobytes(), np.where(np.arange(200) == 123, 10, _IDS)
                             .astype("<u2").tobytes())], 3,
        "val.bin: id 10 at position 123 is not below the vocabulary size 10"),
    "npz-wrong-shape": Case(lambda t, o: ["--dataset", _npz(
        t, x=np.zeros((10, 2, 2)), y=np.zeros(10))], 3, "table.npz: x must be (N, F)"),
    "npz-not-a-zip": Case(lambda t, o: ["--dataset", str(_write(t / "t.npz", b"hello"))], 3,
                          "t.npz: not an NPZ file (no zip signature at byte 0)"),
    "image-corrupt": Case(lambda t, o: ["--dataset", _folder(t, lambda r: _truncate(
        _first(r, "train", 5), 60))], 3, "{tmp}/images/train/digit5/0"),
    "image-not-an-image": Case(lambda t, o: ["--dataset", _folder(t, lambda r: (
        r / "train" / "digit1" / "readme.txt").write_text("x"))], 3,
        "{tmp}/images/train/digit1/readme.txt: not an image file"),
    "image-empty-class": Case(lambda t, o: ["--dataset", _folder(t, lambda r: [
        p.unlink() for p in (r / "val" / "digit8").iterdir()])], 3,
        "{tmp}/images/val/digit8: empty class folder"),
    "image-classes-differ": Case(lambda t, o: ["--dataset", _folder(t, lambda r: shutil.rmtree(
        r / "val" / "digit0"))], 3, "the classes of train/ and val/ differ"),
    "image-unreadable": Case(lambda t, o: ["--dataset", _folder(t, lambda r: _first(
        r, "train", 2).write_bytes(b"\x89PNG not really"))], 3, "not a readable image"),
    "image-empty-folder": Case(lambda t, o: ["--dataset", f"imagefolder:{_empty_folder(t)}"],
                               3, "train: no class folders"),
    # Options (ConfigError or argparse, 2).
    "unknown-dataset": Case(lambda t, o: ["--dataset", "imagenet"], 2,
                            "unknown dataset 'imagenet'; accepted:"),
    "model-dataset-mismatch": Case(lambda t, o: ["--model", "tagi-cnn", "--dataset", "toy1d"],
                                   2, "dataset toy1d: model tagi-cnn takes images"),
    "batch-not-divisible": Case(lambda t, o: ["--nproc", "2", "--batch-size", "33"], 2,
                                "batch-size 33 must be divisible by the world size 2 "
                                "(--nproc 2): every process takes an equal share; world sizes "
                                "that work: 1, 3, 11, 33"),
    "epochs-zero": Case(lambda t, o: ["--epochs", "0"], 2,
                        "epochs: expected an integer >= 1, got 0"),
    "epochs-not-int": Case(lambda t, o: ["--epochs", "two"], 2,
                           "argument --epochs: invalid int value: 'two'"),
    "precision-for-torch": Case(lambda t, o: ["--precision", "bf16"], 2,
                                "precision bf16 is for torch models; TAGI takes 32 or 64"),
    "fail-at-garbage": Case(lambda t, o: ["--fail-at", "1-25"], 2,
                            "fail-at must be RANK:STEP or RANK:ckpt:STEP"),
    "config-unknown-key": Case(lambda t, o: ["--config", str(_write(
        t / "c.toml", b"epochs = 1\nwdith = 3\n"))], 2, "c.toml: unknown key 'wdith'"),
    "learning-rate-diverges": Case(lambda t, o: ["--model", "torch-mlp", "--lr", "1e30"], 6,
                                  "dptrain train: error: train step 1: the loss is not finite on "
                                  "rank(s) 0 (here: nan); no rank updated the parameters",
                                  fresh=True),
    # The launcher's environment.
    "rank-not-below-world-size": Case(lambda t, o: [], 2,
                                      "env: rank must be in [0, 2), got 2",
                                      env={"RANK": "2", "WORLD_SIZE": "2",
                                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}),
    "rank-without-world-size": Case(lambda t, o: [], 2,
                                    "torchrun/env environment is partial: RANK is set but "
                                    "WORLD_SIZE is not", env={"RANK": "0"}),
    "bad-option-under-a-launcher": Case(lambda t, o: ["--epochs", "0"], 2,
                                        "dptrain train: error: rank 1: epochs: expected an "
                                        "integer >= 1, got 0",
                                        env={"RANK": "1", "WORLD_SIZE": "2",
                                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}),
    "rendezvous-port-taken": Case(lambda t, o: ["--timeout", "5"], 5,
                                  "rank 0: could not start the gloo process group of 2 ranks "
                                  "at 127.0.0.1:{busy}",
                                  env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": "{busy}"}),
    # Checkpoints (CheckpointError, 4).
    # Another world size resumes even mid-epoch (test_resume_world_size.py), but the global
    # batch is the run's and must split evenly over the new one (ConfigError, 2).
    "world-size-not-dividing-the-batch-on-resume": Case(
        lambda t, o: [*_keep(_drop_epoch_end(o)), "--nproc", "3"], 2,
        "batch-size 32 must be divisible by the world size 3 (--nproc 3): every process takes "
        "an equal share; world sizes that work: 1, 2, 4, 8, 16, 32"),
    # A broken newest checkpoint is not an error: the run says so and resumes from the one
    # before, which it leaves as it was.
    "checkpoint-corrupt": Case(lambda t, o: _keep(_truncate(
        o / "checkpoints" / "step-00000082" / "state.pt", 500)), 0,
        "skipping checkpoint: {out}/checkpoints/step-00000082/state.pt: checksum mismatch",
        replaced=("step-00000082", "best")),
    "checkpoint-partial": Case(lambda t, o: _keep((
        o / "checkpoints" / "step-00000082" / "meta.json").unlink()), 0,
        "skipping checkpoint: {out}/checkpoints/step-00000082: incomplete checkpoint "
        "(no meta.json)", replaced=("step-00000082", "best")),
}
# Rows that a run directory belongs to one run.
RESUME_CASES = {
    "option-changed-on-resume": Case(lambda t, o: ["--hidden", "64"], 4,
                                     "was started with different options: hidden 16 -> 64"),
    "resume-never-with-checkpoints": Case(lambda t, o: ["--resume", "never"], 4,
                                          "holds checkpoints (newest: {out}/checkpoints/"
                                          "step-00000082)"),
}


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _keep(_: object) -> list[str]:
    """For a row whose set-up changes the run directory and adds no flags."""
    return []


def _fingerprint(directory: Path, replaced: tuple[str, ...] = ()) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*"))
            if p.is_file() and not str(p.relative_to(directory)).startswith(replaced)}


@pytest.fixture(scope="module")
def busy_port():
    """A port something listens on, for the row with an occupied rendezvous port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *RUN, "--out", str(out)]) == 0
    assert (out / "checkpoints" / "step-00000082").is_dir()
    return out


def _in_process(argv: list[str], env: dict[str, str], monkeypatch, capsys) -> tuple[int, str]:
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    try:
        status = main(argv)
    except SystemExit as done:  # argparse
        status = done.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize("name", [
    *CASES, *RESUME_CASES])
def test_bad_input_is_one_line_and_touches_no_checkpoint(name, finished_run, busy_port,
                                                         tmp_path, monkeypatch, capsys):
    case = {**CASES, **RESUME_CASES}[name]
    out = tmp_path / "run"
    if case.fresh:
        (out / "checkpoints").mkdir(parents=True)
    else:
        shutil.copytree(finished_run, out)
    data = tmp_path / "data"
    data.mkdir()
    flags = case.args(data, out)
    before = _fingerprint(out / "checkpoints", case.replaced)
    argv = ["train", *RUN, "--out", str(out), *flags]
    env = {k: v.format(busy=busy_port) for k, v in case.env.items()}
    if case.processes:
        result = run(dptrain_cmd(*argv), env=base_env(**env), timeout_s=180)
        status, stderr = result.returncode, result.stderr
    else:
        status, stderr = _in_process(argv, env, monkeypatch, capsys)
    expected = case.line.format(out=out, tmp=data, rank="{rank}", busy=busy_port)
    if "{rank}" in expected:
        head, tail = expected.split("{rank}")
        named = [line for line in stderr.splitlines() if line.startswith(head)
                 and tail in line]
    else:
        named = [line for line in stderr.splitlines() if expected in line]
    assert status == case.status, stderr
    assert len(named) == 1, f"expected one line with {expected!r}:\n{stderr}"
    assert "Traceback" not in stderr, stderr
    assert _fingerprint(out / "checkpoints", case.replaced) == before, "a checkpoint was touched"
