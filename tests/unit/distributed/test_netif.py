"""The network interface for gloo/NCCL: the one the kernel routes to the rendezvous host through.

On this machine with the loopback, and from inside a real second host (a network namespace with
a veth pair, see tests/_netns.py), where this machine's host name resolves to 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from dptrain.cli.env import network_line
from dptrain.cli.main import build_parser
from dptrain.cli.run import torchrun_argv
from dptrain.launcher.rendezvous import network_options
from dptrain.runtime.env import SINGLE, DistEnv
from dptrain.runtime.netif import (
    IFNAME_VARS,
    choose_interface,
    default_route_interface,
    export_interface,
    interface_of,
    is_this_machine,
)
from tests._cli import REPO
from tests._netns import two_hosts  # noqa: F401 - fixture

NETIF = str(REPO / "src" / "dptrain" / "runtime" / "netif.py")


def test_a_local_rendezvous_host_means_the_loopback():
    for host in ("127.0.0.1", "localhost"):
        choice = choose_interface(host, multi_node=False, environ={})
        assert (choice.name, choice.address) == (interface_of("127.0.0.1"), "127.0.0.1")
        assert "this machine" in choice.reason
    assert interface_of("127.0.0.1") == "lo"


def test_a_loopback_master_in_a_multi_node_job_is_not_the_loopback():
    """The classic trap (`remote=[127.0.0.1]`): on rank 0's node the master's name resolves to
    the loopback, which no other node can reach."""
    choice = choose_interface("127.0.0.1", multi_node=True, environ={})
    assert choice.name == default_route_interface() and choice.name != "lo"
    assert "other nodes cannot reach" in choice.reason or \
        "set GLOO_SOCKET_IFNAME" in choice.reason


def test_the_users_interface_wins_and_export_sets_both_backends():
    environ = {"NCCL_SOCKET_IFNAME": "ib0"}
    choice = export_interface("127.0.0.1", multi_node=False, environ=environ)
    assert choice.by_user and choice.name == "ib0" and "set by the user" in choice.reason
    assert environ == {"NCCL_SOCKET_IFNAME": "ib0"}, "never overrides the user's choice"
    environ = {}
    export_interface("localhost", multi_node=False, environ=environ)
    assert environ == {var: "lo" for var in IFNAME_VARS}


def test_an_unresolvable_host_is_left_to_the_backends():
    choice = choose_interface("no-such-host.invalid", multi_node=True, environ={})
    assert choice.name is None and "no-such-host.invalid" in choice.reason


def test_which_hosts_are_this_machine():
    assert is_this_machine("localhost") and is_this_machine("127.0.0.1")
    own = choose_interface("localhost", multi_node=False, environ={}).address
    assert is_this_machine(own)
    assert not is_this_machine("198.51.100.7")  # documentation range: nobody's
    assert not is_this_machine("no-such-host.invalid")


def test_default_route_is_read_from_the_route_table(tmp_path):
    table = tmp_path / "route"
    table.write_text("Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n"
                     "ens5\t000010AC\t00000000\t0001\t0\t0\t0\t0000FFFF\n"
                     "ens3\t00000000\t010010AC\t0003\t0\t0\t0\t00000000\n")
    assert default_route_interface(table) == "ens3"
    table.write_text(table.read_text().splitlines()[0] + "\n")
    assert default_route_interface(table) is None


def test_dptrain_env_shows_the_choice_and_why():
    env = DistEnv(rank=1, world_size=2, local_rank=0, local_world_size=1, node_rank=1,
                  master_addr="127.0.0.1", master_port=29400, launcher="env")
    line = network_line(env, {})
    assert line.startswith(f"network interface: {default_route_interface() or 'left to'}")
    assert "loopback 127.0.0.1" in line
    assert network_line(env, {"GLOO_SOCKET_IFNAME": "eth7"}) == \
        "network interface: eth7: GLOO_SOCKET_IFNAME set by the user"
    assert "none needed (one process)" in network_line(SINGLE, {})


def test_nproc_per_node_is_an_alias_of_nproc(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    args = build_parser().parse_args(["run", "--nproc-per-node", "3", str(script)])
    assert torchrun_argv(args)[0] == "--nproc-per-node=3"


def test_the_launcher_passes_this_nodes_address_to_the_agent(monkeypatch):
    for var in IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    assert network_options(None, 1) == ([], {})  # one node: the agent's defaults are right
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


# netif is standard library only: load it alone, without dptrain's package (and torch).
_PROBE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("netif", sys.argv.pop(1))
netif = sys.modules["netif"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(netif)
choose_interface = netif.choose_interface
out = {host: vars(choose_interface(host, multi_node=True, environ={})) for host in sys.argv[1:]}
print(json.dumps(out))
"""


def test_inside_a_second_host_the_route_to_the_peer_names_the_veth(two_hosts):  # noqa: F811
    a, b = two_hosts.hosts
    own = socket.gethostname()
    done = subprocess.run(a.cmd(sys.executable, "-c", _PROBE, NETIF, b.address, b.name, a.name,
                                own), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    for peer in (b.address, b.name):
        assert found[peer]["name"] == a.ifname and found[peer]["address"] == a.address, found
    # The rendezvous host is this node itself, by its veth address: still the veth.
    assert found[a.name]["name"] == a.ifname, found
    # Its own host name resolves to the loopback there and no default route exists: say so.
    assert found[own]["name"] is None and "set GLOO_SOCKET_IFNAME" in found[own]["reason"]
