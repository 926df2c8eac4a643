"""Every message on the fleet's wire: Kafka records and Redis stream entries. Each topic carries
one tagged type, msgpack-encoded, decoded with its typed decoder (:func:`decoder_for`); token
streams hold :class:`StreamEvent`. No tensors ride in messages: records carry :class:`TensorRef`
descriptors and the owner's :class:`AgentRef`, a few KiB whatever the media. New fields get
defaults; fields are never renamed or re-typed. The three private parent-child protocols over a
socket pair (the zygote's, the decode core's, the transfer probe's) live beside the one parent
and child that speak them and never cross a host. Design: docs/design/architecture.md.
"""

from __future__ import annotations

from typing import Union

import msgspec
from msgspec import Struct

# ---------------------------------------------------------------- common parts


class StructuredOutput(Struct, frozen=True):
    """A grammar the completion must follow: ``kind`` "json_object" (any JSON object) or
    "json_schema" (``schema``: the JSON Schema, as JSON text)."""

    kind: str
    schema: str = ""


class Sampling(Struct, frozen=True, kw_only=True):
    """Decoding parameters, validated by the gateway (ranges are checked there); every engine
    applies all of them, the same way in prefill (first token) and decode (the rest): see
    :mod:`shared.engines.sampling`. Defaults are "off"."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0  # on completion tokens
    frequency_penalty: float = 0.0  # on completion tokens
    repetition_penalty: float = 1.0  # on prompt and completion tokens (vLLM's / CTRL's)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # stop tokens (eos, stop_token_ids) masked until this many are generated
    ignore_eos: bool = False  # eos does not end the completion
    stop_token_ids: tuple[int, ...] = ()  # end the completion like eos (the token gets no text)
    logprobs: int | None = None  # None: off; k: each token's logprob and the k most likely (raw logits)
    structured: StructuredOutput | None = None  # constrained decoding (shared.engines.structured)


class AgentRef(Struct, frozen=True):
    """A NIXL agent: its unique name and the metadata a peer needs to connect (~0.5 KiB)."""

    name: str
    metadata: bytes
    host: str = ""  # the owner's advertised host: a puller elsewhere counts its READs as cross-host


class CudaIpcHandle(Struct, frozen=True):
    """A GPU copy of a tensor that another process on the same host opens by CUDA IPC: the raw
    fields of torch's ``UntypedStorage._share_cuda_()`` for the owner's GPU pool (no pickle),
    where it lives, and the slot's offset in it."""

    host: str  # shared.process.device.host_id() of the owner: only that host may open it
    device_uuid: str  # the GPU, independent of CUDA_VISIBLE_DEVICES
    handle: bytes  # cudaIpcMemHandle of the allocation holding the storage
    storage_bytes: int
    offset_bytes: int  # of the storage inside that allocation
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    slot_offset: int = 0


class HostShm(Struct, frozen=True):
    """The owner's pool as a file another process of the same host maps (a memfd under
    ``/proc/<pid>/fd``), and the slot's offset in it (see :mod:`shared.transfer.host_shm`).
    ``inode``: the memfd's, so a consumer that opens the path in another pid namespace (same host
    name and kernel, another process behind that pid) does not map some other file."""

    host: str  # shared.process.device.host_id() of the owner
    path: str
    pool_bytes: int
    offset: int
    inode: int = 0


