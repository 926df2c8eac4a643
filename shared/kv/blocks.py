"""Content-addressed KV block hashes of a prompt (:func:`block_hashes`). The prompt is taken as
the language model sees it (each placeholder expanded to its item's ``n_tokens`` positions) and
cut into blocks of ``block_size`` positions; a trailing partial block has no hash. Block ``i``'s
hash is BLAKE3(parent hash, the block's token ids, the sorted ``mm_hash`` es of every media item
with a position in it), as a u64: a hash names a whole prefix, two different images behind
identical placeholders never share a block, and the same image from two URLs does. A request's
cache scope (``salt``: its tenant and ``cache_salt``) seeds the chain, so requests of two scopes
never share a block, text-only ones included. The router
and the prefill worker hash with this one function from the same message, so they agree.

Design: docs/design/kv-routing.md.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Sequence
from typing import Protocol

import blake3
import numpy as np


class MediaSpan(Protocol):
    """What a block hash needs of one media item (``EmbeddingItem`` fits)."""

    index: int
    mm_hash: str
    n_tokens: int


def expand(prompt_ids: Sequence[int], items: Sequence[MediaSpan], placeholder_id: int | Collection[int]
           ) -> tuple[list[int], list[tuple[int, int, str]]]:
    """(expanded token ids, [(start, end, mm_hash)] of each item's positions).

    ``placeholder_id``: the media placeholder token(s) of the model (image, video, audio: one
    per modality it takes). The i-th placeholder (in prompt order) takes the item of i-th lowest
    ``index``, whatever its modality; placeholders beyond the items (e.g. a text-only prompt
    that spells one) stay single tokens.
    """
    ids = {placeholder_id} if isinstance(placeholder_id, int) else set(placeholder_id)
    ordered = sorted(items, key=lambda it: it.index)
    out: list[int] = []
    spans: list[tuple[int, int, str]] = []
    k = 0
    for tok in prompt_ids:
        if tok in ids and k < len(ordered):
            item = ordered[k]
            k += 1
            spans.append((len(out), len(out) + item.n_tokens, item.mm_hash))
            out.extend([tok] * item.n_tokens)
        else:
            out.append(tok)
    return out, spans


def block_hashes(prompt_ids: Sequence[int], items: Sequence[MediaSpan], *, placeholder_id: int | Collection[int],
                 block_size: int, salt: str = "") -> list[int]:
    """One u64 hash per whole block of the expanded prompt, in order; ``salt`` "": unscoped."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens, spans = expand(prompt_ids, items, placeholder_id)
    arr = np.asarray(tokens, dtype=np.int64)
    hashes: list[int] = []
    parent = int.from_bytes(blake3.blake3(b"salt\0" + salt.encode()).digest(8), "little") if salt else 0
    for b in range(len(tokens) // block_size):
        lo, hi = b * block_size, (b + 1) * block_size
        media = sorted(h for start, end, h in spans if start < hi and end > lo)
        h = blake3.blake3(struct.pack("<Q", parent))
        h.update(arr[lo:hi].tobytes())
        for mm_hash in media:
            h.update(b"\x00" + mm_hash.encode())
        parent = int.from_bytes(h.digest(8), "little")
        hashes.append(parent)
    return hashes
