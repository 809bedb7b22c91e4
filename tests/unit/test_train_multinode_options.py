"""`dptrain train` across nodes: its rendezvous options, checked before anything starts."""

from __future__ import annotations

import pytest

from dptrain.cli.main import build_parser
from dptrain.cli.train import job_world_sizes, options_from_args
from dptrain.runtime import resolve_env
from dptrain.runtime.launch import NodeRange, etcd_members
from dptrain.errors import ConfigError
from dptrain.launcher.etcd_rendezvous import ETCD_HANDLER
from dptrain.launcher.rendezvous import rendezvous_argv, rendezvous_conf, rendezvous_host
from dptrain.train.options import check_batch_split


def _options(*argv):
    return options_from_args(build_parser().parse_args(["train", *argv]))


def test_train_takes_the_same_rendezvous_options_as_run():
    options = _options("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "head:29400",
                       "--rdzv-id", "job7")
    assert (options.nnodes, options.node_rank, options.rdzv_endpoint, options.rdzv_id) == \
        ("2", 1, "head:29400", "job7")
    assert _options().nnodes == "1" and _options().node_rank == -1
    elastic = _options("--nnodes", "1:2", "--rdzv-endpoint", "head:29400", "--out", "r")
    assert (elastic.nodes.min_nodes, elastic.nodes.max_nodes, elastic.nodes.elastic) == \
        (1, 2, True)
    assert _options("--nnodes", "2:2", "--rdzv-endpoint", "h:1").nnodes == "2"  # fixed


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2"], "nnodes 2 needs rdzv-endpoint HOST:PORT"),
    (["--nnodes", "0"], "nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got '0'"),
    (["--nnodes", "2:1"], "nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got '2:1'"),
    (["--nnodes", "0:2"], "got '0:2'"),
    (["--nnodes", "1:2:3"], "got '1:2:3'"),
    (["--nnodes", "two"], "got 'two'"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "node-rank: expected"),
    (["--nnodes", "1:2", "--node-rank", "0", "--rdzv-endpoint", "h:1", "--out", "r"],
     "node-rank 0: a static rendezvous needs a fixed nnodes N, got 1:2"),
    (["--nnodes", "1:2", "--out", "r"], "nnodes 1:2 needs rdzv-endpoint HOST:PORT"),
    (["--nnodes", "1:2", "--rdzv-endpoint", "h:1"], "nnodes 1:2 \\(elastic\\) needs out DIR"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-conf", "last_call=5"],
     "rdzv-conf: expected KEY=VALUE items with KEY one of join_timeout"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-conf", "last_call_timeout=0.5"],
     "rdzv-conf: last_call_timeout must be a whole number"),
])
def test_bad_rendezvous_options_are_one_line(argv, message):
    with pytest.raises(ConfigError, match=message):
        _options(*argv)


def test_rendezvous_argv_static_dynamic_standalone():
    one, two = NodeRange(1, 1), NodeRange(2, 2)
    assert rendezvous_argv(one, None, None, "x") == ["--standalone"]
    assert rendezvous_argv(two, 0, "[fd00::1]:29400", "x") == [
        "--nnodes=2", "--rdzv-backend=static", "--node-rank=0", "--master-addr=fd00::1",
        "--master-port=29400"]
    assert "--rdzv-backend=c10d" in rendezvous_argv(two, None, "head:29400", "x")
    with pytest.raises(ConfigError, match="port must be a number"):
        rendezvous_argv(two, None, "head:http", "x")
    assert rendezvous_argv(NodeRange(1, 3), None, "head:29400", "job7") == [
        "--nnodes=1:3", "--rdzv-backend=c10d", "--rdzv-endpoint=head:29400", "--rdzv-id=job7"]
    with pytest.raises(ConfigError, match="static rendezvous needs a fixed --nnodes N"):
        rendezvous_argv(NodeRange(1, 3), 0, "head:29400", "x")


def test_the_rendezvous_waits_as_long_as_timeout_unless_told_otherwise():
    """--timeout bounds the start-up rendezvous: torch's join and store timeouts (whole
    seconds); a dynamic rendezvous drops a node silent for 5 s and waits 2 s for more nodes
    (c10d; etcd keeps torch's heartbeats); --rdzv-conf wins."""
    quick = {"keep_alive_interval": "1", "keep_alive_max_attempt": "5",
             "last_call_timeout": "2"}
    assert rendezvous_conf("", 2.5) == {**quick, "join_timeout": "3", "read_timeout": "3"}
    assert rendezvous_conf("last_call_timeout=5, join_timeout=60", 300) == {
        **quick, "join_timeout": "60", "read_timeout": "300", "last_call_timeout": "5"}
    assert rendezvous_conf("") == quick
    assert rendezvous_conf("keep_alive_interval=3", dynamic=False) == {
        "keep_alive_interval": "3"}
    assert rendezvous_conf("", 30, "etcd") == {"last_call_timeout": "2", "join_timeout": "30",
                                               "read_timeout": "30"}


