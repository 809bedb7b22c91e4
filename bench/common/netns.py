"""Two hosts on one machine, made of network namespaces joined by a veth pair (needs root and
`ip`), for distributed/node_loss.py. A copy of the part of the tests' two-host fixture
(tests/_netns.py) that the benchmark uses, so that no bench file depends on tests/.

Each host's namespace has its loopback and one veth end, with its own address on a /24; there is
no default route, so nothing sent can leave the hosts. `ip netns exec` mounts
/etc/netns/<ns>/hosts over /etc/hosts, where this machine's own host name resolves to 127.0.0.1
and each host's name (`Host.name`) to its address. `destroy` deletes every namespace after
killing whatever still runs in it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

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

    def kill_everything(self) -> None:
        """SIGKILL every process in the namespace (no goodbye)."""
        for pid in _ip("netns", "pids", self.ns).stdout.split():
            if pid.isdigit():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


@dataclass(frozen=True)
class TwoHosts:
    a: Host
    b: Host

    @property
    def hosts(self) -> tuple[Host, Host]:
        return self.a, self.b


def _ip(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=20)


def _check(done: subprocess.CompletedProcess) -> None:
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(done.args)} failed: {done.stderr.strip()}")


def unavailable_reason() -> str | None:
    """Why two namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) not found"
    probe = f"dptprobe{uuid.uuid4().hex[:8]}"
    made = _ip("netns", "add", probe)
    _ip("netns", "del", probe)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    return None


def create(tag: str | None = None) -> TwoHosts:
    """Two namespaces joined by a veth pair; undo with `destroy` (also after a partial create)."""
    tag = tag or uuid.uuid4().hex[:6]
    subnet = f"10.213.{int(tag[:2], 16) % 250 + 1}"
    a, b = (Host(f"dpt-{tag}-{x}", f"node-{x}-{tag}", f"{subnet}.{i + 1}", f"dpt{tag}{x}")
            for i, x in enumerate("ab"))
    pair = TwoHosts(a, b)
    hosts_file = "\n".join(["127.0.0.1 localhost", f"127.0.0.1 {socket.gethostname()}",
                            *(f"{h.address} {h.name}" for h in pair.hosts)]) + "\n"
    try:
        for host in pair.hosts:
            _check(_ip("netns", "add", host.ns))
            etc = NETNS_ETC / host.ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
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


def destroy(pair: TwoHosts) -> None:
    """Kill what still runs in the namespaces, delete them and their /etc/netns files."""
    for host in pair.hosts:
        host.kill_everything()
        _ip("netns", "del", host.ns)  # takes its veth end, and so the pair, with it
        shutil.rmtree(NETNS_ETC / host.ns, ignore_errors=True)
        _ip("link", "del", host.ifname)  # only if a failed create left it in this namespace
