"""Two hosts on one machine: network namespaces joined by a veth pair (needs root and `ip`).

Each namespace has its loopback and one end of the pair, with its own address on a /24; there is
no default route, so nothing a test sends can leave the pair. Names are unique per test run, and
`two_hosts` deletes both namespaces (after killing whatever still runs in them) even when the
test fails.

The host-name trap of real clusters is built in: `ip netns exec` mounts /etc/netns/<ns>/hosts over
/etc/hosts, and there this machine's own host name resolves to 127.0.0.1, so gloo's default
guess (the address its host name resolves to) is the loopback, which the other host cannot reach.
The hosts are also reachable by name (`Host.name`) from both namespaces.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class TwoHosts:
    a: Host
    b: Host

    @property
    def hosts(self) -> tuple[Host, Host]:
        return self.a, self.b


def write_rsh_agent(pair: TwoHosts, path: Path) -> Path:
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


def create(tag: str | None = None) -> TwoHosts:
    """Two namespaces joined by a veth pair; undo with `destroy` (also after a partial create)."""
    tag = tag or uuid.uuid4().hex[:6]
    subnet = f"10.213.{int(tag[:2], 16) % 250 + 1}"
    a = Host(f"dpt-{tag}-a", f"node-a-{tag}", f"{subnet}.1", f"dpt{tag}a")
    b = Host(f"dpt-{tag}-b", f"node-b-{tag}", f"{subnet}.2", f"dpt{tag}b")
    pair = TwoHosts(a, b)
    try:
        for host in pair.hosts:
            _check(_ip("netns", "add", host.ns))
            etc = NETNS_ETC / host.ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(_hosts_file(pair.hosts))
        _check(_ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname))
        for host in pair.hosts:
            _check(_ip("link", "set", host.ifname, "netns", host.ns))
            _check(_ip("-n", host.ns, "addr", "add", f"{host.address}/24", "dev", host.ifname))
            _check(_ip("-n", host.ns, "link", "set", host.ifname, "up"))
            _check(_ip("-n", host.ns, "link", "set", "lo", "up"))
    except BaseException:
        destroy(pair)
        raise
    return pair


def _check(done: subprocess.CompletedProcess) -> None:
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(done.args)} failed: {done.stderr.strip()}")


def destroy(pair: TwoHosts) -> None:
    """Kill what still runs in the namespaces, delete them and their /etc/netns files."""
    for host in pair.hosts:
        pids = _ip("netns", "pids", host.ns).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _ip("netns", "del", host.ns)  # takes its veth end, and so the pair, with it
        shutil.rmtree(NETNS_ETC / host.ns, ignore_errors=True)
    _ip("link", "del", pair.a.ifname)  # only if a failed create left it in this namespace


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
