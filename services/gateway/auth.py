"""Who may send: API keys (sha256 hashes in settings) and per-key request-rate limits (Redis).

Contract: with no ``api_key_hashes`` configured every caller is let in (the local demo). With
keys configured, :meth:`Authenticator.check` wants ``Bearer <key>`` (the HTTP
``Authorization`` header, or the Kafka ingress's ``authorization`` record header) whose sha256
is configured, and raises :class:`Rejected` (401) otherwise. The key itself is never stored,
logged, labelled or echoed: it is identified by the first 12 hex digits of its hash.
Rate limits are fixed one-minute windows counted in Redis (shared by every gateway); a
request over the limit is a 429 with ``Retry-After`` until the window ends; a Redis that cannot
count it (stalled, gone) is a 503 with ``Retry-After``. Design: docs/guide/security.md.
"""

from __future__ import annotations

import hashlib
import re
import time

from prometheus_client import Counter

from services.gateway.responses import STORE_RETRY_AFTER_S, Rejected, store_unavailable
from shared.keys import RedisKeys
from shared.settings import Settings
from shared.transport.redis_conn import unavailable

AUTH_REJECTIONS = Counter("mmfleet_auth_rejections_total", "Requests refused by API-key checks or rate limits",
                          ["via", "reason"])

_HASH = re.compile(r"^[0-9a-f]{64}$")
_WINDOW_S = 60


def hash_key(key: str) -> str:
    """What settings hold for ``key``: the lowercase hex sha256 of its UTF-8 bytes."""
    return hashlib.sha256(key.strip().encode()).hexdigest()


def parse_key_hashes(entries: tuple[str, ...], default_rate_per_min: int) -> dict[str, int]:
    """``{hash: requests per minute (0 = unlimited)}`` from ``<hash>[:<rate>]`` entries.

    Raises ``ValueError`` naming the entry's position (never its value) when malformed.
    """
    out: dict[str, int] = {}
    for i, entry in enumerate(entries):
        digest, _, rate = entry.strip().lower().partition(":")
        if not _HASH.match(digest) or (rate and not rate.isdigit()):
            raise ValueError(f"MMFLEET_API_KEY_HASHES entry {i} is not <sha256 hex>[:<requests per minute>]; "
                             "make one with `mmfleet keys hash`")
        out[digest] = int(rate) if rate else default_rate_per_min
    return out


class Authenticator:
    """One per gateway process; ``redis`` counts rate windows (unused without limits)."""

    def __init__(self, settings: Settings, redis, keys: RedisKeys) -> None:
        self._rates = parse_key_hashes(settings.api_key_hashes, settings.api_key_rate_per_min)
        self._limit_by_id = {digest[:12]: rate for digest, rate in self._rates.items()}
        self._redis = redis
        self._keys = keys

    @property
    def enabled(self) -> bool:
        return bool(self._rates)

    def identify(self, authorization: str | None, *, via: str) -> str | None:
        """The caller's key id (hash prefix), None when keys are off; raises 401 ``Rejected``."""
        if not self._rates:
            return None
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            AUTH_REJECTIONS.labels(via, "missing_key").inc()
            raise Rejected.of(401, "missing API key: send Authorization: Bearer <key>", code="missing_api_key")
        digest = hash_key(key)
        if digest not in self._rates:
            AUTH_REJECTIONS.labels(via, "invalid_key").inc()
            raise Rejected.of(401, "invalid API key", code="invalid_api_key")
        return digest[:12]

    async def charge(self, key_id: str | None, *, via: str) -> None:
        """Count one request against the key's limit; raises 429 ``Rejected`` when over it, 503
        when Redis is unavailable (within ``redis_timeout_ms``)."""
        if key_id is None:
            return
        limit = self._limit_by_id[key_id]
        if limit <= 0:
            return
        now = time.time()
        window = int(now // _WINDOW_S)
        key = self._keys.rate(key_id, window)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.incr(key)
                pipe.expire(key, _WINDOW_S + 1)
                count, _ = await pipe.execute()
        except Exception as exc:
            if not unavailable(exc):
                raise
            AUTH_REJECTIONS.labels(via, "store_unavailable").inc()
            raise Rejected(store_unavailable(exc), STORE_RETRY_AFTER_S) from None
        if count > limit:
            AUTH_REJECTIONS.labels(via, "rate_limited").inc()
            retry_s = max(1, int((window + 1) * _WINDOW_S - now) + 1)
            raise Rejected.of(429, f"this API key is limited to {limit} requests per minute; retry in {retry_s} s",
                              code="rate_limit_exceeded", retry_after_s=retry_s)
