"""Addresses: the interface a service binds, and the one other hosts reach it at.

A service bound to a wildcard (0.0.0.0) is reachable at every address of its host, but the URL it
publishes must name one that other hosts route to: its node's address. Under Ray that is Ray's
view of the node (what `ray start --node-ip-address` says); a service process the launcher starts
inherits it from the actor that hosts it ($ASYNCRL_NODE_IP), so the URL in its url file, the
engine registry and the env registration is the one other nodes use. Stdlib only: the light env
SDK imports it.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from typing import Optional

NODE_IP_ENV = "ASYNCRL_NODE_IP"
"""Set by the actor that starts a service (asyncrl.supervisor) to its node's address."""
WILDCARDS = ("0.0.0.0", "", "::")
GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915


def node_ip() -> str:
    """This host's address as other hosts reach it: $ASYNCRL_NODE_IP, else Ray's node address when Ray is
    up in this process, else the address of the interface that routes outwards, else loopback."""
    if os.environ.get(NODE_IP_ENV):
        return os.environ[NODE_IP_ENV]
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # the light SDK has no Ray
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP: picks the route, sends nothing
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def is_loopback(host: Optional[str]) -> bool:
    """None (every service on its own default, which is loopback) or a loopback address or name."""
    return host is None or host in ("localhost", "::1") or host.startswith("127.")


def advertised_host(bind_host: str) -> str:
    """Where others reach a server bound to `bind_host`: the node's address for a wildcard, else itself."""
    return node_ip() if bind_host in WILDCARDS else bind_host


def http_url(bind_host: str, port: int) -> str:
    host = advertised_host(bind_host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def source_address(remote: str) -> str:
    """This host's address that packets to `remote` leave from (UDP connect: picks the route, sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((remote, 1))
        return s.getsockname()[0]


def interface_of(address: str) -> Optional[str]:
    """The name of the network interface holding IPv4 `address` (Linux), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def use_gloo_interface_towards(master_address: str) -> None:
    """Before joining a gloo group led from `master_address`: bind gloo to the interface that reaches it,
    unless $GLOO_SOCKET_IFNAME says otherwise. Left alone, gloo binds the address its host name resolves
    to, and loopback when the name resolves to none (not in DNS or /etc/hosts), which no other host can
    reach: the weight broadcast across hosts then fails to connect."""
    global _chosen_gloo_interface
    if os.environ.get(GLOO_INTERFACE_ENV, _chosen_gloo_interface) != _chosen_gloo_interface:
        return  # the user's
    try:
        interface = interface_of(source_address(socket.gethostbyname(master_address)))
    except OSError:
        return
    if interface:
        os.environ[GLOO_INTERFACE_ENV] = _chosen_gloo_interface = interface


_chosen_gloo_interface: Optional[str] = None
"""The interface use_gloo_interface_towards last set (a value it did not set is the user's)."""
