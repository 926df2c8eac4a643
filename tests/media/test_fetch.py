"""The http(s) loader against a local misbehaving server (127.0.0.1 only). Names are resolved by
an injected resolver (no DNS leaves the machine); every refusal is checked to happen before
any connection is made (the server counts connections)."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import pytest
from aiohttp.abc import AbstractResolver

from shared.media import fetch as fetch_mod
from shared.media.fetch import GuardedResolver, MediaFetcher
from shared.media.netguard import AllowList
from shared.media.sources import MediaError
from tests.media import samples
from tests.media.server import MediaServer

P = "messages[0].content[0]"
CAP = 200_000


class MapResolver(AbstractResolver):
    """name -> addresses, answered locally; counts lookups."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.calls: list[str] = []

    async def resolve(self, host, port=0, family=socket.AF_INET):
        self.calls.append(host)
        if host not in self.table:
            raise OSError(socket.EAI_NONAME, "Name or service not known")
        return [{"hostname": host, "host": a, "port": port, "family": socket.AF_INET6 if ":" in a else socket.AF_INET,
                 "proto": 0, "flags": socket.AI_NUMERICHOST} for a in self.table[host]]

    async def close(self):
        pass


@pytest.fixture(scope="module")
async def server():
    srv = await MediaServer({"/a.png": samples.png(seed=1), "/big.bin": b"\x01" * (CAP + 1),
                             "/exact.bin": b"\x02" * CAP}).start()
    yield srv
    await srv.stop()


@pytest.fixture
def names():
    return MapResolver({"media.test": ["127.0.0.1"], "evil.test": ["127.0.0.1"], "meta.test": ["169.254.169.254"],
                        "mixed.test": ["8.8.8.8", "10.0.0.7"], "v6.test": ["::1"], "public.test": ["8.8.8.8"]})


def fetcher(server: MediaServer, names: MapResolver, *, allow=None, **kw) -> MediaFetcher:
    allow = [f"127.0.0.1:{server.port}", "media.test"] if allow is None else allow
    kw.setdefault("timeout_ms", 3000)
    return MediaFetcher(allow_hosts=tuple(allow), resolver=names, **kw)


async def get(f: MediaFetcher, url: str, cap: int = CAP) -> bytes:
    async with f:
        return await f.fetch(url, max_bytes=cap, param=P)


async def refused(f: MediaFetcher, url: str, cap: int = CAP) -> MediaError:
    with pytest.raises(MediaError) as info:
        await get(f, url, cap)
    err = info.value
    assert str(err).startswith(P + ": ")
    assert err.status in (400, 413)
    return err


# ---------------------------------------------------------------------------- the happy path
async def test_fetch_from_allowlisted_host_port(server, names):
    assert await get(fetcher(server, names), server.base + "/a.png") == samples.png(seed=1)


async def test_resolver_answers_are_what_aiohttp_connects_to(server, names):
    """media.test is allowlisted and resolves (through the injected resolver) to the local
    server: the request arrives there, with the name in the Host header."""
    before = len(server.requests)
    url = f"http://media.test:{server.port}/a.png"
    assert await get(fetcher(server, names), url) == samples.png(seed=1)
    assert server.requests[before:] == [("/a.png", f"media.test:{server.port}")]
    assert names.calls == ["media.test"]


async def test_exact_cap_is_accepted(server, names):
    assert len(await get(fetcher(server, names), server.base + "/exact.bin")) == CAP


# ---------------------------------------------------------------------------- caps
async def test_content_length_over_cap_is_413_before_reading(server, names):
    err = await refused(fetcher(server, names), server.base + "/big.bin")
    assert err.status == 413 and f"{CAP + 1} bytes" in str(err)
    err = await refused(fetcher(server, names), server.base + "/cl-huge")
    assert err.status == 413 and str(10**12) in str(err)


@pytest.mark.parametrize("path", ["/endless", "/endless-nolength"])
async def test_endless_body_stops_at_cap_plus_one(server, names, path):
    t0 = time.monotonic()
    err = await refused(fetcher(server, names), server.base + path)
    assert err.status == 413 and f"larger than the {CAP} byte limit" in str(err)
    assert time.monotonic() - t0 < 2


async def test_lying_content_length_short_never_reads_past_the_announced_length(server, names):
    """100 bytes announced, 5000 sent: either exactly the announced bytes (which then fail to
    decode as an image) or, when aiohttp sees the extra bytes in time, a malformed response."""
    try:
        raw = await get(fetcher(server, names), server.base + "/cl-short")
    except MediaError as err:
        assert err.status == 400 and "malformed HTTP response" in str(err) and "AAAA" not in str(err)
    else:
        assert raw == b"A" * 100


async def test_lying_content_length_long_is_a_cut_short_body(server, names):
    err = await refused(fetcher(server, names), server.base + "/cl-long")
    assert err.status == 400 and "cut short" in str(err)


