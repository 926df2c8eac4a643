"""Which address this process tells others to reach it at, and which network device it uses.
A fleet on one host can advertise anything; across hosts each process must advertise its own
routable address, never 127.0.0.1 or a wildcard. :func:`advertise_host`: ``advertise_host`` if
set, else the bind address unless it is a wildcard, else the host name; it goes into liveness
records and the NIXL agent's ref (``AgentRef.host``). :func:`ucx_env`: the UCX variables a NIXL
agent is created under (``nixl_net_devices``, else the device holding a routable advertised
IPv4 address; empty when nothing is pinned).

Design: docs/deploy/hosts.md.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

from shared.settings import Settings

_WILDCARDS = ("", "0.0.0.0", "::")
_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def advertise_host(settings: Settings, bind: str | None = None) -> str:
    """``bind``: the address this process listens on (default ``metrics_host``; the gateway
    passes ``gateway_host``)."""
    if settings.advertise_host:
        return settings.advertise_host
    bind = settings.metrics_host if bind is None else bind
    return socket.gethostname() if bind in _WILDCARDS else bind


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def device_of(address: str) -> str | None:
    """The network interface that holds IPv4 ``address`` in this network namespace, if any."""
    try:
        wanted = ipaddress.IPv4Address(address)
    except ValueError:
        return None  # a host name or IPv6: let UCX choose
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if ipaddress.IPv4Address(raw[20:24]) == wanted:
                return name
    return None


def ucx_env(settings: Settings, bind: str | None = None) -> dict[str, str]:
    """UCX variables for this process's NIXL agent: ``nixl_net_devices`` if set, else the device
    that holds the advertised address when that is a routable IPv4 address (so UCX's worker
    address, carried in the agent metadata, names that interface and not loopback). A loopback or
    unresolvable advertised host pins nothing: one host, UCX's own choice (shared memory)."""
    devices = settings.nixl_net_devices
    if not devices:
        host = advertise_host(settings, bind)
        try:
            routable = not ipaddress.ip_address(host).is_loopback
        except ValueError:  # a host name
            routable = False
        devices = (device_of(host) or "") if routable else ""
    return {"UCX_NET_DEVICES": devices} if devices else {}
