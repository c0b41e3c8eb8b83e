"""Which network interface a rank's gloo (and NCCL's bootstrap) traffic uses: the one that
holds the address this rank reaches the leader from, picked by address, never by a name
guessed in advance (``lo`` on one machine, ``eth0`` or ``ens5`` elsewhere)."""

from __future__ import annotations

import fcntl
import socket
import struct

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def local_address_towards(host: str, port: int = 9) -> str:
    """The local IPv4 address the kernel routes to ``host`` from (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), port))
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the interface holding IPv4 ``address`` (None when none does, or off Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def data_interface(master_addr: str) -> str | None:
    """The interface this rank should use for gloo to reach ``master_addr``."""
    try:
        return interface_of(local_address_towards(master_addr))
    except OSError:
        return None