async def test_compressed_body_is_not_expanded(server, names):
    raw = await get(fetcher(server, names), server.base + "/gzip")
    assert raw[:2] == b"\x1f\x8b" and len(raw) < 100_000  # 5 MB of zeros stayed compressed


async def test_empty_body_and_http_errors(server, names):
    assert "empty body" in str(await refused(fetcher(server, names), server.base + "/empty"))
    assert "HTTP 404" in str(await refused(fetcher(server, names), server.base + "/missing.png"))
    assert "without a Location" in str(await refused(fetcher(server, names), server.base + "/redirect-nolocation"))


# ---------------------------------------------------------------------------- timeouts
async def test_read_timeout(server, names):
    t0 = time.monotonic()
    err = await refused(fetcher(server, names, timeout_ms=5000, read_timeout_ms=300),
                        server.base + "/slow-headers?s=3")
    assert "timed out" in str(err)
    assert time.monotonic() - t0 < 2


async def test_total_timeout_bounds_a_trickling_body(server, names):
    t0 = time.monotonic()
    err = await refused(fetcher(server, names, timeout_ms=800, read_timeout_ms=500), server.base + "/trickle")
    assert "timed out" in str(err)
    assert time.monotonic() - t0 < 2


async def test_total_timeout_covers_all_redirect_hops(server, names):
    t0 = time.monotonic()
    err = await refused(fetcher(server, names, timeout_ms=1000, read_timeout_ms=500, max_redirects=10),
                        server.base + "/slow-loop")
    assert "timed out after 1 s" in str(err)
    assert time.monotonic() - t0 < 1.6


# ---------------------------------------------------------------------------- SSRF
@pytest.mark.parametrize("url, fragment", [
    ("http://127.0.0.1:{port}/a.png", None),  # the server itself, when not allowlisted
    ("http://127.0.0.1:{other}/a.png", "loopback"),
    ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
    ("http://[::1]:{port}/a.png", "loopback"),
    ("http://[::ffff:127.0.0.1]:{port}/a.png", "IPv4-mapped loopback"),
    ("http://10.0.0.1/a.png", "private"),
    ("http://2130706433:{port}/a.png", "non-standard form"),
    ("http://0177.0.0.1:{port}/a.png", "non-standard form"),
    ("http://0x7f.1:{port}/a.png", "non-standard form"),
    ("http://evil.test:{port}/a.png", "resolves to 127.0.0.1, a loopback address"),
    ("http://meta.test/latest", "resolves to 169.254.169.254, a link-local (cloud metadata) address"),
    ("http://mixed.test/a.png", "resolves to 10.0.0.7, a private address"),
    ("http://v6.test:{port}/a.png", "resolves to ::1, a loopback address"),
])
async def test_refused_targets_never_connect(server, names, url, fragment):
    allow = [] if fragment is None else None
    url = url.format(port=server.port, other=server.port + 1)
    before = server.connections
    err = await refused(fetcher(server, names, allow=allow), url)
    assert err.code == "media_url_forbidden"
    assert fragment is None or fragment in str(err), str(err)
    assert server.connections == before


async def test_unresolvable_name(server, names):
    err = await refused(fetcher(server, names), "http://nowhere.test/a.png")
    assert "could not resolve" in str(err) and "nowhere.test" in str(err)


@pytest.mark.parametrize("to, fragment", [
    ("http://127.0.0.1:{other}/a.png", "loopback"),  # another port of an allowlisted host
    ("http://169.254.169.254/latest/meta-data/iam/", "cloud metadata"),
    ("http://[::1]:{port}/a.png", "loopback"),
    ("http://evil.test:{port}/a.png", "resolves to 127.0.0.1"),
    ("http://0x7f.1:{port}/a.png", "non-standard form"),
    ("file:///etc/passwd", "unsupported URL scheme 'file'"),
    ("data:image/png;base64,iVBORw0KGgo=", "unsupported URL scheme 'data'"),
    ("gopher://127.0.0.1:6379/_x", "unsupported URL scheme 'gopher'"),
])
async def test_redirects_are_rechecked_at_every_hop(server, names, to, fragment):
    target = to.format(port=server.port, other=server.port + 1)
    before = server.connections
    err = await refused(fetcher(server, names), f"{server.base}/redirect?to={target}")
    assert "redirected to" in str(err) and fragment in str(err), str(err)
    assert server.connections == before + 1  # the redirecting hop only


async def test_redirect_within_the_allowlist_is_followed(server, names):
    for status in ("301", "302", "303", "307", "308"):
        url = f"{server.base}/redirect?status={status}&to=/a.png"
        assert await get(fetcher(server, names), url) == samples.png(seed=1)
    url = f"{server.base}/redirect?to=http://media.test:{server.port}/a.png"
    assert await get(fetcher(server, names), url) == samples.png(seed=1)


