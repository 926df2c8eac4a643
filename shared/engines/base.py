"""The engine contract (:class:`Engine`): what a stage needs from a model runtime, stated once.

Lifecycle: ``await start()`` once → any number of concurrent calls → ``await abort(request_id)``
at any time → ``await stop()`` once (idempotent). Every call is async; blocking work runs off the
event loop inside the engine. :class:`Capabilities` decide which stage layouts an engine serves
(checked at worker start-up, never mid-request). Closing a token stream (``aclose``) frees the
request's engine state. Greedy tokens of every engine equal transformers' ``generate()``.

Design: docs/design/architecture.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from shared import protocol
from shared.kv.prefix_cache import CacheChanges


class MediaEmbeds(NamedTuple):
    """Encoder output of one media item, in prompt order: embeddings ``[n_tokens, hidden]``
    float32, Qwen's ``grid_thw`` (``(0, 0, 0)`` for families without one) and the modality,
    which picks the placeholder the embeddings replace."""

    embeds: torch.Tensor
    grid_thw: tuple[int, int, int]
    kind: str = "image"
    second_per_grid_t: float = 0.0  # Qwen2.5-VL videos: their M-RoPE time step (protocol.PixelItem)
    mm_hash: str = ""  # BLAKE3 of the item's bytes (shared.kv.blocks); engines with their own caches key on it
    # the item's prompt tokens; 0: ``embeds``' rows (a raw item, e.g. decoded frames, has its own count)
    n_tokens: int = 0



class SampledToken(int):
    """A token id that also carries its ``protocol.TokenLogprob`` (requests with
    ``sampling.logprobs``): engines yield these instead of plain ints, so every consumer of a
    token stream keeps working on ids while the stream writer can record the logprobs."""

    logprob: protocol.TokenLogprob

    def __new__(cls, logprob: protocol.TokenLogprob) -> SampledToken:
        tok = super().__new__(cls, logprob.token_id)
        tok.logprob = logprob
        return tok


@dataclass(frozen=True)
class Capabilities:
    """``encode``: media (image, video, audio) → embeddings (the encode stage). ``generate``: prompt
    (+ embeddings) → tokens, prefill and decode in one place (PD and EPD). ``kv_export`` /
    ``kv_import``: prefill here, decode elsewhere (E/P/D, EP/D): ``prefill`` returns the packed KV
    cache, ``decode`` continues from one."""

    encode: bool
    generate: bool
    kv_export: bool
    kv_import: bool
    # ``prefill(prefix_kv=...)`` reuses a given prompt prefix's KV (the prefill worker's own
    # prefix cache, shared.kv); engines without it (vLLM: its own prefix caching) compute all
    prefix_kv: bool = False
    # ``prefill`` leaves the KV inside the engine and returns its descriptor (``engine_kv``);
    # ``decode_remote`` has the consumer's engine read it (vLLM's NixlConnector). Without it
    # the KV is a packed tensor that the stages move through their own NIXL pools.
    remote_kv: bool = False
    # the engine keeps its own prefix cache and reports what it stored / evicted, keyed by the
    # block hashes the caller gives ``prefill(block_keys=...)``, in ``PrefillOutput.kv_changes``
    kv_events: bool = False
    # ``decode``'s tokens come from another process that steps without waiting for the reader
    # (they queue in this one): the stream writer needs no look-ahead task of its own
    decodes_ahead: bool = False
    # the engine's own prefix cache takes a per-request scope: ``prefill`` and ``generate`` accept
    # ``cache_salt`` (the request's cache scope, tenant and cache_salt), and no request reuses
    # another scope's cached blocks (vLLM's ``cache_salt``); engines without it keep no cache of
    # their own, or one the fleet keys by the scope itself (shared.kv)
    cache_salt: bool = False


@dataclass(frozen=True)
class PrefillOutput:
    """``kv``: packed float32 ``[layers, 2, kv_heads, prompt_len, head_dim]``; None when the
    engine keeps the KV itself (``capabilities.remote_kv``) and ``engine_kv`` describes it."""

    first_token: int
    kv: torch.Tensor | None
    rope_delta: int
    prompt_len: int
    engine_kv: protocol.EngineKv | None = None
    cached_tokens: int = 0  # prompt positions the engine's own prefix cache gave (kv_events engines)
    # the engine's prefix-cache changes since its last report, in the caller's block keys
    kv_changes: CacheChanges | None = None


class EngineError(RuntimeError):
    """The engine cannot serve this request (e.g. prompt too long for its cache)."""


class Engine(Protocol):
    """The consumer stops a token stream early (stop string, client gone) by closing the iterator.
    Sampling is applied in prefill's first token as in decode's (penalties, ``logit_bias``,
    ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ...); with ``sampling.logprobs`` the tokens
    yielded are :class:`SampledToken` (id + logprob)."""

    name: str
    capabilities: Capabilities
    max_model_len: int
    eos_token_ids: frozenset[int]
    tokenizer: object

    async def start(self) -> None: ...  # one that returns before it can serve also has ``async def started()``

    async def stop(self) -> None: ...

    async def abort(self, request_id: str) -> None: ...

    async def encode(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int], n_tokens: int,
                     kind: str = "image", meta: tuple[int, ...] = ()) -> torch.Tensor:
        """One item's embeddings (``kind``: its modality, ``meta``: its family-specific
        geometry, see ``protocol.PixelItem``); concurrent calls are batched."""
        ...

    def generate(self, request_id: str, prompt_ids: list[int], media: list[MediaEmbeds],
                 sampling: protocol.Sampling, resume: tuple[int, ...] = ()) -> AsyncIterator[int]:
        """Prefill + decode; yields completion tokens (eos included when produced).
        ``resume``: the completion's first tokens from an earlier attempt, yielded as they are
        (not re-sampled), after which generation continues."""
        ...

    async def prefill(self, request_id: str, prompt_ids: list[int], media: list[MediaEmbeds],
                      sampling: protocol.Sampling, prefix_kv: torch.Tensor | None = None) -> PrefillOutput:
        """``prefix_kv``: packed KV of the expanded prompt's first positions (fewer than all),
        only with ``capabilities.prefix_kv``; the output's ``kv`` covers the whole prompt.
        Engines with ``capabilities.kv_events`` also take ``block_keys``: the prompt's block
        hashes (:func:`shared.kv.blocks.block_hashes`, as the router computes them)."""
        ...

    def decode_remote(self, request_id: str, prompt_ids: list[int], kv: protocol.EngineKv, first_token: int,
                      sampling: protocol.Sampling, resume: tuple[int, ...] = ()) -> AsyncIterator[int]:
        """``decode`` for ``capabilities.remote_kv``: the engine reads the prompt's KV from the
        producing engine named in ``kv`` (OwnerGoneError when it cannot: producer gone, lease
        passed), then continues as ``decode`` does."""
        ...

    def decode(self, request_id: str, kv: torch.Tensor, rope_delta: int, prompt_len: int, first_token: int,
               sampling: protocol.Sampling, resume: tuple[int, ...] = (),
               prompt_ids: tuple[int, ...] = ()) -> AsyncIterator[int]:
        """Continue after ``first_token`` (not yielded again); yields the following tokens,
        the first ``len(resume)`` of them forced to ``resume``. ``prompt_ids``: the request's
        prompt tokens, for the sampling controls that look at them (``repetition_penalty``)."""
        ...
