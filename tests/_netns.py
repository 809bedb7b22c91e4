"""Hosts on one machine: network namespaces (needs root and `ip`). Two are joined by a veth
pair (`create`, the `two_hosts` fixture); more by a switch, a bridge in a namespace of its own
that each host's veth pair plugs into (`create_hosts`, the `three_hosts` fixture).

Each host's namespace has its loopback and one veth end, with its own address on a /24; there is
no default route, so nothing a test sends can leave the hosts. Names are unique per test run, and
the fixtures delete every namespace (after killing whatever still runs in it) even when the test
fails. A host is lost outright with `kill_everything` and `set_link(up=False)`.

The host-name trap of real clusters is built in: `ip netns exec` mounts /etc/netns/<ns>/hosts over
/etc/hosts, and there this machine's own host name resolves to 127.0.0.1, so gloo's default
guess (the address its host name resolves to) is the loopback, which the other host cannot reach.
The hosts are also reachable by name (`Host.name`) from both namespaces.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

NETNS_ETC = Path("/etc/netns")


@dataclass(frozen=True)
class Host:
    ns: str
    """Network namespace name."""
    name: str
    """Host name that resolves to `address` in both namespaces."""
    address: str
    ifname: str
    """The veth end inside the namespace."""

    def cmd(self, *argv: str) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def pids(self) -> list[int]:
        """Every process running in this host's namespace."""
        found = _ip("netns", "pids", self.ns).stdout.split()
        return [int(pid) for pid in found if pid.isdigit()]

    def kill_everything(self, spare: frozenset[int] = frozenset()) -> None:
        """SIGKILL every process in the namespace (no goodbye), but those `spare` names."""
        for pid in self.pids():
            if pid not in spare:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def connections_to(self, address: str) -> list[str]:
        """This host's established TCP connections whose far end is `address` (ss's lines)."""
        listed = subprocess.run(self.cmd("ss", "-Htn", "state", "established"),
                                capture_output=True, text=True, timeout=20).stdout
        return [line for line in listed.splitlines() if line.split() and
                line.split()[-1].rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:") ==
                address]

    def set_link(self, up: bool) -> None:
        """Plug this host's cable in or pull it out: with it down, packets just stop."""
        _check(_ip("-n", self.ns, "link", "set", self.ifname, "up" if up else "down"))


@dataclass(frozen=True)
class TwoHosts:
    a: Host
    b: Host
    switch = None
    """No switch: the pair's veth ends are plugged into each other."""

    @property
    def hosts(self) -> tuple[Host, Host]:
        return self.a, self.b


@dataclass(frozen=True)
class Hosts:
    """Hosts plugged into one switch: a bridge in the namespace `switch`."""

    hosts: tuple[Host, ...]
    switch: str


def write_rsh_agent(pair: TwoHosts | Hosts, path: Path) -> Path:
    """A stand-in for ssh that OpenMPI's mpirun can use (`--mca plm_rsh_agent PATH`): it gets
    `HOST COMMAND...` and runs COMMAND inside HOST's namespace, through a shell as sshd would."""
    cases = "\n".join(f"  {h.name}) ns={h.ns} ;;" for h in pair.hosts)
    path.write_text(f"""#!/bin/sh
host=$1; shift
case "$host" in
{cases}
  *) echo "rsh agent: unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" /bin/sh -c "$*"
""")
    path.chmod(0o755)
    return path


def _ip(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=20)


