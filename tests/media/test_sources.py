"""data: URL parsing, URL checks before any I/O, the address policy and the allowlist; plus
property tests: arbitrary input never raises anything but MediaError, never a 5xx status."""

from __future__ import annotations

import base64
import binascii
import ipaddress
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.media.netguard import AllowList, refusal_reason
from shared.media.sources import (
    IMAGE_MIME_TYPES,
    MediaError,
    check_remote_url,
    decode_data_url,
    parse_remote_url,
    scheme_of,
    strict_b64decode,
)
from tests.media import samples

P = "messages[0].content[1]"


def data(url: str, max_bytes: int = 1 << 20) -> tuple[str, bytes]:
    return decode_data_url(url, allowed_mime=IMAGE_MIME_TYPES, max_bytes=max_bytes, param=P)


def data_error(url: str, max_bytes: int = 1 << 20) -> MediaError:
    with pytest.raises(MediaError) as info:
        data(url, max_bytes)
    assert str(info.value).startswith(P + ": ")
    return info.value


# ---------------------------------------------------------------------------- data: URLs
@pytest.mark.parametrize("mime", ["image/png", "image/jpeg", "image/webp", "IMAGE/PNG"])
def test_data_url_roundtrip(mime):
    raw = samples.png()
    assert data(samples.data_url(raw, mime)) == (mime.lower(), raw)


def test_data_url_params_and_aliases():
    raw = samples.jpeg()
    b64 = base64.b64encode(raw).decode()
    assert data(f"data:image/jpeg;name=cat.jpg;base64,{b64}") == ("image/jpeg", raw)
    assert data(f"data:image/jpg;base64,{b64}") == ("image/jpeg", raw)  # a common misspelling
    assert data(f"DATA:image/png;BASE64,{b64}")[1] == raw


@pytest.mark.parametrize("url, status, fragment", [
    ("data:image/png;base64", 400, "malformed data URL"),
    ("data:", 400, "malformed data URL"),
    ("data:,abc", 400, "no valid MIME type"),
    ("data:;base64,AAAA", 400, "no valid MIME type"),
    ("data:text/plain;base64,aGVsbG8=", 400, "does not match an image_url part"),
    ("data:video/mp4;base64,AAAA", 400, "does not match an image_url part"),
    ("data:application/octet-stream;base64,AAAA", 400, "does not match an image_url part"),
    ("data:image/gif;base64,R0lGODlh", 400, "image type 'image/gif' is not accepted"),
    ("data:image/svg+xml;base64,PHN2Zz4=", 400, "image type 'image/svg+xml' is not accepted"),
    ("data:image/png,rawbytes", 400, "must be base64-encoded"),
    ("data:image/png;charset=utf-8,rawbytes", 400, "must be base64-encoded"),
    ("data:image/png;base64,", 400, "data URL is empty"),
    ("data:image/png;base64,!!!not-base64!!!", 400, "character '!' at offset 0"),
    ("data:image/png;base64,iVBO Rw0K", 400, "character ' ' at offset 4"),
    ("data:image/png;base64,iVBO\nRw0K", 400, "character '\\n' at offset 4"),
    ("data:image/png;base64,iVBO-_0K", 400, "character '-' at offset 4"),
    ("data:image/png;base64,iVBO%2B0K", 400, "character '%' at offset 4"),
    ("data:image/png;base64,iVBORw0", 400, "multiple of 4"),
    ("data:image/png;base64,iV=BORw0", 400, "invalid base64"),
    ("data:image/png;base64,====", 400, "invalid base64"),
    ("data:image/png;base64,ÿÿÿÿ", 400, "character 'ÿ'"),
])
def test_bad_data_urls(url, status, fragment):
    err = data_error(url)
    assert err.status == status
    assert fragment in str(err), str(err)


def test_data_url_size_is_checked_before_decoding():
    cap = 3000
    exact = samples.data_url(b"\x89PNG" + b"\x00" * (cap - 4))
    assert len(data(exact, cap)[1]) == cap
    over = samples.data_url(b"\x89PNG" + b"\x00" * (cap - 3))
    err = data_error(over, cap)
    assert err.status == 413 and err.code == "media_too_large" and str(cap) in str(err)
    # a huge payload of invalid characters is refused for its size, not scanned or decoded
    err = data_error("data:image/png;base64," + "!" * 10_000_000, cap)
    assert err.status == 413


