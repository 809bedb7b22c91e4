"""`dptrain train` options: defaults < TOML < flags, and clear errors listing what is accepted."""

from __future__ import annotations

import re

import pytest

from dptrain.cli.main import build_parser
from dptrain.cli.train import options_from_args
from dptrain.errors import ConfigError


def _options(*argv):
    return options_from_args(build_parser().parse_args(["train", *argv]))


def test_defaults_are_the_main_job():
    o = _options()
    assert (o.model, o.dataset, o.nproc, o.epochs, o.batch_size) == ("tagi-mlp", "digits", 2,
                                                                      10, 32)
    assert o.out == ""  # decided by with_run_dir, which knows the launcher


def test_the_run_directory_is_named_after_model_dataset_and_job_or_time():
    from dptrain.cli.train import with_run_dir
    from dptrain.runtime import resolve_env

    single = resolve_env({})
    o = with_run_dir(_options(), single)
    assert re.fullmatch(r"runs/tagi-mlp-digits-\d{8}-\d{6}", o.out), o.out
    assert with_run_dir(_options("--out", "mine"), single).out == "mine"
    named = with_run_dir(_options("--dataset", "csv:/data/my wine.csv"), single).out
    assert named.startswith("runs/tagi-mlp-csv-my-wine-"), named
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1",
                "TORCHELASTIC_RUN_ID": "job42"}
    assert with_run_dir(_options(), resolve_env(torchrun), torchrun).out == \
        "runs/tagi-mlp-digits-job42"
    # torchrun's default run id "none" names no job: rank 0 decides once the group runs.
    static = {**torchrun, "TORCHELASTIC_RUN_ID": "none"}
    assert with_run_dir(_options(), resolve_env(static), static).out == ""
    # Several nodes started here: no node's own clock, the agents agree on one label.
    assert with_run_dir(_options("--nnodes", "2", "--rdzv-endpoint", "h:1"), single).out == ""


def test_a_job_label_agreed_by_the_agents_names_the_run_directory(tmp_path, monkeypatch):
    """What every worker of a multi-node `dptrain train` without --out does with the label its
    agents agreed on (DPTRAIN_RUN_LABEL): the same directory on every node."""
    from dptrain.runtime.job import RUN_LABEL_ENV
    from dptrain.train.job import run_training
    from dptrain.train.options import TrainOptions

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(RUN_LABEL_ENV, "20260102-030405")
    summary = run_training(TrainOptions(nproc=1, epochs=1, hidden=8, batch_size=256,
                                        progress=False))
    assert summary["run_dir"] == "runs/tagi-mlp-digits-20260102-030405"
    assert (tmp_path / summary["run_dir"] / "summary.json").is_file()


@pytest.mark.parametrize("launcher,environ,expected", [
    ("torchrun", {"TORCHELASTIC_RUN_ID": "abc-1"}, "abc-1"),
    ("torchrun", {"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77"}, "77"),
    ("torchrun", {"TORCHELASTIC_RUN_ID": "none"}, None),
    ("slurm", {"SLURM_JOB_ID": "1234"}, "1234"),
    ("openmpi", {"OMPI_MCA_ess_base_jobid": "2519/1", "SLURM_JOB_ID": "9"}, "2519-1"),
    ("openmpi", {"OMPI_MCA_orte_ess_jobid": "31"}, "31"),
    ("openmpi", {"PMIX_NAMESPACE": "prterun-host-1234@1"}, "prterun-host-1234-1"),
    ("env", {}, None),
])
def test_job_ids_of_the_launchers(launcher, environ, expected):
    from dptrain.runtime.job import job_id

    assert job_id(launcher, environ) == expected


def test_flags_win_over_the_toml_file(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[train]\nepochs = 3\nbatch-size = 64\nsigma_v = 0.1\nprecision = 64\n'
                      'out = "x"\n')
    o = _options("--config", str(config), "--epochs", "5")
    assert (o.epochs, o.batch_size, o.sigma_v, o.precision, o.out) == (5, 64, 0.1, "64", "x")


def test_compile_is_auto_on_or_off_and_takes_the_old_boolean(tmp_path):
    assert _options().compile == "auto"
    assert _options("--compile").compile == "on"
    assert _options("--no-compile").compile == "off"
    for value, want in (("true", "on"), ("false", "off"), ('"auto"', "auto")):
        (tmp_path / "c.toml").write_text(f"compile = {value}\n")
        assert _options("--config", str(tmp_path / "c.toml")).compile == want