def unavailable_reason() -> str | None:
    """Why two namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) not found"
    probe = f"dptprobe{uuid.uuid4().hex[:8]}"
    made = _ip("netns", "add", probe)
    _ip("netns", "del", probe)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    return None


def _hosts_file(hosts: tuple[Host, ...]) -> str:
    lines = ["127.0.0.1 localhost", f"127.0.0.1 {socket.gethostname()}",
             *(f"{h.address} {h.name}" for h in hosts)]
    return "\n".join(lines) + "\n"


def _new_hosts(count: int, tag: str) -> tuple[Host, ...]:
    subnet = f"10.213.{int(tag[:2], 16) % 250 + 1}"
    letters = "abcdefghijklmnopqrstuvwxyz"[:count]
    return tuple(Host(f"dpt-{tag}-{x}", f"node-{x}-{tag}", f"{subnet}.{i + 1}", f"dpt{tag}{x}")
                 for i, x in enumerate(letters))


def _add_namespace(host: Host, hosts: tuple[Host, ...]) -> None:
    _check(_ip("netns", "add", host.ns))
    etc = NETNS_ETC / host.ns
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "hosts").write_text(_hosts_file(hosts))


def _configure(host: Host) -> None:
    """The host's veth end, moved into its namespace: its address, up, and the loopback up."""
    _check(_ip("link", "set", host.ifname, "netns", host.ns))
    _check(_ip("-n", host.ns, "addr", "add", f"{host.address}/24", "dev", host.ifname))
    _check(_ip("-n", host.ns, "link", "set", host.ifname, "up"))
    _check(_ip("-n", host.ns, "link", "set", "lo", "up"))


def create(tag: str | None = None) -> TwoHosts:
    """Two namespaces joined by a veth pair; undo with `destroy` (also after a partial create)."""
    a, b = _new_hosts(2, tag or uuid.uuid4().hex[:6])
    pair = TwoHosts(a, b)
    try:
        for host in pair.hosts:
            _add_namespace(host, pair.hosts)
        _check(_ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname))
        for host in pair.hosts:
            _configure(host)
    except BaseException:
        destroy(pair)
        raise
    return pair


BRIDGE = "br0"
"""The switch's bridge, inside the switch's own namespace."""


def _switch_port(tag: str, host: Host) -> str:
    """The name of the veth end that plugs `host` into the switch (15 characters at most)."""
    return f"dps{tag}{host.ns[-1]}"


def create_hosts(count: int, tag: str | None = None) -> Hosts:
    """`count` namespaces plugged into a switch (a bridge in a namespace of its own, which has
    no address: it only forwards); undo with `destroy` (also after a partial create)."""
    tag = tag or uuid.uuid4().hex[:6]
    made = Hosts(_new_hosts(count, tag), switch=f"dpt-{tag}-sw")
    try:
        _check(_ip("netns", "add", made.switch))
        _check(_ip("-n", made.switch, "link", "add", BRIDGE, "type", "bridge"))
        _check(_ip("-n", made.switch, "link", "set", BRIDGE, "up"))
        for host in made.hosts:
            _add_namespace(host, made.hosts)
            port = _switch_port(tag, host)
            _check(_ip("link", "add", host.ifname, "type", "veth", "peer", "name", port))
            _check(_ip("link", "set", port, "netns", made.switch))
            _check(_ip("-n", made.switch, "link", "set", port, "master", BRIDGE))
            _check(_ip("-n", made.switch, "link", "set", port, "up"))
            _configure(host)
    except BaseException:
        destroy(made)
        raise
    return made


def _check(done: subprocess.CompletedProcess) -> None:
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(done.args)} failed: {done.stderr.strip()}")


def destroy(made: TwoHosts | Hosts) -> None:
    """Kill what still runs in the namespaces, delete them and their /etc/netns files."""
    for host in made.hosts:
        host.kill_everything()
        _ip("netns", "del", host.ns)  # takes its veth end, and so the pair, with it
        shutil.rmtree(NETNS_ETC / host.ns, ignore_errors=True)
        # Only if a failed create left it in this namespace:
        _ip("link", "del", host.ifname)
    if made.switch:
        _ip("netns", "del", made.switch)


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[TwoHosts]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"two-host tests skipped: {reason}")
    pair = create()
    try:
        yield pair
    finally:
        destroy(pair)


@pytest.fixture
def three_hosts() -> Iterator[Hosts]:
    """Three hosts on a switch, for one test: a test that loses a host leaves it changed."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"three-host tests skipped: {reason}")
    made = create_hosts(3)
    try:
        yield made
    finally:
        destroy(made)
