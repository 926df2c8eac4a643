"""Client-named media (vLLM's part ``uuid``) and cache scopes, at the gateway.

A part's ``uuid`` names its item. With data, the item is cached under that name; with none (its
url null or ""), it must be an item the fleet's embedding index holds under that name, in the
request's scope and with the same processing options: :meth:`MediaNames.check` looks each up
before the request is admitted (400 ``unknown_media_uuid`` naming the part; 503 when Redis cannot
say). The scope is the API key's tenant (unless ``cache_share_across_tenants``) and the request's
``cache_salt`` (:func:`cache_scope`). Design: docs/guide/embedding-cache.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.responses import STORE_RETRY_AFTER_S, Rejected, store_unavailable
from shared.embcache.identity import cache_key, named_hash, scope_of, source_options
from shared.stage import RequestFailed
from shared.transport.redis_conn import unavailable

MAX_UUID_CHARS = 256  # vLLM sets none; a name is a key in every cache, so it is bounded here
MAX_SALT_CHARS = 128  # vLLM 0.32's bound, and its forbidden characters
_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_uuid(uuid: str | None, param: str) -> str:
    """A part's ``uuid`` ("" when it has none); a 400 naming ``<param>.uuid`` when empty or too long."""
    if uuid is None:
        return ""
    if not uuid or len(uuid) > MAX_UUID_CHARS:
        raise RequestFailed.bad_request(f"{param}.uuid must be a non-empty string of at most {MAX_UUID_CHARS} "
                                        "characters", param=f"{param}.uuid")
    return uuid


def check_salt(salt: str | None) -> str:
    """The request's ``cache_salt`` ("" when it has none), checked as vLLM checks it."""
    if salt is None:
        return ""
    if not salt or len(salt) > MAX_SALT_CHARS or any(c in _SALT_FORBIDDEN for c in salt):
        raise RequestFailed.bad_request(f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} "
                                        "characters without '@', '/', '\\' or NUL", param="cache_salt")
    return salt


def cache_scope(key_id: str | None, salt: str, *, share_across_tenants: bool) -> str:
    """The request's cache scope: its tenant (the API key's id, a prefix of the key's hash; none
    with keys off or shared) and its salt. "" (fleet-wide) when it has neither."""
    tenant = "" if key_id is None or share_across_tenants else key_id
    return scope_of(tenant, salt)


def item_key(fingerprint: str, kind: str, uuid: str, scope: str, *, min_pixels: int, max_pixels: int,
             num_frames: int, fps: float) -> str:
    """The embedding-cache key of a client-named item (media-fetch computes the same)."""
    options = source_options(min_pixels, max_pixels, num_frames, fps)
    return cache_key(fingerprint, named_hash(kind, uuid, scope, options), kind)


class MediaNames:
    """Resolves a request's data-less named items in the embedding index (``index`` None: the
    embedding cache is off, and such an item cannot be served)."""

    def __init__(self, index, fingerprint: str) -> None:
        self._index = index
        self._fingerprint = fingerprint

    async def check(self, media: Sequence, scope: str) -> None:
        """Raises ``Rejected`` for the first data-less named item (``MediaInput`` with ``uuid``
        and neither ``url`` nor ``data``) that the index does not hold now."""
        for m in media:
            if not m.uuid or m.url or m.data is not None:
                continue
            if self._index is None:
                raise Rejected.of(400, f"{m.param}: this server keeps no embedding cache, so a part with a uuid "
                                       "and no data cannot be served; send the item's data",
                                  param=m.param, code="unknown_media_uuid")
            key = item_key(self._fingerprint, m.kind, m.uuid, scope, min_pixels=m.min_pixels,
                           max_pixels=m.max_pixels, num_frames=m.num_frames, fps=m.fps)
            try:
                entry = await self._index.resolve(key)
            except Exception as exc:
                if not unavailable(exc):
                    raise
                raise Rejected(store_unavailable(exc), STORE_RETRY_AFTER_S) from None
            if entry is None:
                raise Rejected.of(400, f"{m.param}: no {m.kind} named {m.uuid!r} is cached for this caller (with "
                                       "these processing options); send its data with the uuid once",
                                  param=m.param, code="unknown_media_uuid")
