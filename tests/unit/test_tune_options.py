"""`dptrain tune`'s input: the space on the command line and in TOML agree; each bad input is
one line naming what was wrong, before any run starts."""

from __future__ import annotations

import sys

import pytest

from dptrain.cli.main import build_parser, main
from dptrain.cli.tune import options_from_args
from dptrain.errors import ConfigError
from dptrain.tune.space import parse_space

pytest.importorskip("optuna")


def parse(argv):
    return options_from_args(build_parser().parse_args(["tune", *argv]))


def test_cli_and_toml_spaces_agree(tmp_path):
    config = tmp_path / "search.toml"
    config.write_text('model = "tagi-mlp"\nepochs = 3\n[space]\nlr = "log:1e-4:1e-1"\n'
                      'batch_size = "choice:32,64,128"\nsigma_v = "float:0.01:0.3"\n'
                      '[tune]\nmax-trials = 7\nsampler = "random"\n')
    from_toml, base_toml = parse(["--config", str(config), "--out", "s"])
    from_cli, base_cli = parse(["--model", "tagi-mlp", "--epochs", "3", "--out", "s",
                                "--space", "lr=log:1e-4:1e-1", "--space",
                                "batch_size=choice:32,64,128", "--space",
                                "sigma_v=float:0.01:0.3", "--max-trials", "7",
                                "--sampler", "random"])
    assert parse_space(from_toml.space) == parse_space(from_cli.space)
    assert from_toml == from_cli and base_toml == base_cli == {"model": "tagi-mlp", "epochs": 3}
    assert parse_space(from_cli.space)["batch_size"].choices == (32, 64, 128)


@pytest.mark.parametrize("argv, says", [
    (["--space", "nonsense=float:0:1"], "'nonsense' is not an option of dptrain train"),
    (["--space", "lr=float:0.1:0.1"], "an empty or inverted range"),
    (["--space", "lr=float:0.3:0.1"], "an empty or inverted range"),
    (["--space", "lr=log:0:0.1"], "a log range must lie above 0"),
    (["--space", "batch_size=float:1:4"], "integer option"),
    (["--space", "lr=choice:"], "an empty choice"),
    (["--space", "lr=log:1e-3:1e-1", "--monitor", "test_error"], "a test metric cannot choose"),
    (["--space", "lr=log:1e-3:1e-1", "--storage", "sqlite:///s.db"], "SQLite breaks"),
    (["--space", "lr=float:0.1:0.2", "--sampler", "grid", "--max-trials", "0"],
     "grid takes choice"),
    ([], "no search space"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, says):
    code = main(["tune", "--out", str(tmp_path / "s"), "--nproc", "1", *argv])
    err = capsys.readouterr().err
    assert code == 2 and says in err and err.count("\n") == 1, err


def test_unknown_monitor_and_unreachable_storage_and_other_study(tmp_path, capsys):
    out = str(tmp_path / "s")
    common = ["tune", "--out", out, "--dataset", "toy1d", "--nproc", "1",
              "--space", "sigma_v=float:0.1:0.3"]
    assert main([*common, "--monitor", "val_nonsense"]) == 2
    assert "is not a metric of this run" in capsys.readouterr().err
    assert main([*common, "--monitor", "train_rmse", "--storage",
                 "postgresql://nobody@127.0.0.1:1/none"]) == 2
    err = capsys.readouterr().err
    assert "cannot be used" in err and err.count("\n") == 1
    # a study directory holding another study's options
    from dptrain.tune.study import claim_directory
    from dptrain.tune.options import TuneOptions

    claim_directory(TuneOptions(out=out, space=("lr=log:1e-3:1e-1",)), {"dataset": "digits"})
    with pytest.raises(ConfigError, match="holds another study"):
        claim_directory(TuneOptions(out=out, space=("lr=log:1e-3:1e-1",)), {"dataset": "toy1d"})


def test_without_optuna_one_line_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "optuna", None)
    assert main(["tune", "--space", "lr=log:1e-3:1e-1", "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'dptrain[tune]'" in err and err.count("\n") == 1


def test_every_start_of_a_trial_meets_in_a_rendezvous_of_its_own():
    """The runs of a study's trials, and a trial taken over from a dead worker, must not meet
    in one rendezvous on a shared etcd cluster (--rdzv-backend etcd): each start of a run takes
    an id of its own, and the base options with etcd pass without one."""
    from pathlib import Path

    from dptrain.tune.runner import trial_rdzv_id
    from dptrain.tune.search import check_base

    first, again = (trial_rdzv_id(Path("runs/study/trial-0003")) for _ in range(2))
    assert first.startswith("tune-study-trial-0003-") and first != again
    options, base = parse(["--out", "s", "--space", "lr=log:1e-4:1e-1", "--rdzv-backend",
                           "etcd", "--rdzv-endpoint", "h1:2379,h2:2379"])
    assert base["rdzv_backend"] == "etcd" and "rdzv_id" not in base
    train, _ = check_base(options, base, preflight=False)  # the runs' options resolve
    assert (train.rdzv_backend, train.rdzv_endpoint) == ("etcd", "h1:2379,h2:2379")