def test_scheme_of():
    assert scheme_of("HTTPS://x") == "https"
    assert scheme_of(" data:image/png;base64,") == "data"
    assert scheme_of("no-scheme") == ""
    assert scheme_of("ünï:x") == ""


# ---------------------------------------------------------------------------- addresses
@pytest.mark.parametrize("ip, reason", [
    ("127.0.0.1", "loopback"), ("127.255.0.7", "loopback"), ("::1", "loopback"),
    ("10.0.0.1", "private"), ("172.16.5.4", "private"), ("172.31.255.255", "private"),
    ("192.168.1.1", "private"), ("fc00::1", "private"), ("fd12:3456::1", "private"),
    ("169.254.169.254", "link-local (cloud metadata)"), ("169.254.1.1", "link-local"), ("fe80::1", "link-local"),
    ("224.0.0.1", "multicast"), ("239.255.255.250", "multicast"), ("ff02::1", "multicast"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"), ("240.0.0.1", "reserved"), ("255.255.255.255", "reserved"),
    ("100.64.0.1", "shared (carrier-grade NAT)"), ("192.0.2.1", "private"), ("198.18.0.1", "private"),
    ("::ffff:127.0.0.1", "IPv4-mapped loopback"), ("::ffff:169.254.169.254", "IPv4-mapped link-local (cloud metadata)"),
    ("::ffff:10.1.2.3", "IPv4-mapped private"), ("64:ff9b::a00:1", "NAT64 private"),
    ("2002:7f00:1::1", "6to4 loopback"), ("fec0::1", "site-local"), ("2001:db8::1", "private"),
])
def test_refused_addresses(ip, reason):
    assert refusal_reason(ip) == reason


@pytest.mark.parametrize("ip", ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111",
                                "::ffff:8.8.8.8", "64:ff9b::808:808", "172.32.0.1", "11.0.0.1"])
def test_public_addresses(ip):
    assert refusal_reason(ip) is None


def test_allowlist_semantics():
    allow = AllowList(["127.0.0.1:8123", "Media.Internal", "[::1]:99", "fd00::5", " ", "10.1.1.1"])
    assert allow.allows("127.0.0.1", 8123)
    assert not allow.allows("127.0.0.1", 8124)  # another loopback port is not allowlisted
    assert not allow.allows("localhost", 8123)  # names are not resolved for the allowlist
    assert allow.allows("media.internal", 1) and allow.allows("MEDIA.internal.", 443)
    assert allow.allows("::1", 99) and allow.allows("[0:0::1]", 99) and not allow.allows("::1", 98)
    assert allow.allows("fd00::5", 80) and allow.allows("10.1.1.1", 5)
    assert not AllowList(())
    for bad in ["host:0", "host:99999", "host:x", "[::1]x"]:
        with pytest.raises(ValueError):
            AllowList([bad])


# ---------------------------------------------------------------------------- URLs
def url_error(url: str, allow=()) -> MediaError:
    with pytest.raises(MediaError) as info:
        check_remote_url(url, param=P, allow_hosts=allow)
    err = info.value
    assert str(err).startswith(P + ": ") and err.status == 400
    return err