class TensorRef(Struct, frozen=True):
    """A tensor held in a slot of its owner's registered pool.

    ``(addr, nbytes, device_id)`` is the raw NIXL descriptor of memory kind ``mem`` (``"DRAM"``:
    the owner's pinned-or-plain host pool, the always-works path). ``lease`` identifies the
    slot at the owner: the consumer releases it (a NIXL notification) once its own output is
    durable; the owner also frees it after a TTL so a lost consumer cannot pin memory.
    ``on_device``: the owner's tensor was on a GPU (staged into the host pool); a consumer with
    a GPU gets it on its GPU. ``cuda_ipc``: the same bytes as a GPU copy held under the same
    lease, for a consumer on the same host and GPU (see :mod:`shared.transfer.cuda_ipc`).
    ``host_shm``: the slot as a shared pinned mapping, for a GPU consumer on the same host.
    ``stamp`` (non-zero: a GPU tensor whose copy into the slot may still be running, in chunks
    of ``chunk_bytes``): read the staging word after the data first (:mod:`shared.transfer.staging`).
    """

    agent: str
    addr: int
    nbytes: int
    device_id: int
    lease: int
    dtype: str
    shape: tuple[int, ...]
    mem: str = "DRAM"
    on_device: bool = False
    cuda_ipc: CudaIpcHandle | None = None
    host_shm: HostShm | None = None
    stamp: int = 0
    chunk_bytes: int = 0


class MediaSource(Struct, frozen=True, kw_only=True):
    """One media item of a request, in prompt order.

    Exactly one of: ``url`` (``http(s)://``, fetched by media-fetch) or ``inline`` (the raw
    bytes of a ``data:`` URL, decoded by the gateway and held in its pool, so inline media
    never rides on Kafka). ``param``: the request's JSON path, for error messages.
    """

    kind: str  # a modality: "image" | "video" | "audio" (see shared.models.registry)
    param: str
    url: str = ""
    inline: TensorRef | None = None
    mime: str = ""
    # video sampling asked by the request (0: the server's default, settings video_num_frames)
    num_frames: int = 0
    fps: float = 0.0  # > 0: sample this many frames per second instead (capped by max_video_frames)
    # images (Qwen2-VL): the request's pixel budget (mm_processor_kwargs / detail; 0: the processor's)
    min_pixels: int = 0
    max_pixels: int = 0
    # kinds "image_embeds" / "video_embeds" / "audio_embeds" (precomputed embeddings, ``mime`` "npy",
    # checked by the gateway): the grid they were encoded with (Qwen2-VL positions need it; (0, 0, 0)
    # for other families) and a Qwen2.5-VL video's time step
    grid_thw: tuple[int, int, int] = (0, 0, 0)
    second_per_grid_t: float = 0.0
    # the client's name for the item (vLLM's part ``uuid``): its identity in every cache, within
    # the request's ``cache_scope``; with neither ``url`` nor ``inline`` the item is what the
    # embedding index holds under that name
    uuid: str = ""


class StageSpan(Struct, frozen=True):
    """Where one stage spent a request's time (ms). ``queue_ms``: from the upstream produce to
    this stage picking the record up (0 for an in-process hand-over); ``transfer_ms``: NIXL
    pulls/puts and media fetches; ``total_ms``: handler start to end; the rest is compute.
    ``claim_ms``: the runner's Redis round trips before the handler (abort check, claim);
    ``start_unix_ms``: handler start (wall clock); ``first_out_ms``: handler start → the
    request's first token written to its stream (0 where this stage wrote none)."""

    stage: str
    worker: str
    queue_ms: float
    transfer_ms: float
    total_ms: float
    claim_ms: float = 0.0
    start_unix_ms: float = 0.0
    first_out_ms: float = 0.0


class RequestMeta(Struct, frozen=True, kw_only=True):
    """What every stage needs to know about a request besides its payload.

    ``deadline_unix_ms``: wall-clock epoch ms after which work is dropped with a terminal
    error (stages compare against their own clock, so hosts must be NTP-synchronised).
    ``attempt`` counts restarts from the source after a lost tensor owner.
    """

    request_id: str
    model: str
    deadline_unix_ms: int
    created_unix_ms: int
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling = Sampling()
    attempt: int = 0
    spans: tuple[StageSpan, ...] = ()  # one per stage passed so far
    # the request's origin, so any stage can restart it from media-fetch when a tensor it
    # needs is gone with its owner (``attempt`` counts such restarts)
    sources: tuple[MediaSource, ...] = ()
    source_owner: AgentRef | None = None
    # the request's cache scope (tenant and cache_salt, ``shared.embcache.identity.scope_of``):
    # in every media item's hash and at the root of its KV block hashes; "": the fleet-wide one
    cache_scope: str = ""