def test_every_world_size_of_an_elastic_job_must_split_the_batch():
    """The global batch stays the same whatever the number of nodes: a range with a world
    size it does not divide is refused before anything starts, naming the sizes that work."""
    single = resolve_env({})
    options = _options("--nnodes", "1:3", "--nproc", "2", "--rdzv-endpoint", "h:1", "--out",
                       "r", "--batch-size", "32")
    assert [size for size, _ in job_world_sizes(options, single)] == [2, 4, 6]
    with pytest.raises(ConfigError, match=r"world size 6 \(3 node\(s\) of --nnodes 1:3 x "
                                          r"--nproc 2\).*world sizes that work: 1, 2, 4, 8"):
        for size, source in job_world_sizes(options, single):
            check_batch_split(options.batch_size, size, source)


def test_etcd_takes_the_cluster_members_and_a_job_id_of_its_own():
    """--rdzv-backend etcd: the endpoint lists the members (2379 when a port is left out), the
    nodes are numbered by the rendezvous, on one node too, under the job's own id."""
    options = _options("--rdzv-backend", "etcd", "--rdzv-endpoint", "h1:2379, h2, [fd00::3]:32379",
                       "--rdzv-id", "job7")
    assert etcd_members(options.rdzv_endpoint) == [("h1", 2379), ("h2", 2379),
                                                   ("[fd00::3]", 32379)]
    assert rendezvous_argv(NodeRange(1, 1), None, options.rdzv_endpoint, "job7", "etcd") == [
        "--nnodes=1", f"--rdzv-backend={ETCD_HANDLER}",
        "--rdzv-endpoint=h1:2379,h2:2379,[fd00::3]:32379", "--rdzv-id=job7"]
    assert rendezvous_host(options.rdzv_endpoint) == "h1"  # the interface: towards the first
    assert rendezvous_host("[fd00::3]:32379,h2") == "fd00::3"
    with pytest.raises(ConfigError, match="give the job an --rdzv-id of its own"):
        rendezvous_argv(NodeRange(2, 2), None, "h1:2379", "dptrain", "etcd")
    with pytest.raises(ConfigError, match="the etcd rendezvous numbers the nodes itself"):
        rendezvous_argv(NodeRange(2, 2), 0, "h1:2379", "job7", "etcd")


@pytest.mark.parametrize("argv, message", [
    (["--rdzv-backend", "etcd"], "rdzv-backend etcd needs rdzv-endpoint: the etcd cluster's"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h1:2379,h2:x"], "got 'h2:x'"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "fd00::1"], "an IPv6 address in brackets"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "--nnodes", "2", "--node-rank", "1"],
     "node-rank 1: the etcd rendezvous numbers the nodes itself"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "--rdzv-conf", "protocol=ftp"],
     "protocol must be http or https"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "--rdzv-conf", "cacert=/no/ca.pem"],
     "cacert: no such file '/no/ca.pem'"),
    (["--rdzv-endpoint", "h:1", "--nnodes", "2", "--rdzv-conf", "protocol=https"],
     "KEY one of join_timeout"),  # TLS is etcd's
])
def test_bad_etcd_options_are_one_line(argv, message):
    with pytest.raises(ConfigError, match=message):
        _options(*argv)


def test_etcd_tls_settings_take_torch_names_whichever_spelling(tmp_path):
    """torch's etcd-v2 names (ca_cert, ssl_cert, ssl_cert_key) or the legacy backend's and
    etcdctl's (cacert, cert, key): what a torchrun user already writes in --rdzv-conf."""
    for name in ("ca.pem", "me.pem", "me.key"):
        (tmp_path / name).write_text("")
    ca, cert, key = (str(tmp_path / n) for n in ("ca.pem", "me.pem", "me.key"))
    legacy = rendezvous_conf(f"protocol=HTTPS,cacert={ca},cert={cert},key={key}", 30, "etcd")
    torch_names = rendezvous_conf(f"protocol=https,ca_cert={ca},ssl_cert={cert},"
                                  f"ssl_cert_key={key}", 30, "etcd")
    assert legacy == torch_names == {"last_call_timeout": "2", "join_timeout": "30",
                                     "read_timeout": "30",
                                     "protocol": "https", "ca_cert": ca, "ssl_cert": cert,
                                     "ssl_cert_key": key}
