"""Which address a node's peer server listens on and peers reach it at, and whether another
machine can reach an address at all: the one job of this module (no sockets are served here).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

from statereg import env
from statereg.errors import StorageError

PEER_HOST_ENV = env.PEER_HOST
GLOO_IFNAME_ENV = env.GLOO_SOCKET_IFNAME


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` (Linux), as gloo binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name[:15].encode()))
        except OSError as exc:
            raise StorageError(
                f"memory tier: ${GLOO_IFNAME_ENV} names interface {name!r}, which has no IPv4 "
                f"address on this host ({exc}); name the interface the nodes reach each "
                f"other on (`ip -br addr` lists them), or set ${PEER_HOST_ENV} to this "
                "node's address") from exc
    return socket.inet_ntoa(packed[20:24])


def _route_to(host: str) -> str | None:
    """This host's address on the route to `host` (no packet is sent), None if unknown."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
        with socket.socket(infos[0][0], socket.SOCK_DGRAM) as probe:
            probe.connect(infos[0][4])
            return str(probe.getsockname()[0])
    except (OSError, IndexError):
        return None


def peer_address() -> tuple[str, str]:
    """The address this node's peer server listens on and peers reach it at, and where it
    came from: $STATEREG_PEER_HOST; else the address of the interface gloo uses
    ($GLOO_SOCKET_IFNAME, its first name); else this host's address on the route to
    $MASTER_ADDR (the address the job's rendezvous reaches it by); else the host name's."""
    given = env.peer_host()
    if given:
        return given, f"${PEER_HOST_ENV}"
    interface = env.gloo_interface()
    if interface:
        return interface_address(interface), f"${GLOO_IFNAME_ENV} {interface}"
    master = env.master_addr()
    routed = _route_to(master) if master else None
    if routed:
        return routed, f"the route to $MASTER_ADDR {master}"
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name), f"the host name {name!r}"
    except OSError:
        return "127.0.0.1", f"the host name {name!r}, which does not resolve"


def peer_host() -> str:
    """The address alone (peer_address)."""
    return peer_address()[0]


def unusable_across_machines(address: str) -> str | None:
    """Why another machine cannot reach `address` (a loopback, unspecified or multicast
    address), or None."""
    try:
        ip = ipaddress.ip_address(socket.getaddrinfo(address, 0)[0][4][0])
    except (OSError, ValueError, IndexError):
        return "an address that does not resolve"
    if ip.is_loopback:
        return "a loopback address, which reaches only the machine it is on"
    if ip.is_unspecified:
        return "the unspecified address"
    if ip.is_multicast:
        return "a multicast address"
    return None


def network_namespace() -> str | None:
    """What two processes share exactly when one's loopback is the other's: this kernel's
    boot and this process's network namespace (Linux); None where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            booted = boot.read().strip()
        return f"{booted}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return None