class PixelItem(Struct, frozen=True):
    """Preprocessed media of one item, ready for the encoder.

    ``kind``: the modality ("image", "video", "audio"). ``grid_thw``: Qwen2-VL's patch grid
    (t, h, w) for images and videos; families without one put ``(0, 0, 0)`` there and their
    geometry in ``meta`` (family-specific integers, e.g. an audio clip's valid feature frames).
    ``pixels`` holds the processor output (pixel values, or audio features). ``cache_key``: the
    item's key in the embedding cache (mm_hash + model + processor identity); empty: do not cache.
    """

    index: int
    mm_hash: str
    grid_thw: tuple[int, int, int]
    n_tokens: int
    pixels: TensorRef
    cache_key: str = ""
    kind: str = "image"
    meta: tuple[int, ...] = ()
    # Qwen2.5-VL videos: seconds one temporal patch spans (its M-RoPE time step); 0 otherwise
    second_per_grid_t: float = 0.0
    # the embedding cache's encode lease for ``cache_key``, taken by media-fetch in its index
    # round trip when encode runs in its worker (shared.embcache.coalesce); empty: encode takes its own
    lease_holder: str = ""


class EmbeddingItem(Struct, frozen=True):
    """Encoder output of one item: ``n_tokens`` rows of the LM's hidden size. ``kind`` and
    ``meta`` as in :class:`PixelItem` (prefill needs the kind to pick the placeholder).

    ``cache_key``: the item's embedding-cache key (empty when not cached). ``cache_gen``
    non-zero: ``embeds`` names a slot pinned by the owner's cache WITHOUT a lease (``lease ==
    0``, found through the index); the reader must check after its pull that the index entry
    for ``cache_key`` still carries this generation (else the slot may have been reused)."""

    index: int
    mm_hash: str
    grid_thw: tuple[int, int, int]
    n_tokens: int
    embeds: TensorRef
    cache_key: str = ""
    cache_gen: int = 0
    kind: str = "image"
    meta: tuple[int, ...] = ()
    second_per_grid_t: float = 0.0  # as in PixelItem


class EmbeddingIndexEntry(Struct, frozen=True):
    """The embedding index's value (Redis, ``RedisKeys.embedding_index``): who holds the
    embedding of a cache key, where (``embeds``, ``lease == 0``), and the entry's generation
    (unique per insert; readers validate their pull against it)."""

    owner: AgentRef
    embeds: TensorRef
    grid_thw: tuple[int, int, int]
    n_tokens: int
    gen: int
    created_unix_ms: int = 0
    # the rest of the item's geometry (``PixelItem``'s), so a client-named item served from the
    # index alone (no data in the request) becomes the same prompt as when it was encoded
    meta: tuple[int, ...] = ()
    second_per_grid_t: float = 0.0


# ---------------------------------------------------------------- stage messages


class MediaFetchRequest(Struct, frozen=True, tag="media_fetch.request"):
    """gateway → media-fetch: fetch, hash and preprocess every item.

    ``owner``: the gateway agent holding ``inline`` items (None when all items are URLs).
    """

    meta: RequestMeta
    items: tuple[MediaSource, ...]
    owner: AgentRef | None = None


class EncodeRequest(Struct, frozen=True, tag="encode.request"):
    """media-fetch → encode: pixels by descriptor, owned by ``owner``. ``cached``: items the
    embedding index already holds (lease-less refs, owned by ``cached_owners``), passed on to
    prefill as they are; ``items`` and ``cached`` together hold each prompt index once."""

    meta: RequestMeta
    owner: AgentRef
    items: tuple[PixelItem, ...]
    cached: tuple[EmbeddingItem, ...] = ()
    cached_owners: tuple[AgentRef, ...] = ()