@pytest.mark.parametrize("url, fragment", [
    ("http://127.0.0.1/a.png", "loopback"),
    ("http://127.0.0.1:8000/v1/models", "loopback"),
    ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
    ("http://[::1]/", "loopback"),
    ("http://[::ffff:127.0.0.1]/", "IPv4-mapped loopback"),
    ("http://[::ffff:7f00:1]/", "IPv4-mapped loopback"),
    ("http://[fe80::1]/", "link-local"),
    ("http://[fc00::1]/", "private"),
    ("http://10.0.0.1/", "private"),
    ("http://172.16.0.1/", "private"),
    ("http://192.168.0.1/", "private"),
    ("http://0.0.0.0/", "unspecified"),
    ("http://[::]/", "unspecified"),
    ("http://224.0.0.251/", "multicast"),
    ("http://2130706433/", "non-standard form"),
    ("http://0177.0.0.1/", "non-standard form"),
    ("http://0x7f.1/", "non-standard form"),
    ("http://0x7f000001/", "non-standard form"),
    ("http://127.1/", "non-standard form"),
    ("http://017700000001/", "non-standard form"),
    ("http://127.0.0.1./", "non-standard form"),
    ("http://169.254.43518/", "non-standard form"),
    ("http://%31%32%37.0.0.1/", "may not contain '%'"),
    ("http://[fe80::1%25eth0]/", "may not contain '%'"),
    ("http://①②⑦.0.0.1/", "loopback"),  # yarl (what aiohttp connects to) normalises it to 127.0.0.1
    ("http://１２７.０.０.１/", "loopback"),
    ("http://user:pw@example.com/a.png", "user name or password"),
    ("http://user@example.com/a.png", "user name or password"),
    ("http://example.com\\@127.0.0.1/", "malformed URL"),
    ("http://[::1/", "malformed URL"),
    ("http://[]@/", "malformed URL"),  # yarl 1.25 raises IndexError on it (found by the property test)
    ("http://example.com:99999/", "malformed URL"),
    ("http://exa mple.com/", "not a valid host name"),
    ("http://exa<mple.com/", "not a valid host name"),
    ("http:///a.png", "no host"),
    ("ftp://example.com/a.png", "unsupported URL scheme 'ftp'"),
    ("gopher://127.0.0.1:6379/_INFO", "unsupported URL scheme 'gopher'"),
    ("file:///etc/passwd", "unsupported URL scheme 'file'"),
    ("http://example.com/" + "a" * 9000, "the limit is 8192"),
])
def test_refused_urls(url, fragment):
    assert fragment in str(url_error(url)), str(url_error(url))


@pytest.mark.parametrize("url", ["http://example.com/a.png", "https://EXAMPLE.com:8443/a.png?x=1#f",
                                 "http://8.8.8.8/a.png", "http://[2606:4700:4700::1111]/a.png",
                                 "http://localhost/a.png",  # names are checked when resolved, not here
                                 "http://xn--bcher-kva.example/a.png", "http://bücher.example/a.png"])
def test_accepted_urls(url):
    assert check_remote_url(url, param=P) == url


def test_allowlisted_literal_is_accepted_on_its_port_only():
    allow = AllowList(["127.0.0.1:8123"])
    assert check_remote_url("http://127.0.0.1:8123/x.png", param=P, allow_hosts=allow)
    assert "loopback" in str(url_error("http://127.0.0.1:8124/x.png", allow))
    assert "non-standard" in str(url_error("http://2130706433:8123/x.png", allow))


def test_the_checked_host_is_the_host_aiohttp_connects_to():
    """parse_remote_url returns the yarl URL handed to aiohttp: its raw_host is what aiohttp
    resolves (or, for an IP literal, connects to directly)."""
    u = parse_remote_url("http://EXAMPLE.com:81/a b.png", AllowList())
    assert (u.raw_host, u.port) == ("example.com", 81)


def test_what_the_resolver_would_do_with_legacy_forms():
    """Why non-canonical forms must be refused before resolving: the system resolver maps
    them onto real addresses (local lookups only, nothing leaves the machine)."""
    for host in ("2130706433", "0177.0.0.1", "0x7f.1", "127.1"):
        infos = socket.getaddrinfo(host, 80, socket.AF_INET, socket.SOCK_STREAM)
        assert {i[4][0] for i in infos} == {"127.0.0.1"}, host


# ---------------------------------------------------------------------------- properties
def _legacy_forms(n: int) -> list[str]:
    """Ways legacy IPv4 parsers spell the address ``n``."""
    a, b, c, d = n.to_bytes(4, "big")
    return [str(n), hex(n), f"0{n:o}", f"{a}.{(b << 16) | (c << 8) | d}", f"{a}.{b}.{(c << 8) | d}",
            f"0x{a:x}.0x{b:x}.0x{c:x}.0x{d:x}", f"0{a:o}.0{b:o}.0{c:o}.0{d:o}", f"{a}.{b}.{c}.{d}."]


@settings(max_examples=300, deadline=None)
@given(n=st.one_of(st.integers(0x7F000000, 0x7FFFFFFF), st.integers(0x0A000000, 0x0AFFFFFF),
                   st.integers(0xA9FE0000, 0xA9FEFFFF), st.integers(0xC0A80000, 0xC0A8FFFF),
                   st.integers(0, 2**32 - 1)),
       port=st.one_of(st.none(), st.integers(1, 65535)))
