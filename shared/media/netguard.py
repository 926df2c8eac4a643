"""Which network addresses media may be fetched from (the SSRF policy, :func:`refusal_reason`),
and the operator's allowlist of trusted hosts (:class:`AllowList`). Only globally routable
unicast addresses are allowed; the reason of a refusal is named in the error. IPv6 forms that
embed an IPv4 address (IPv4-mapped, NAT64, 6to4) are judged by the embedded IPv4 address.
Allowlist matching is on the host as written in the URL, never on what a name resolves to.

Design: docs/guide/media.md.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SHARED = ipaddress.ip_network("100.64.0.0/10")
_METADATA = ipaddress.ip_address("169.254.169.254")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_ip(text: str) -> IPAddress | None:
    """A canonical IP literal (``[...]`` and an IPv6 zone are stripped), else None.

    Non-canonical IPv4 forms (``2130706433``, ``0177.0.0.1``, ``0x7f.1``, ``127.1``) are not
    IP literals here: callers refuse them separately (see ``sources.check_host``).
    """
    text = text.strip("[]").split("%", 1)[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def refusal_reason(ip: str | IPAddress) -> str | None:
    """Why ``ip`` may not be fetched from (e.g. ``"loopback"``), or None for a public address.
    Refused: unspecified, loopback, link-local (169.254/16 with the cloud metadata address,
    fe80::/10), multicast, reserved, shared (100.64/10), private (10/8, 172.16/12, 192.168/16,
    fc00::/7, ...) and anything else Python's ``ipaddress`` does not call global; IPv4-mapped
    ``::ffff:a.b.c.d``, NAT64 ``64:ff9b::/96`` and 6to4 ``2002::/16`` by their IPv4 address."""
    addr = parse_ip(ip) if isinstance(ip, str) else ip
    if addr is None:
        return "unparseable"
    if isinstance(addr, ipaddress.IPv6Address):
        embedded = addr.ipv4_mapped
        kind = "IPv4-mapped"
        if embedded is None and addr in _NAT64:
            embedded, kind = ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF), "NAT64"
        if embedded is None and addr.sixtofour is not None:
            embedded, kind = addr.sixtofour, "6to4"
        if embedded is not None:
            inner = refusal_reason(embedded)
            return f"{kind} {inner}" if inner else None
    if addr.is_unspecified:
        return "unspecified"
    if addr.is_loopback:
        return "loopback"
    if addr == _METADATA:
        return "link-local (cloud metadata)"
    if addr.is_link_local:
        return "link-local"
    if addr.is_multicast:
        return "multicast"
    if addr.is_reserved:
        return "reserved"
    if isinstance(addr, ipaddress.IPv4Address) and addr in _SHARED:
        return "shared (carrier-grade NAT)"
    if isinstance(addr, ipaddress.IPv6Address) and addr.is_site_local:
        return "site-local"
    if addr.is_private:
        return "private"
    if not addr.is_global:
        return "non-public"
    return None


def a_reason(reason: str) -> str:
    """``"loopback"`` → ``"a loopback"``, ``"unspecified"`` → ``"an unspecified"``."""
    return ("an " if reason[:1].lower() in "aeiou" else "a ") + reason


def _norm_host(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        host = host.strip("[]")
    host = host.rstrip(".")
    ip = parse_ip(host)
    return str(ip) if ip is not None else host


class AllowList:
    """The operator's trusted hosts (``media_allow_hosts``): entries are ``host`` (any port) or
    ``host:port`` (that port only); IPv6 as ``[::1]`` or ``[::1]:8080``. Matching is on the host
    as written in the URL (case-insensitive, a trailing dot ignored; IP literals compared as
    addresses): allowlisting ``media.internal`` does not allowlist ``127.0.0.1``, and allowlisting
    ``127.0.0.1:8123`` allows no other loopback port."""

    def __init__(self, entries: Iterable[str] = ()) -> None:
        self._any_port: set[str] = set()
        self._ports: set[tuple[str, int]] = set()
        for raw in entries:
            entry = raw.strip()
            if not entry:
                continue
            host, port = _split_entry(entry)
            if port is None:
                self._any_port.add(_norm_host(host))
            else:
                self._ports.add((_norm_host(host), port))

    def __bool__(self) -> bool:
        return bool(self._any_port or self._ports)

    def allows(self, host: str, port: int | None) -> bool:
        h = _norm_host(host)
        return h in self._any_port or (port is not None and (h, port) in self._ports)


def _split_entry(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(f"media_allow_hosts: bad entry {entry!r}")
        return host, _port(entry, rest[1:]) if rest else None
    if entry.count(":") == 1:
        host, port = entry.split(":")
        return host, _port(entry, port)
    return entry, None  # a name, an IPv4 address or a bare IPv6 address


def _port(entry: str, text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"media_allow_hosts: bad port in {entry!r}")
    return int(text)