class RouteNote(Struct, frozen=True, kw_only=True):
    """The KV router's decision for one prefill record (``shared.kv.router``), carried in the
    record so that the prefill worker writes the routing note whole (``shared.kv.audit``)."""

    policy: str
    worker: str
    overlap: int = 0
    best: int = 0
    cost: float = 0.0
    load: float = 0.0
    candidates: int = 0
    blocks: int = 0
    t_ms: int = 0


class RouteOutcome(Struct, frozen=True, kw_only=True):
    """What a prefill worker saw of one routed record (``shared.kv.audit``), kept in Redis as JSON
    under ``RedisKeys.kv_route``: the router's decision (None: the record carried none), the
    worker it ran on, the prompt blocks its cache held, and why (``hit``, ``cold``, ``load``,
    ``evicted``, ``moved``, ``unrouted``)."""

    route: RouteNote | None = None
    ran_on: str
    hit: int
    cause: str


class PrefillRequest(Struct, frozen=True, tag="prefill.request"):
    """gateway / encode → prefill. ``owners`` holds every agent named in ``items``; ``route``:
    the router's decision, when it picked the partition."""

    meta: RequestMeta
    owners: tuple[AgentRef, ...] = ()
    items: tuple[EmbeddingItem, ...] = ()
    route: RouteNote | None = None


class MediaShape(Struct, frozen=True):
    """A prompt item's geometry without its data: enough for an engine to rebuild the prompt's
    positions (Qwen's M-RoPE needs ``grid_thw``) when the item's KV comes from elsewhere."""

    kind: str
    grid_thw: tuple[int, int, int]
    n_tokens: int
    second_per_grid_t: float = 0.0  # as in PixelItem: a Qwen2.5-VL video's positions step by it


class EngineKv(Struct, frozen=True, kw_only=True):
    """KV that stays inside the producing engine until the consumer's engine reads it: vLLM's
    ``kv_transfer_params`` (NixlConnector, pull mode), typed. The producer keeps the blocks
    (delay-freed) until they are read or ``lease`` passes; ``remote_*`` names its engine, its
    request, its side channel (NIXL handshake) and its block ids per KV-cache group;
    ``remote_num_tokens`` is how many prompt positions they hold. ``media``: the prompt's items
    in order, so the consumer can rebuild positions without the embeddings."""

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: tuple[tuple[int, ...], ...]
    remote_num_tokens: int
    tp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1
    transfer_mode: str = ""
    media: tuple[MediaShape, ...] = ()


