"""HTTP(S) media fetching: one shared session, timeouts, a byte cap enforced while streaming,
and an address guard applied to the address actually connected.

The guard works at the resolver: :class:`GuardedResolver` resolves the name, refuses the
request if any address is loopback / private / link-local / multicast / reserved (unless the
host is allowlisted), and hands aiohttp exactly the checked addresses, so a DNS answer that
changes between check and connect (rebinding) cannot slip through. Redirects are followed by
hand, each hop re-checked, at most ``max_redirects``.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from shared.media.sources import MediaError, check_remote_url


def _is_public(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_global and not addr.is_multicast


class GuardedResolver(AbstractResolver):
    def __init__(self, allow_hosts: frozenset[str]) -> None:
        self._inner = ThreadedResolver()
        self._allow = allow_hosts

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        if host not in self._allow:
            for r in results:
                if not _is_public(r["host"]):
                    raise MediaError(
                        f"media URL host {host!r} resolves to a non-public address ({r['host']}); "
                        "such hosts are refused unless allowlisted by the operator (media_allow_hosts)",
                        code="media_url_forbidden",
                    )
        return results

    async def close(self) -> None:
        await self._inner.close()


class MediaFetcher:
    """Fetch URLs with bounded size and time. ``async with`` owns the session."""

    def __init__(self, *, allow_hosts: tuple[str, ...], timeout_ms: int, max_redirects: int = 3) -> None:
        self._allow = frozenset(allow_hosts)
        self._timeout = aiohttp.ClientTimeout(total=timeout_ms / 1000, sock_connect=min(timeout_ms, 5000) / 1000)
        self._max_redirects = max_redirects
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> MediaFetcher:
        connector = aiohttp.TCPConnector(resolver=GuardedResolver(self._allow), limit=64, ttl_dns_cache=None,
                                         use_dns_cache=False)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, url: str, *, max_bytes: int, param: str) -> bytes:
        """The body of ``url``; ``MediaError`` on any refusal, HTTP error, timeout or cap."""
        assert self._session is not None, "use MediaFetcher as an async context manager"
        for _hop in range(self._max_redirects + 1):
            check_remote_url(url, param=param)
            host = urlsplit(url).hostname or ""
            if host not in self._allow and _literal_ip(host) and not _is_public(_literal_ip(host)):
                raise MediaError(f"{param}: URL points at a non-public address {host}", code="media_url_forbidden")
            try:
                async with self._session.get(url, allow_redirects=False) as resp:
                    if resp.status in (301, 302, 303, 307, 308) and "Location" in resp.headers:
                        url = urljoin(url, resp.headers["Location"])
                        continue
                    if resp.status != 200:
                        raise MediaError(f"{param}: fetching the media URL returned HTTP {resp.status}",
                                         code="media_fetch_failed")
                    length = resp.content_length
                    if length is not None and length > max_bytes:
                        raise MediaError(f"{param}: media is {length} bytes, above the {max_bytes} byte limit",
                                         status=413, code="media_too_large")
                    chunks, total = [], 0
                    async for chunk in resp.content.iter_chunked(64 * 1024):
                        total += len(chunk)
                        if total > max_bytes:  # stop reading at cap+1, never buffer the rest
                            raise MediaError(f"{param}: media is larger than the {max_bytes} byte limit",
                                             status=413, code="media_too_large")
                        chunks.append(chunk)
                    return b"".join(chunks)
            except MediaError as exc:
                if param not in str(exc):
                    raise MediaError(f"{param}: {exc}", status=exc.status, code=exc.code) from None
                raise
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise MediaError(f"{param}: could not fetch the media URL ({type(exc).__name__}: {exc})",
                                 code="media_fetch_failed") from None
        raise MediaError(f"{param}: too many redirects (more than {self._max_redirects})", code="media_fetch_failed")


def _literal_ip(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None
