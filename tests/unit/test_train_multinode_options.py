"""`dptrain train` across nodes: its rendezvous options, checked before anything starts."""

from __future__ import annotations

import pytest

from dptrain.cli.main import build_parser
from dptrain.cli.run import rendezvous_argv
from dptrain.cli.train import options_from_args
from dptrain.errors import ConfigError


def _options(*argv):
    return options_from_args(build_parser().parse_args(["train", *argv]))


def test_train_takes_the_same_rendezvous_options_as_run():
    options = _options("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "head:29400",
                       "--rdzv-id", "job7")
    assert (options.nnodes, options.node_rank, options.rdzv_endpoint, options.rdzv_id) == \
        (2, 1, "head:29400", "job7")
    assert _options().nnodes == 1 and _options().node_rank == -1


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2"], "nnodes 2 needs rdzv-endpoint HOST:PORT"),
    (["--nnodes", "0"], "nnodes: expected an integer >= 1"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "node-rank: expected"),
])
def test_bad_rendezvous_options_are_one_line(argv, message):
    with pytest.raises(ConfigError, match=message):
        _options(*argv)


def test_rendezvous_argv_static_dynamic_standalone():
    assert rendezvous_argv(1, None, None, "x") == ["--standalone"]
    assert rendezvous_argv(2, 0, "[fd00::1]:29400", "x") == [
        "--nnodes=2", "--rdzv-backend=static", "--node-rank=0", "--master-addr=fd00::1",
        "--master-port=29400"]
    assert "--rdzv-backend=c10d" in rendezvous_argv(2, None, "head:29400", "x")
    with pytest.raises(ConfigError, match="port must be a number"):
        rendezvous_argv(2, None, "head:http", "x")