def test_property_numeric_forms_are_refused(n, port):
    for form in _legacy_forms(n):
        host = form + (f":{port}" if port else "")
        with pytest.raises(MediaError):
            check_remote_url(f"http://{host}/x.png", param=P)
    canonical = str(ipaddress.IPv4Address(n))
    try:
        check_remote_url(f"http://{canonical}/x.png", param=P)
    except MediaError:
        assert refusal_reason(canonical) is not None
    else:
        assert refusal_reason(canonical) is None


_hosts = st.one_of(
    st.sampled_from(["example.com", "localhost", "127.0.0.1", "[::1]", "169.254.169.254", "0x7f.1", "10.0.0.1",
                     "[::ffff:10.0.0.1]", "xn--n3h.example", "a..b", "-a.com", "[", "]", "@", "%00", ""]),
    st.ip_addresses().map(lambda ip: f"[{ip}]" if ip.version == 6 else str(ip)),
    st.text(min_size=0, max_size=40),
    st.from_regex(r"[a-z0-9.\-_%\[\]:@]{0,30}", fullmatch=True))


@settings(max_examples=600, deadline=None)
@given(scheme=st.sampled_from(["http", "https", "HTTP", "ftp", "file", "data", "javascript", ""]),
       userinfo=st.sampled_from(["", "user@", "u:p@", "@", ":@"]),
       host=_hosts, port=st.sampled_from(["", ":80", ":0", ":65536", ":x", ":"]),
       path=st.text(max_size=30))
def test_property_url_check_raises_only_media_error(scheme, userinfo, host, port, path):
    url = f"{scheme}://{userinfo}{host}{port}/{path}"
    try:
        u = parse_remote_url(url, AllowList())
    except MediaError as err:
        assert 400 <= err.status < 500
        return
    # accepted: an http(s) URL with a host that is a public IP literal or a well-formed name
    assert u.scheme in ("http", "https") and u.raw_host and u.user is None
    ip = None
    try:
        ip = ipaddress.ip_address(u.raw_host)
    except ValueError:
        pass
    assert ip is None or refusal_reason(ip) is None


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_property_any_text_as_url(text):
    for candidate in (text, "http://" + text, "data:" + text):
        try:
            check_remote_url(candidate, param=P)
        except MediaError as err:
            assert 400 <= err.status < 500
        try:
            data(candidate, 4096)
        except MediaError as err:
            assert err.status in (400, 413)


_mimes = st.one_of(st.sampled_from(["image/png", "image/jpeg", "image/webp", "image/gif", "text/plain", "",
                                    "image/", "/png", "IMAGE/PNG", "image/png;x=1"]), st.text(max_size=20))


@settings(max_examples=600, deadline=None)
@given(mime=_mimes, params=st.lists(st.text(max_size=10), max_size=3), b64=st.booleans(),
       payload=st.one_of(st.binary(max_size=300).map(lambda b: base64.b64encode(b).decode()),
                         st.text(max_size=300)),
       cap=st.integers(1, 400))
def test_property_data_url(mime, params, b64, payload, cap):
    url = "data:" + ";".join([mime, *params]) + (";base64" if b64 else "") + "," + payload
    try:
        got_mime, raw = data(url, cap)
    except MediaError as err:
        assert err.status in (400, 413)
        assert str(err).startswith(P)
        return
    assert got_mime in IMAGE_MIME_TYPES and 0 < len(raw) <= cap
    assert base64.b64encode(raw).decode() == payload


_B64ISH = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_ \n\u00ff", max_size=24)


def _strict_or_none(fn, text):
    try:
        return fn(text)
    except (binascii.Error, ValueError):
        return None


@settings(max_examples=3000, deadline=None)
@given(st.one_of(_B64ISH, st.binary(max_size=18).map(lambda b: base64.b64encode(b).decode())))
def test_strict_b64decode_accepts_what_binascii_strict_mode_does_less_padding_after_a_full_group(text):
    ours = _strict_or_none(strict_b64decode, text)
    theirs = _strict_or_none(lambda t: binascii.a2b_base64(t, strict_mode=True), text)
    if ours is None and theirs is not None:  # binascii ignores '=' where no padding is due
        assert text.endswith("=") and len(text.rstrip("=")) % 4 == 0, text
    else:
        assert ours == theirs


def test_padding_after_a_complete_group_is_refused_with_the_reason():
    err = data_error("data:image/png;base64,iVBORw0K=")
    assert err.status == 400 and "'=' after a complete group" in str(err), str(err)
