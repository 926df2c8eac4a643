"""HTTP(S) media fetching (:class:`MediaFetcher`): one shared session, connect / read / total
timeouts, a byte cap enforced while streaming (a compressed body counts as sent and is never
expanded), redirects followed by hand and re-checked at every hop, and an address guard in
three layers, each refusing before any packet leaves for a refused address: the URL check on
every hop (``sources.parse_remote_url``), the resolver (:class:`GuardedResolver`) and the socket
factory, which sees the very address about to be connected.

Design: docs/guide/media.md.
"""

from __future__ import annotations

import asyncio
import contextvars
import socket

import aiohttp
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from shared.media.netguard import AllowList, a_reason, refusal_reason
from shared.media.sources import MediaError, parse_remote_url

_CHUNK = 64 * 1024
_REDIRECTS = (301, 302, 303, 307, 308)
# True while the current hop's host is allowlisted (read by the socket factory, which runs
# in the task that opens the connection or in a task created from it).
_HOP_ALLOWED: contextvars.ContextVar[bool] = contextvars.ContextVar("mmfleet_media_hop_allowed", default=False)


def _refused(host: str, addr: str, reason: str) -> MediaError:
    return MediaError(f"URL host {host} resolves to {addr}, {a_reason(reason)} address; media URLs must point at "
                      "public addresses (the operator can allowlist trusted hosts with media_allow_hosts)",
                      code="media_url_forbidden")


class GuardedResolver(AbstractResolver):
    """Resolve with ``inner`` (default: the system resolver in a thread); refuse non-public
    answers for hosts that are not allowlisted; return exactly the answers checked."""

    def __init__(self, allow: AllowList, inner: AbstractResolver | None = None) -> None:
        self._inner = inner if inner is not None else ThreadedResolver()
        self._allow = allow
        self.lookups = 0  # for tests and debugging

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[ResolveResult]:
        self.lookups += 1
        results = list(await self._inner.resolve(host, port, family))
        if not results:
            raise MediaError(f"URL host {host} did not resolve to any address", code="media_fetch_failed")
        if not self._allow.allows(host, port):
            for r in results:
                reason = refusal_reason(str(r["host"]))
                if reason:
                    raise _refused(host, str(r["host"]), reason)
        return results

    async def close(self) -> None:
        await self._inner.close()


def _guarded_socket(addr_info) -> socket.socket:
    """aiohttp's ``socket_factory``: the last check, on the address about to be connected."""
    family, type_, proto, _, sockaddr = addr_info
    if not _HOP_ALLOWED.get():
        reason = refusal_reason(str(sockaddr[0]))
        if reason:
            raise MediaError(f"refused to connect to {sockaddr[0]}, {a_reason(reason)} address; media URLs must "
                             "point at public addresses", code="media_url_forbidden")
    return socket.socket(family=family, type=type_, proto=proto)