class TokenLogprob(Struct, frozen=True):
    """A sampled token's log-probability under the model's raw logits (before penalties,
    temperature and filtering, as vLLM's default ``raw_logprobs``), and the ``top`` most likely
    tokens there as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class DecodeRequest(Struct, frozen=True, tag="decode.request"):
    """prefill → decode: KV by descriptor plus the first sampled token.

    ``kv`` is one packed float32 tensor ``[layers, 2, kv_heads, prompt_len, head_dim]``;
    ``rope_delta`` is the M-RoPE offset decode positions need (0 for text-only prompts).
    With ``engine_kv`` set the KV stayed in the prefill worker's engine (vLLM): ``kv`` is then
    an empty ref (``nbytes == 0``, ``lease == 0``: nothing in the pool to pull or release) and
    the decode engine reads the blocks itself.
    """

    meta: RequestMeta
    owner: AgentRef
    kv: TensorRef
    prompt_len: int
    rope_delta: int
    first_token: int
    cached_tokens: int = 0  # prompt positions whose KV came from prefill's prefix cache
    engine_kv: EngineKv | None = None
    first_logprob: TokenLogprob | None = None  # with ``sampling.logprobs``: the first token's


def empty_tensor_ref(agent: str) -> TensorRef:
    """A ref naming no bytes (``DecodeRequest.kv`` when the KV travels engine to engine)."""
    return TensorRef(agent=agent, addr=0, nbytes=0, device_id=0, lease=0, dtype="float32", shape=(0,))


class DeadLetter(Struct, frozen=True, tag="dead_letter"):
    """A record a stage gave up on: where it came from, why, and the original bytes."""

    topic: str
    partition: int
    offset: int
    error: str
    attempts: int
    value: bytes


class CarriedRecord(Struct, frozen=True, tag="doorbell.carried"):
    """A doorbell ring's payload: a copy of the stage record produced with it (``value``, the
    record's bytes, bound for ``partition``), so the stage can start before Kafka delivers it
    (``shared.transport.early``). ``sent_unix_ms``: when the producer sent it (the record's queue start)."""

    partition: int
    sent_unix_ms: int
    value: bytes


class AckedRecord(Struct, frozen=True, tag="doorbell.acked"):
    """A second ring's payload, once the broker acked a carried record (``CarriedRecord``): the
    record is in Kafka (``partition``, ``offset``), so an early run of it (``request_id`` at
    ``attempt``) may show its stream writes before its own fetch delivers it (``shared.transport.early``)."""

    partition: int
    offset: int
    request_id: str
    attempt: int


RingPayload = CarriedRecord | AckedRecord


class WorkerInfo(Struct, frozen=True):
    """A worker's liveness record in Redis (refreshed with a TTL while it holds partitions)."""

    worker_id: str
    stages: tuple[str, ...]
    pid: int
    host: str
    started_unix_ms: int
    metrics_port: int = 0  # where its /metrics server listens on ``host`` (0: none / not known)
    metrics_url: str = ""  # http://<advertised host>:<metrics_port>/metrics (empty: an older worker)


class GatewayInfo(Struct, frozen=True):
    """A gateway's liveness record in Redis: ``url`` serves the OpenAI API and ``/metrics``."""

    gateway_id: str
    url: str
    pid: int
    host: str
    started_unix_ms: int


class FleetInfo(Struct, frozen=True):
    """Who owns a fleet's broker, gateway port and Redis prefix: one ``mmfleet up`` supervisor
    (its claims, ``services.fleet_claims``; what a second fleet's refusal names)."""

    fleet_id: str
    pid: int
    host: str
    gateway_url: str
    kafka_bootstrap: str
    redis_prefix: str
    started_unix_ms: int


# ---------------------------------------------------------------- token stream events


class Usage(Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of prompt_tokens, reused from a prefix cache (OpenAI prompt_tokens_details)


class TokenDelta(Struct, frozen=True, tag="delta", tag_field="event"):
    """``seq``: index of the first token in ``token_ids`` within the completion, so a reader (or a
    resumed decode) knows exactly which tokens were already written. Every stream entry holds one
    ``StreamEvent`` member in the ``e`` field."""

    seq: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, with ``sampling.logprobs``


class Finish(Struct, frozen=True, tag="finish", tag_field="event"):
    """Terminal success. ``reason``: "stop" (eos or stop string) or "length". ``spans``: the
    request's path through the stages, for latency breakdowns."""

    reason: str
    usage: Usage
    spans: tuple[StageSpan, ...] = ()


class ErrorEvent(Struct, frozen=True, tag="error", tag_field="event"):
    """Terminal failure, in OpenAI's error vocabulary; ``status`` is the HTTP status to use."""

    status: int
    type: str
    message: str
    param: str | None = None
    code: str | None = None


StreamEvent = Union[TokenDelta, Finish, ErrorEvent]

# ---------------------------------------------------------------- codecs

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[object, msgspec.msgpack.Decoder] = {}


def encode(msg: Struct) -> bytes:
    """msgpack bytes of one message."""
    return _encoder.encode(msg)


def decoder_for(union: object) -> msgspec.msgpack.Decoder:
    """One reused typed decoder per union (raises ``msgspec.DecodeError`` on bad input)."""
    dec = _decoders.get(union)
    if dec is None:
        dec = _decoders[union] = msgspec.msgpack.Decoder(union)
    return dec


def decode_event(raw: bytes) -> StreamEvent:
    return decoder_for(StreamEvent).decode(raw)
