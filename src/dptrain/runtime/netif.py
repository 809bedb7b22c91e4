"""Which network interface the process group talks on: the one that reaches the rendezvous host.

Without GLOO_SOCKET_IFNAME, gloo binds to the address this machine's host name resolves to. Where
that is a loopback address (Debian's /etc/hosts, many cluster images) every rank advertises
127.0.x.x to its peers and a multi-node job fails in `connectFullMesh ... remote=[127.0.0.1]`;
NCCL's own guess can land on docker0 or a VPN. The kernel already knows which interface reaches
the rendezvous host, so ask it (a UDP `connect` picks the route and the source address without
sending a packet) and export that interface for both backends, unless the user named one.

Standard library only: interface addresses come from the SIOCGIFADDR ioctl (IPv4) and
/proc/net/if_inet6 (IPv6); the default route from /proc/net/route. Also `wait_for_listener`:
until a rendezvous store answers, without torch's C++ client and its retry traces.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class InterfaceChoice:
    """The interface for the backends' sockets, and why; `name` None leaves them to decide."""

    name: str | None
    reason: str
    address: str = ""
    """This machine's address on `name` towards the rendezvous host ("" when not chosen)."""
    by_user: bool = False


def route_towards(host: str, port: int = 0) -> tuple[str, str]:
    """(the host's address, this machine's source address towards it), as the kernel routes.

    Raises OSError when the host does not resolve or no route reaches it.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)  # UDP: chooses the route and source address, sends nothing
        return sockaddr[0], s.getsockname()[0]


def _ipv4_address(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on this interface
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_addresses(proc: Path = Path("/proc/net/if_inet6")) -> dict[str, str]:
    """address -> interface name, from the kernel's table (absent without IPv6)."""
    out = {}
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) == 6:
            out[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[5]
    return out


def interface_of(address: str) -> str | None:
    """The name of the interface that holds `address` on this machine, or None."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.version == 6:
        return _ipv6_addresses().get(str(ip))
    for _, name in socket.if_nameindex():
        if _ipv4_address(name) == str(ip):
            return name
    return None


def is_this_machine(host: str) -> bool:
    """Whether `host` resolves to an address of this machine (loopback or an interface's)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for *_, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if ip.is_loopback or interface_of(str(ip)) is not None:
            return True
    return False


def default_route_interface(proc: Path = Path("/proc/net/route")) -> str | None:
    """The interface of the IPv4 default route, or None."""
    try:
        lines = proc.read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 7 and fields[1] == "00000000" and fields[7] == "00000000":
            return fields[0]
    return None


def choose_interface(host: str, port: int = 0, *, multi_node: bool,
                     environ: MutableMapping[str, str] | None = None) -> InterfaceChoice:
    """The interface that reaches `host` (the rendezvous host / MASTER_ADDR), with the reason.

    A user's GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME wins. When `host` is this machine's own
    loopback and the job spans several nodes, the loopback cannot be it: the peers reach this
    machine some other way, most likely through the default route's interface.
    """
    environ = os.environ if environ is None else environ
    given = [var for var in IFNAME_VARS if environ.get(var)]
    if given:
        return InterfaceChoice(environ[given[0]], f"{' and '.join(given)} set by the user",
                               by_user=True)
    if not host:
        return InterfaceChoice(None, "no rendezvous address (a single process)")
    try:
        remote, local = route_towards(host, port)
    except OSError as err:
        return InterfaceChoice(None, f"no route to the rendezvous host {host!r} ({err}); left to "
                                     f"the backends")
    if ipaddress.ip_address(local.split("%")[0]).is_loopback:
        if not multi_node:
            name = interface_of(local) or "lo"
            return InterfaceChoice(name, f"the rendezvous host {host} is this machine "
                                         f"({remote}) and every rank runs here", local)
        name = default_route_interface()
        if name is None:
            return InterfaceChoice(None, f"the rendezvous host {host} resolves to this machine's "
                                         f"loopback {remote} in a multi-node job and there is "
                                         f"no default route; set GLOO_SOCKET_IFNAME (and "
                                         f"NCCL_SOCKET_IFNAME) to the cluster network's "
                                         f"interface")
        return InterfaceChoice(name, f"the rendezvous host {host} resolves to this machine's "
                                     f"loopback {remote}, which other nodes cannot reach: using "
                                     f"the default route's interface",
                               _ipv4_address(name) or "")
    name = interface_of(local)
    if name is None:
        return InterfaceChoice(None, f"the route to {host} ({remote}) leaves from {local}, which "
                                     f"no interface lists; left to the backends")
    return InterfaceChoice(name, f"the route to the rendezvous host {host} ({remote}) leaves "
                                 f"from {local} on {name}", local)


def export_interface(host: str, port: int = 0, *, multi_node: bool,
                     environ: MutableMapping[str, str] | None = None) -> InterfaceChoice:
    """Choose as `choose_interface` and set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to it.

    Call before the process group (or the workers that create it) starts: the backends read the
    variables when they open their sockets.
    """
    environ = os.environ if environ is None else environ
    choice = choose_interface(host, port, multi_node=multi_node, environ=environ)
    if choice.name and not choice.by_user:
        for var in IFNAME_VARS:
            environ[var] = choice.name
    return choice


def wait_for_listener(host: str, port: int, timeout_s: float,
                      give_up: Callable[[], bool] = lambda: False) -> bool:
    """Until something accepts a TCP connection at host:port (True), or `give_up()` says to
    stop waiting (False), asked every 0.1 s; `TimeoutError` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(1.0, left))).close()
            return True
        except OSError as err:
            if give_up():
                return False
            if left <= 0:
                raise TimeoutError(f"nothing answered at {host}:{port} ({err})") from err
        time.sleep(min(0.1, max(0.0, left)))