async def test_redirect_loops_are_capped(server, names):
    before = server.hits("/loop")
    err = await refused(fetcher(server, names, max_redirects=2), server.base + "/loop")
    assert "too many redirects (more than 2)" in str(err)
    assert server.hits("/loop") - before == 3


async def test_socket_gate_holds_even_if_the_resolver_check_is_bypassed(server, names, monkeypatch):
    """The last layer: with the resolver's check disabled, the socket factory still refuses
    the address about to be connected, before connecting."""

    async def unchecked(self, host, port=0, family=socket.AF_INET):
        return list(await self._inner.resolve(host, port, family))

    monkeypatch.setattr(GuardedResolver, "resolve", unchecked)
    before = server.connections
    err = await refused(fetcher(server, names), f"http://evil.test:{server.port}/a.png")
    assert "refused to connect to 127.0.0.1, a loopback address" in str(err)
    assert server.connections == before
    # and an allowlisted hop still connects
    assert await get(fetcher(server, names), f"http://media.test:{server.port}/a.png") == samples.png(seed=1)


async def test_socket_gate_covers_ip_literals_if_the_url_check_is_bypassed(server, names, monkeypatch):
    monkeypatch.setattr(fetch_mod, "parse_remote_url", lambda url, allow: __import__("yarl").URL(url))
    before = server.connections
    err = await refused(fetcher(server, names, allow=[]), f"http://127.0.0.1:{server.port}/a.png")
    assert "refused to connect to 127.0.0.1" in str(err)
    assert server.connections == before


async def test_dns_rebinding_each_connection_is_resolved_and_checked(server, names):
    """No DNS cache: every new connection resolves again and the answer is checked again, so a
    name that is fine once and loopback next time is refused next time."""
    f = fetcher(server, names, allow=[f"127.0.0.1:{server.port}"])
    names.table["rebind.test"] = ["8.8.8.8"]
    async with f:
        names.table["rebind.test"] = ["127.0.0.1"]  # the answer changes before the connect
        with pytest.raises(MediaError, match="resolves to 127.0.0.1"):
            await f.fetch(f"http://rebind.test:{server.port}/a.png", max_bytes=CAP, param=P)
        assert f.resolver is not None and f.resolver.lookups == 1


# ---------------------------------------------------------------------------- how aiohttp surfaces errors
async def test_aiohttp_propagates_a_non_oserror_from_the_resolver_unwrapped():
    """Documents aiohttp 3.14's behaviour the fetcher relies on (and also guards against, see
    fetch._media_error_in): a ValueError subclass raised by the resolver is not wrapped; an
    OSError is wrapped in ClientConnectorDNSError."""

    class Raising(AbstractResolver):
        def __init__(self, exc):
            self.exc = exc

        async def resolve(self, host, port=0, family=socket.AF_INET):
            raise self.exc

        async def close(self):
            pass

    for exc, expected in ((MediaError("nope"), MediaError), (OSError("dns down"), aiohttp.ClientConnectorDNSError)):
        for use_dns_cache in (False, True):
            conn = aiohttp.TCPConnector(resolver=Raising(exc), use_dns_cache=use_dns_cache)
            async with aiohttp.ClientSession(connector=conn) as session:
                with pytest.raises(expected):
                    await session.get("http://name.test/")


def test_media_error_is_found_inside_a_wrapper():
    inner = MediaError("refused for a reason")
    try:
        try:
            raise inner
        except MediaError as e:
            raise aiohttp.ClientConnectorError(None, OSError("x")) from e
    except aiohttp.ClientConnectorError as wrapped:
        assert fetch_mod._media_error_in(wrapped) is inner


async def test_aiohttp_itself_refuses_non_canonical_ipv4():
    """aiohttp 3.14 refuses legacy numeric IPv4 hosts on its own (InvalidUrlClientError); the
    fetcher refuses them earlier with a message for the user, whatever the aiohttp version."""
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.InvalidUrlClientError):
            await session.get("http://2130706433:9/")


async def test_fetcher_only_builds_guarded_sessions(server, names):
    f = fetcher(server, names)
    async with f:
        conn = f._session.connector
        assert isinstance(conn._resolver, GuardedResolver)
        assert conn._socket_factory is fetch_mod._guarded_socket
        assert conn._use_dns_cache is False
        assert f._session.trust_env is False and f._session.auto_decompress is False


async def test_concurrent_fetches_share_the_session(server, names):
    f = fetcher(server, names)
    async with f:
        results = await asyncio.gather(*(f.fetch(server.base + "/a.png", max_bytes=CAP, param=P) for _ in range(8)))
    assert all(r == samples.png(seed=1) for r in results)


def test_allowlist_type_is_accepted_directly():
    f = MediaFetcher(allow_hosts=AllowList(["x:1"]), timeout_ms=1000)
    assert f._allow.allows("x", 1)