class MediaFetcher:
    """Fetch URLs with bounded size and time. ``async with`` owns the session.

    The guard's layers: 1. ``sources.parse_remote_url`` on the first URL and each redirect target:
    scheme, credentials, host syntax, non-canonical numeric IPv4 forms, and IP literals (aiohttp
    never asks the resolver about an IP literal, so this check is the one that covers them).
    2. :class:`GuardedResolver`: refuses a name if ANY answer is not public (unless the host is
    allowlisted) and hands aiohttp exactly the checked answers; aiohttp resolves again for every
    new connection (no DNS cache), so DNS rebinding cannot slip through. 3. The ``socket_factory``
    refuses a non-public ``sockaddr`` unless this hop's host is allowlisted: the policy holds even
    if aiohttp's IP-literal or resolver handling changes. Responses are read with
    ``Accept-Encoding: identity`` and no automatic decompression (no gzip bombs)."""

    def __init__(self, *, allow_hosts: tuple[str, ...] | AllowList = (), timeout_ms: int, max_redirects: int = 3,
                 connect_timeout_ms: int | None = None, read_timeout_ms: int | None = None,
                 resolver: AbstractResolver | None = None, max_connections: int = 64) -> None:
        """``timeout_ms``: the whole fetch, redirects included (connect, headers and body);
        ``connect_timeout_ms``: one TCP (+TLS) connect; ``read_timeout_ms``: the longest wait
        for the next bytes of the response. ``resolver``: the name resolver to guard (tests)."""
        self._allow = allow_hosts if isinstance(allow_hosts, AllowList) else AllowList(allow_hosts)
        total = self._total_s = timeout_ms / 1000
        connect = min(timeout_ms, connect_timeout_ms or 5000) / 1000
        read = min(timeout_ms, read_timeout_ms or timeout_ms) / 1000
        self._timeout = aiohttp.ClientTimeout(total=total, sock_connect=connect, sock_read=read)
        self._max_redirects = max_redirects
        self._inner_resolver = resolver
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self.resolver: GuardedResolver | None = None

    @classmethod
    def from_settings(cls, settings, **kw) -> MediaFetcher:
        return cls(allow_hosts=settings.media_allow_hosts, timeout_ms=settings.media_fetch_timeout_ms,
                   connect_timeout_ms=settings.media_connect_timeout_ms,
                   read_timeout_ms=settings.media_read_timeout_ms, max_redirects=settings.media_max_redirects, **kw)

    async def __aenter__(self) -> MediaFetcher:
        self.resolver = GuardedResolver(self._allow, self._inner_resolver)
        connector = aiohttp.TCPConnector(resolver=self.resolver, use_dns_cache=False, limit=self._max_connections,
                                         limit_per_host=8, socket_factory=_guarded_socket)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, auto_decompress=False, trust_env=False,
            headers={"Accept-Encoding": "identity", "User-Agent": "mmfleet-media-fetch/1"})
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, url: str, *, max_bytes: int, param: str) -> bytes:
        """The body of ``url``; ``MediaError`` (message prefixed with ``param``) on any refusal,
        HTTP error, timeout or cap."""
        try:
            return await self.fetch_bytes(url, max_bytes=max_bytes)
        except MediaError as exc:
            raise exc.for_param(param) from None

    async def fetch_bytes(self, url: str, *, max_bytes: int) -> bytes:
        """As :meth:`fetch`, with messages not prefixed (shared by de-duplicated requests)."""
        assert self._session is not None, "use MediaFetcher as an async context manager"
        try:
            async with asyncio.timeout(self._total_s):  # all hops together
                return await self._follow(url, max_bytes)
        except TimeoutError:
            raise MediaError(f"fetching the media URL timed out after {self._total_s:g} s",
                             code="media_fetch_failed") from None

    async def _follow(self, url: str, max_bytes: int) -> bytes:
        target = url
        for hop in range(self._max_redirects + 1):
            where = "" if hop == 0 else f"redirected to {target[:200]}: "
            try:
                u = parse_remote_url(target, self._allow)
                token = _HOP_ALLOWED.set(self._allow.allows(u.raw_host or "", u.port))
                try:
                    result = await self._one_hop(u, max_bytes)
                finally:
                    _HOP_ALLOWED.reset(token)
            except MediaError as exc:
                raise MediaError(where + str(exc), status=exc.status, code=exc.code) from None
            if isinstance(result, bytes):
                return result
            target = result
        raise MediaError(f"too many redirects (more than {self._max_redirects})", code="media_fetch_failed")

    async def _one_hop(self, u: yarl.URL, max_bytes: int) -> bytes | str:
        """The body, or the next URL (a redirect)."""
        assert self._session is not None
        try:
            async with self._session.get(u, allow_redirects=False) as resp:
                if resp.status in _REDIRECTS:
                    location = resp.headers.get("Location")
                    if not location:
                        raise MediaError(f"fetching the media URL returned HTTP {resp.status} without a Location",
                                         code="media_fetch_failed")
                    try:
                        return str(resp.url.join(yarl.URL(location)))
                    except Exception as exc:  # noqa: BLE001 - an untrusted Location into yarl (see sources)
                        raise MediaError(f"the media URL redirected to a malformed URL ({str(exc)[:120]})",
                                         code="media_fetch_failed") from None
                if resp.status != 200:
                    raise MediaError(f"fetching the media URL returned HTTP {resp.status}", code="media_fetch_failed")
                length = resp.content_length
                if length is not None and length > max_bytes:
                    resp.close()
                    raise MediaError(f"media is {length} bytes, above the {max_bytes} byte limit", status=413,
                                     code="media_too_large")
                chunks, total = [], 0
                async for chunk in resp.content.iter_chunked(_CHUNK):
                    total += len(chunk)
                    if total > max_bytes:  # stop reading at cap+1, never buffer the rest
                        resp.close()
                        raise MediaError(f"media is larger than the {max_bytes} byte limit", status=413,
                                         code="media_too_large")
                    chunks.append(chunk)
                if not total:
                    raise MediaError("the media URL returned an empty body", code="media_fetch_failed")
                return b"".join(chunks)
        except MediaError:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            inner = _media_error_in(exc)
            if inner is not None:
                raise inner from None
            raise MediaError(_describe(exc, u), code="media_fetch_failed") from None


def _media_error_in(exc: BaseException) -> MediaError | None:
    """The ``MediaError`` a guard raised, if ``exc`` is or wraps one. With aiohttp 3.14 a
    non-``OSError`` raised by the resolver or the socket factory propagates out of ``session.get``
    unchanged (only ``OSError`` is wrapped, in ``ClientConnectorDNSError`` /
    ``ClientConnectorError``), so ``MediaError`` (a ``ValueError``) arrives as itself; this also
    digs it out of a wrapper in case a future aiohttp wraps it."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, MediaError):
            return exc
        os_error = getattr(exc, "os_error", None)
        if isinstance(os_error, MediaError):
            return os_error
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _describe(exc: BaseException, u: yarl.URL) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return f"fetching the media URL from {u.host} timed out"
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return f"the TLS certificate of the media URL host {u.host} could not be verified"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return f"could not resolve the media URL host {u.host}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"could not connect to the media URL host {u.host}:{u.port}"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the media URL's response body was cut short or malformed"
    if isinstance(exc, aiohttp.ClientResponseError):  # the response itself broke HTTP's rules
        return f"the media URL host {u.host} sent a malformed HTTP response"
    return f"could not fetch the media URL ({type(exc).__name__}: {str(exc)[:200]})"