@pytest.mark.parametrize("argv,toml,message", [
    ([], "epochz = 3\n", "unknown key 'epochz'; accepted: model, dataset, nproc, epochs"),
    ([], "epochs = 'three'\n", "key 'epochs': expected a int, got 'three'"),
    ([], "epochs = [\n", "not valid TOML"),
    (["--epochs", "0"], None, "epochs: expected an integer >= 1, got 0"),
    (["--precision", "bf16"], None, "precision bf16 is for torch models"),
    (["--model", "torch-mlp", "--precision", "64"], None, "precision 64 is for TAGI models"),
    (["--resume", "never", "--max-restarts", "1"], None, "which --resume never forbids"),
    (["--dropout", "1"], None, "dropout: expected a probability in [0, 1), got 1.0"),
    ([], "compile = 'sometimes'\n", "compile: expected on, off or auto, got 'sometimes'"),
    (["--dropout", "0.1"], None, "dropout is for the torch-mlp and torch-gpt models, not tagi-mlp"),
    (["--fail-at", "x"], None, "fail-at must be RANK:STEP or RANK:ckpt:STEP with non-negative "
                               "integers, comma-separated, got 'x'"),
])
def test_bad_values_say_what_is_accepted(tmp_path, argv, toml, message):
    if toml is not None:
        (tmp_path / "c.toml").write_text(toml)
        argv = [*argv, "--config", str(tmp_path / "c.toml")]
    with pytest.raises(ConfigError) as info:
        _options(*argv)
    assert message in str(info.value)


def test_fail_at_spec_is_validated():
    from dptrain.train import FailAt

    from dptrain.train.faults import FaultPoint

    assert FailAt.parse("1:25") == FailAt((FaultPoint(1, 25),))
    several = FailAt.parse("1:37, 0:ckpt:90,1:90")
    assert several.points == (FaultPoint(1, 37), FaultPoint(0, 90, in_checkpoint=True),
                              FaultPoint(1, 90))
    assert str(several) == "1:37,0:ckpt:90,1:90"
    for bad in ("x", "1", "1:", "-1:3", "a:b", "1:2,", "1:x:3", "1:ckpt:", ""):
        with pytest.raises(ConfigError, match="fail-at must be RANK:STEP or RANK:ckpt:STEP"):
            FailAt.parse(bad)


def test_fail_at_takes_one_point_per_attempt(monkeypatch):
    from dptrain.train import FailAt

    fail_at = FailAt.parse("1:5,0:ckpt:8")
    killed = []
    monkeypatch.setattr("dptrain.train.faults._kill", lambda rank, where: killed.append(
        (rank, where)))
    for restart_count, expected in (("0", [(1, "at step 5")]),
                                    ("1", [(0, "while writing the checkpoint of step 8")]),
                                    ("2", [])):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart_count)
        killed.clear()
        for rank in (0, 1):
            for step in range(10):
                fail_at.maybe_kill(rank, step)
                fail_at.maybe_kill_in_checkpoint(rank, step)
        assert killed == expected, restart_count


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.toml"):
        _options("--config", str(tmp_path / "nope.toml"))


def test_the_batch_split_is_checked_against_the_real_world_size():
    """Under a launcher the world size is the launcher's, not --nproc (default 2)."""
    from dptrain.cli.train import job_world_sizes
    from dptrain.train.options import check_batch_split
    from dptrain.runtime import resolve_env

    under_torchrun = resolve_env({"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "h",
                                  "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "j"})
    o = _options("--batch-size", "33")  # not divisible by --nproc 2, but by the 3 processes
    assert job_world_sizes(o, under_torchrun) == [(3, "from torchrun")]
    check_batch_split(o.batch_size, *job_world_sizes(o, under_torchrun)[0])
    o = _options("--batch-size", "32")
    with pytest.raises(ConfigError, match=r"batch-size 32 must be divisible by the world size 3 "
                                          r"\(from torchrun\)"):
        check_batch_split(o.batch_size, *job_world_sizes(o, under_torchrun)[0])
    with pytest.raises(ConfigError, match=r"batch-size 33 must be divisible by the world size 2 "
                                          r"\(--nproc 2\)"):
        check_batch_split(33, *job_world_sizes(o, resolve_env({}))[0])
