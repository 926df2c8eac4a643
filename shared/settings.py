"""Settings: read once in ``main``, then passed down; nothing else reads the environment or the
config file. Precedence, lowest first: defaults < a TOML file (``--config FILE`` or
``MMFLEET_CONFIG``; keys are setting names) < ``MMFLEET_<NAME>`` (``KAFKA_BOOTSTRAP`` and
``REDIS_URL`` too) < command-line flags. An unknown file key or ``MMFLEET_*`` variable is an error
that names it. Units are in the names (``_ms``, ``_bytes``, ``_s``). Each setting's
``msgspec.Meta`` description is the one source of ``mmfleet settings`` and of the table in
docs/guide/configuration.md (:mod:`shared.settings_doc`). ``model_path`` is the old name of
``model``; named so, the served model name stays ``mmfleet-demo``, else it defaults to ``model``
as given (vLLM's rule)."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec

from shared.settings_sglang import SglangSettings
from shared.settings_vllm import VllmSettings

ENV_PREFIX = "MMFLEET_"
CONFIG_ENV = "MMFLEET_CONFIG"  # path of a TOML config file; not a setting itself
_ALIASES = {"KAFKA_BOOTSTRAP": "kafka_bootstrap", "REDIS_URL": "redis_url"}
_OLD_NAMES = {"model_path": "model"}  # old setting name -> its name now (the new name wins when both are set)
_MiB = 1024 * 1024
VLLM_KV_BUFFER_DEVICES = ("auto", "cuda", "cpu")  # vllm_kv_buffer_device (shared.engines.vllm_pd)
EVENT_LOOPS = ("auto", "uvloop", "asyncio")  # event_loop (shared.process.aio.loop_factory)


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "mmfleet")


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class Settings(SglangSettings, kw_only=True, frozen=True):
    """Every knob of a process. Defaults fit the local demo on a 2-core machine. The vLLM and SGLang
    engines' serving knobs are inherited (:class:`shared.settings_vllm.VllmSettings` through
    :class:`shared.settings_sglang.SglangSettings`)."""

    # --- where things are
    kafka_bootstrap: Annotated[str, _d("Kafka bootstrap servers, host:port[,host:port...]")] = "127.0.0.1:9092"
    redis_url: Annotated[str, _d("Redis for token streams, claims, indexes and liveness")] = \
        "redis://127.0.0.1:6379/0"
    redis_prefix: Annotated[str, _d("prefix of every Redis key (several fleets can share one Redis)")] = "mm"
    # Redis answers in well under a millisecond here: a reply 2 s late is a stalled server, and
    # every client waiting on it should know within a bound it can plan around
    redis_timeout_ms: Annotated[int, _d(
        "longest wait for one Redis reply or connect (a blocking read: its block on top); past it the call "
        "fails: the gateway answers 503 with Retry-After, workers retry the record with backoff")] = 2_000
    model: Annotated[str, _d("the model: a local folder (config.json, weights, processor files) or a Hugging Face "
                             "hub id resolved offline in the local hub cache (HF_HUB_CACHE, else HF_HOME/hub); "
                             "empty: the tiny offline demo model, built once under cache_dir (old name: "
                             "model_path)")] = ""
    revision: Annotated[str, _d("with a hub id: the branch, tag or commit of the cached snapshot to serve")] = "main"
    hub_cache_dir: Annotated[str, _d("the Hugging Face hub cache hub ids are looked up in; empty: huggingface_hub's "
                                     "own (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)")] = ""
    demo_model: Annotated[str, _d("which tiny offline demo family to build and serve when model is empty: "
                                  "qwen2-vl (image + video), qwen2.5-vl (image + video), qwen2-audio (audio), "
                                  "llava (image), llava-next (image, anyres), llava-next-video (video); "
                                  "qwen2-vl:bench is a larger Qwen2-VL with a 2B-class VLM's encode / prefill / "
                                  "decode proportions, for benchmarks")] = "qwen2-vl"
    served_model_name: Annotated[str, _d("the model name clients must ask for; not given: the model setting as "
                                         "written (e.g. the hub id), mmfleet-demo for the demo model")] = \
        "mmfleet-demo"
    chat_template: Annotated[str, _d("chat template override: a Jinja file path or the template itself; empty: the "
                                     "model's own (the processor's chat_template.json / .jinja, else the "
                                     "tokenizer's)")] = ""
    trust_request_chat_template: Annotated[bool, _d("accept a chat_template in requests (the template runs "
                                                    "in Jinja's sandbox but costs gateway CPU); false: such "
                                                    "requests are a 400, as in vLLM")] = False
    cache_dir: Annotated[str, _d("where the demo model is built and cached (default "
                                 "$XDG_CACHE_HOME/mmfleet or ~/.cache/mmfleet)")] = \
        msgspec.field(default_factory=_default_cache_dir)
    gateway_host: Annotated[str, _d("address the gateway binds")] = "127.0.0.1"
    gateway_port: Annotated[int, _d("gateway HTTP port (also serves its /metrics)")] = 8000

    # --- Kafka
    topic_partitions: Annotated[int, _d("partitions per topic when `mmfleet topics` creates them; the most "
                                        "workers one stage can use")] = 4
    # Not "the broker's default": that is CreateTopics v4 (-1), beyond aiokafka (v0-v3), and asking
    # with DescribeConfigs upset the embedded tansu broker (a later consumer group hung).
    topic_replication_factor: Annotated[int, _d(
        "replicas per topic when `mmfleet topics` creates them (at most the brokers there are; "
        "3 is usual in production)")] = 1
    # How long the broker may hold a fetch when no data is waiting. The embedded tansu broker
    # does not answer a waiting fetch when data arrives, so this is the per-hop latency floor
    # there (p50 ~ half of it): 500 ms (aiokafka's default) adds ~250 ms per hop; 10 ms costs
    # ~5 ms per hop and roughly 10-20 % of a core across four idle consumers plus the broker.
    # Apache Kafka answers as soon as data arrives: raise this to 500 there.
    fetch_max_wait_ms: Annotated[int, _d("longest a broker may hold a fetch with no data; the per-hop latency "
                                         "floor with the embedded broker, use 500 with Apache Kafka")] = 10
    # Each commit is a Redis read (the broker epoch) and a broker round trip; a crash redelivers
    # at most this much finished work, which the ledger's done-marks skip.
    commit_interval_ms: Annotated[int, _d("a consumer commits finished records at most this often (stop and "
                                          "rebalance commit at once)")] = 100
    # The doorbell (shared/transport/doorbell.py) takes the broker's wait off the critical path: stage
    # consumers fetch with a 1 ms broker-side wait (tansu answers a 0 ms fetch with no records)
    # and sleep client-side until the upstream stage
    # rings (a Redis PUBLISH as its produce goes out) or the idle interval passes. A lost ring
    # costs at most the idle interval; the interval sets the idle fleet's polling CPU.
    doorbell: Annotated[bool, _d("stage consumers wait for a Redis pub/sub ring from the producing stage "
                                 "instead of a broker-side fetch wait; false: "
                                 "fetch_max_wait_ms polling")] = True
    idle_fetch_interval_ms: Annotated[int, _d("with the doorbell: how often an idle stage consumer fetches "
                                              "anyway (the most a lost ring costs)")] = 100
    # Early start (shared/transport/early.py): a ring carries a copy of the stage record produced with it and
    # the stage begins on the copy, holding every effect until Kafka delivers the record itself.
    early_start: Annotated[bool, _d("with the doorbell: rings carry a copy of each stage record and the next "
                                    "stage starts on it before Kafka delivers the record (its outputs wait for "
                                    "the record; its stream writes for the record or the broker's ack of it, "
                                    "which rings again)")] = True
    early_start_confirm_ms: Annotated[int, _d("an early-started record not delivered by Kafka within this is "
                                              "dropped (its claim released); the record runs when it comes")] = 5_000
    max_poll_records: Annotated[int, _d("records fetched per poll at most")] = 16
    # tansu holds a new consumer group's first join for half the session: this bounds start-up too
    kafka_session_timeout_ms: Annotated[int, _d("a consumer not heard from this long loses its partitions to "
                                                "its group (heartbeats every third of it)")] = 6_000
    stage_concurrency: Annotated[int, _d("records in flight per stage runner; beyond it partitions pause")] = 8
    max_attempts: Annotated[int, _d("failures of one record before it goes to mm.dead-letter")] = 3
    drain_timeout_ms: Annotated[int, _d("on SIGTERM, how long in-flight work may finish before it is "
                                        "cancelled (and redelivered)")] = 10_000
    stage_lease_ms: Annotated[int, _d("claim on (request, stage) while working; a crashed holder's claim "
                                      "lapses after this")] = 15_000
    done_ttl_s: Annotated[int, _d("how long 'this stage finished this request' is remembered")] = 3_600
    max_restarts: Annotated[int, _d("restarts of a request from its source after lost tensor owners, then "
                                    "a 503")] = 3

    # --- tensors (NIXL)
    pool_bytes: Annotated[int, _d("each process's NIXL-registered tensor pool, bytes")] = 256 * _MiB
    lease_ttl_ms: Annotated[int, _d("how long a tensor slot named in a message is kept unacknowledged")] = \
        120_000

    # --- embedding cache. Each encode worker keeps embeddings it computed in its
    # NIXL pool (pinned, LRU) and publishes them in a Redis index so any worker can reuse them.
    embedding_cache_bytes: Annotated[int, _d(
        "each encode worker's embedding cache in its NIXL pool, bytes (capped at pool_bytes/2); 0: no cache, "
        "no index, no coalescing (the uncached path)")] = 64 * _MiB
    embedding_cache_max_item_fraction: Annotated[float, _d(
        "an embedding larger than this share of embedding_cache_bytes is not cached")] = 0.25
    embedding_index_ttl_s: Annotated[int, _d(
        "TTL of a Redis index entry (a dead owner's entries last at most this long; readers fall back "
        "on a failed read anyway)")] = 600
    embedding_coalesce_lease_ms: Annotated[int, _d(
        "SET NX PX lease while one worker encodes an item others wait for; a dead holder's lapses")] = 10_000
    embedding_coalesce_wait_ms: Annotated[int, _d(
        "longest a request waits for another worker's encode of the same item before encoding it "
        "itself")] = 15_000
    prefill_embedding_cache_bytes: Annotated[int, _d(
        "prefill's LRU of recently pulled embeddings (multi-turn chats pull nothing again), bytes; "
        "0: off")] = 32 * _MiB

    # --- compute
    engine: Annotated[str, _d("language-model runtime: transformers | vllm | sglang")] = "transformers"
    vllm_kv_host: Annotated[str, _d(
        "address other workers reach this worker's vLLM KV side channel at (engine vllm, prefill apart from "
        "decode); auto: this host's address")] = "127.0.0.1"
    vllm_kv_buffer_device: Annotated[str, _d(
        "where a vLLM engine's NixlConnector keeps the KV blocks it moves (engine vllm, prefill apart from decode): "
        "auto (the worker's device) | cuda (NIXL reads GPU memory: fast only where UCX has a GPU transport, see "
        "`mmfleet doctor`) | cpu (vLLM stages the blocks through host memory)")] = "auto"
    torch_threads: Annotated[int, _d("torch intra-op threads per worker")] = 1
    event_loop: Annotated[str, _d(
        "the event loop of the gateway, the workers and `mmfleet up`: uvloop | asyncio (the standard "
        "library's) | auto (uvloop where it is installed)")] = "auto"
    compute_inline_max_ms: Annotated[float, _d(
        "CPU compute (media decode, encoder, prefill, decode steps) runs on the worker's event loop instead "
        "of its compute thread when that thread is idle and jobs of the same kind and size have lately "
        "taken at most this long: no thread hand-over; 0: always the compute thread")] = 20.0
    device: Annotated[str, _d("where this worker's encoder, prefill and decode compute: cpu | cuda | cuda:N "
                              "(a GPU asked for and not visible is a start-up error)")] = "cpu"
    dtype: Annotated[str, _d(
        "model dtype: auto | float32 | bfloat16 | float16 (the last three force it); auto: a bfloat16 or float16 "
        "checkpoint (as its config.json says) loads in its own dtype, any other in bfloat16 on CUDA and float32 on "
        "CPU; the vLLM engine's language model takes bfloat16 on CUDA and float32 on CPU whatever the "
        "checkpoint")] = "auto"
    transfer_cuda_ipc: Annotated[bool, _d(
        "a GPU worker also offers each tensor it ships in its GPU pool (the size of `MMFLEET_POOL_BYTES`, "
        "exported by CUDA IPC once), which a consumer on the same host and GPU copies from instead of the "
        "pinned-host copy")] = True
    transfer_host_shm: Annotated[bool, _d(
        "a CPU process's tensor pool is a shared memory file that consumers on the same host map and copy "
        "from instead of a NIXL READ (a GPU process's pool always is); false: NIXL only")] = True
    encode_max_batch_items: Annotated[int, _d(
        "media items per vision-encoder batch at most; 0: 1 on CPU (a CPU forward costs the sum of its items, so "
        "batching only delays the first ones), 16 on a GPU")] = 0
    encode_batch_wait_ms: Annotated[int, _d("how long encode waits to fill a batch")] = 2
    decode_max_batch: Annotated[int, _d("transformers engine: decode steps of up to this many sequences run as "
                                        "one batched forward; 1: one sequence per forward")] = 16
    decode_core: Annotated[bool, _d("transformers engine, a worker that decodes without prefill or encode: the "
                                    "decode steps and their sampling run in a child process of the worker (the "
                                    "decode core), so the worker's Kafka, Redis and NIXL work does not share a GIL "
                                    "with them; false: on a thread of the worker")] = True
    prefill_max_batch: Annotated[int, _d("transformers engine: fresh prompts that arrive while its model is busy "
                                         "are prefilled together, up to this many per forward; 1: one each")] = 8
    decode_concurrency: Annotated[int, _d("sequences a prefill+decode or decode worker generates at "
                                          "once")] = 16

    # --- requests
    request_timeout_ms: Annotated[int, _d("a request's deadline, carried by every message (504 past it)")] = \
        120_000
    # vllm serve's rules: a request without max_tokens may write to the end of the context
    default_max_tokens: Annotated[int, _d("caps max_tokens when a request names none (0: off, the model's "
                                          "max_new_tokens default, else the rest of its context, as vllm "
                                          "serve)")] = 0
    max_tokens_limit: Annotated[int, _d("largest max_tokens a request may ask for (0: the model's context); "
                                        "every budget is lowered to the context its prompt leaves")] = 0
    generation_config: Annotated[str, _d("sampling defaults for the fields a request leaves out, as vllm serve "
                                         "--generation-config: auto (the model's generation_config.json), "
                                         "vllm (none: the API's own defaults) or a folder holding one")] = "auto"
    max_request_bytes: Annotated[int, _d("largest HTTP request body, bytes (413 beyond)")] = 32 * _MiB
    max_media_items: Annotated[int, _d("media items per request at most")] = 8
    max_images_per_request: Annotated[int, _d("images per request at most (400 beyond; 0: only max_media_items "
                                              "bounds them), like vLLM's limit_mm_per_prompt")] = 0
    max_videos_per_request: Annotated[int, _d("videos per request at most (400 beyond; 0: no own limit)")] = 0
    max_audios_per_request: Annotated[int, _d("audio clips per request at most (400 beyond; 0: no own limit)")] = 0
    allow_extra_request_fields: Annotated[bool, _d(
        "accept (and ignore) request fields the OpenAI schema does not define; off: a 400 names the "
        "field")] = False
    # bounds checked before the template renders, the tokenizer runs or a grammar is built: each of
    # those costs gateway CPU in proportion to what the request brings
    max_request_json_values: Annotated[int, _d(
        "JSON values one request body may hold, counted by its commas before it is decoded (400 beyond): "
        "decoding builds an object per value while the gateway's other requests wait; 0: the model's context "
        "in tokens + 65,536")] = 0
    max_prompt_bytes: Annotated[int, _d(
        "text one request may bring to its prompt (message contents and names, tool-call arguments, a "
        "completions prompt), UTF-8 bytes, checked before rendering and tokenizing (400 beyond); 0: 32 bytes "
        "per token of the model's context")] = 0
    max_request_messages: Annotated[int, _d("messages per chat request (400 beyond); 0: the model's context in "
                                            "tokens (each message renders to one token at least)")] = 0
    max_stop_string_bytes: Annotated[int, _d("longest stop string, UTF-8 bytes (400 beyond)")] = 1024
    max_schema_bytes: Annotated[int, _d(
        "largest JSON Schema, bytes (400 beyond): response_format as sent, one tool's parameters as compact "
        "JSON; decoding it and building its grammar take time in proportion")] = 128 * 1024
    max_tools: Annotated[int, _d("tools per request (400 beyond)")] = 128
    max_tools_bytes: Annotated[int, _d("a request's tools together, bytes as sent (400 beyond)")] \
        = 256 * 1024
    request_body_timeout_ms: Annotated[int, _d("longest an HTTP request body may take to arrive once the request "
                                               "is admitted (it holds an in-flight slot meanwhile): 408 beyond")] \
        = 30_000
    max_inflight_requests: Annotated[int, _d("gateway admission bound: requests in flight (429 beyond)")] = 256
    queue_retry_ms: Annotated[int, _d(
        "how long the gateway keeps trying to queue a request while the broker is unreachable (a "
        "restart takes a few seconds) before it answers 503 with Retry-After")] = 15_000
    stream_maxlen: Annotated[int, _d("entries kept per request token stream in Redis")] = 100_000
    stream_ttl_s: Annotated[int, _d("how long a request's token stream lives in Redis")] = 600

    # --- media
    max_image_bytes: Annotated[int, _d("largest image, bytes (413 beyond)")] = 16 * _MiB
    max_image_pixels: Annotated[int, _d("largest image, pixels (decompression-bomb guard)")] = 40_000_000
    # Qwen2-VL's own default cap (max_pixels 12_845_056 = 16_384 tokens of 28x28 pixels)
    max_image_tokens: Annotated[int, _d("vision tokens one image may become by the mm_processor_kwargs "
                                        "min_pixels / max_pixels a request names (400 beyond; the model's "
                                        "context bounds them too)")] = 16_384
    media_fetch_timeout_ms: Annotated[int, _d("a whole media fetch, redirects included")] = 10_000
    # Matched on the name as written in the URL, never on what it resolves to.
    media_allow_hosts: Annotated[tuple[str, ...], _d(
        "comma-separated hosts ('host' or 'host:port') that may be fetched although they resolve to "
        "loopback/private addresses; empty: public addresses only")] = ()
    media_connect_timeout_ms: Annotated[int, _d("one TCP (+TLS) connect to a media host")] = 3_000
    media_read_timeout_ms: Annotated[int, _d("longest wait for the next bytes of a media response")] = 5_000
    media_max_redirects: Annotated[int, _d("redirects followed per media URL; each hop is re-checked")] = 3
    media_file_root: Annotated[str, _d("directory file:// media URLs may name (symlinks resolved); empty: "
                                       "file:// refused")] = ""
    media_cache_bytes: Annotated[int, _d("media-fetch LRU of fetched http(s) bytes, bytes; 0: off")] = 64 * _MiB
    media_cache_ttl_s: Annotated[int, _d("how long fetched bytes of a URL may be served from that cache")] = 300

    # --- video (decoded with PyAV in media-fetch's compute lane)
    max_video_bytes: Annotated[int, _d("fetched / inline bytes of one video (413 beyond)")] = 64 * _MiB
    max_video_duration_s: Annotated[float, _d("longer videos are refused (413) before any frame is "
                                              "decoded")] = 600.0
    max_video_frames: Annotated[int, _d("frames one video may give the model (num_frames / fps beyond it: "
                                        "400)")] = 32
    max_video_side: Annotated[int, _d("longest side of a video frame, pixels (413 beyond)")] = 4096
    # qwen-vl-utils' VIDEO_TOTAL_PIXELS (24_576 tokens of 28x28 pixels): 32 frames at its 768-token frame
    # cap, so a Qwen2-VL processor is handed no fewer pixels than it keeps
    max_video_pixels: Annotated[int, _d("pixels of one video's sampled frames together: frames are scaled "
                                        "down (aspect kept) while decoding to fit")] = 19_267_584
    video_num_frames: Annotated[int, _d("frames sampled uniformly over a video when the request names "
                                        "none")] = 8
    video_fps: Annotated[float, _d("> 0: sample this many frames per second when the request names no "
                                   "num_frames / fps (capped at max_video_frames); 0: video_num_frames")] = 0.0
    max_video_decoded_frames: Annotated[int, _d("frames PyAV may decode to find the sampled ones (bounds the "
                                                "CPU a high-frame-rate video costs)")] = 20_000
    # --- audio (soundfile / PyAV in media-fetch's compute lane, resampled to the model's rate)
    max_audio_bytes: Annotated[int, _d("fetched / inline bytes of one audio clip (413 beyond)")] = 16 * _MiB
    max_audio_duration_s: Annotated[float, _d("longer clips are refused (413); Qwen2-Audio hears 30 s at "
                                              "most")] = 30.0
    # --- precomputed embeddings (image_embeds / video_embeds / audio_embeds parts)
    max_embeds_bytes: Annotated[int, _d("decoded bytes of one embeddings payload (413 beyond), checked on its "
                                        "base64 length before decoding")] = 32 * _MiB
    embeds_torch_load: Annotated[bool, _d("take torch.save payloads (vLLM's form), read with torch.load("
                                          "weights_only=True) once their zip directory is within "
                                          "max_embeds_bytes; false: 400 naming npy / safetensors")] = True

    # --- who may send (HTTP and the Kafka ingress alike)
    api_key_hashes: Annotated[tuple[str, ...], _d(
        "API keys as lowercase hex sha256 (`mmfleet keys hash` prints one), each optionally "
        "<hash>:<requests per minute>; empty: no key needed (the local demo), set: every request "
        "must carry Authorization: Bearer <key> (HTTP or Kafka header)")] = ()
    api_key_rate_per_min: Annotated[int, _d(
        "requests per minute per key for keys without their own :<n>; 0: unlimited")] = 0
    cache_share_across_tenants: Annotated[bool, _d(
        "with API keys: requests of different keys share cache hits (embeddings, prefix KV, client media "
        "uuids); false: each key is its own cache scope, so no key can observe or reuse another's entries")] = False

    # --- Kafka ingress (mm.requests), run inside the gateway process
    ingress_enabled: Annotated[bool, _d("consume mm.requests in the gateway")] = True
    ingress_concurrency: Annotated[int, _d("requests in flight from Kafka per gateway; beyond it fetching waits")] = 64
    ingress_fallback_reply_topic: Annotated[str, _d(
        "where error replies go when a Kafka request names no usable reply_to or fails authentication; "
        "empty: mm.replies.errors")] = ""
    ingress_reply_topic_pattern: Annotated[str, _d(
        "regular expression a Kafka request's reply_to must match whole; the topic must also exist (the "
        "ingress never creates one) and never be one of the fleet's own topics"
    )] = r"mm\.replies\.[A-Za-z0-9._-]{1,200}"
    ingress_max_request_id_bytes: Annotated[int, _d(
        "longest request_id (record key) a Kafka request may carry, bytes (400 beyond)")] = 128
    ingress_dedupe_ttl_s: Annotated[int, _d("how long a request_id is remembered as answered")] = 86_400

    # --- transport security (every aiokafka client and every Redis client)
    kafka_security_protocol: Annotated[str, _d(
        "Kafka security protocol: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL")] = "PLAINTEXT"
    kafka_sasl_mechanism: Annotated[str, _d(
        "SASL mechanism: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (SASL_* protocols)")] = ""
    kafka_sasl_username: Annotated[str, _d("SASL user name (SASL_* protocols)")] = ""
    kafka_sasl_password: Annotated[str, _d("SASL password (a secret: redacted wherever settings are shown)")] = ""
    kafka_ssl_cafile: Annotated[str, _d("CA bundle to verify the brokers; empty: the system's")] = ""
    kafka_ssl_certfile: Annotated[str, _d("client certificate (mutual TLS)")] = ""
    kafka_ssl_keyfile: Annotated[str, _d("private key of kafka_ssl_certfile")] = ""
    kafka_ssl_check_hostname: Annotated[bool, _d("verify the broker's name against its certificate")] = True
    redis_username: Annotated[str, _d("Redis ACL user; empty: the default user")] = ""
    redis_password: Annotated[str, _d("Redis password (a secret: redacted wherever settings are shown)")] = ""
    redis_ssl_cafile: Annotated[str, _d("with a rediss:// URL: CA bundle to verify Redis")] = ""
    redis_ssl_certfile: Annotated[str, _d("with a rediss:// URL: client certificate")] = ""
    redis_ssl_keyfile: Annotated[str, _d("with a rediss:// URL: its private key")] = ""

    # --- KV-aware routing (shared.kv)
    routing_policy: Annotated[str, _d(
        "how producers of mm.prefill pick its partition: 'kv' (prefix overlap vs load, over the "
        "routing table in Redis) or 'round_robin' (next live prefill worker in turn, for "
        "comparison)")] = "kv"
    kv_block_size: Annotated[int, _d("prompt positions per KV block (hashing, prefix cache, routing)")] = 16
    # 2: a miss is compute the fleet pays in full, a queue is one request's wait (docs/benchmarks/results/bench-kv.json)
    kv_overlap_weight: Annotated[float, _d(
        "kv routing cost of a worker = weight * prompt blocks it would compute + blocks queued on "
        "it; higher weights favour cache hits over spreading load")] = 2.0
    prefix_cache_bytes: Annotated[int, _d(
        "prefill worker's prefix KV cache (LRU by block), in bytes; 0: off")] = 64 * _MiB
    kv_report_interval_ms: Annotated[int, _d(
        "how often a prefill worker refreshes its load + partitions in Redis")] = 500
    kv_report_ttl_ms: Annotated[int, _d("a prefill worker not heard from for this long is not routed to")] = 5_000

    # --- fleet layout (mmfleet up)
    stage_replicas: Annotated[str, _d(
        "worker processes per stage group, 'stage=N,...' (e.g. 'prefill=3,encode=2'); a group of "
        "several stages (mode e-pd, epd, ep-d) gets the largest count among its stages; default 1")] = ""

    # --- autoscaling (`mmfleet up --autoscale`; deploy/k8s/base/keda.yaml uses the same numbers)
    autoscale_min_workers: Annotated[int, _d("fewest workers per stage under --autoscale (KEDA minReplicaCount)")] = 1
    autoscale_max_workers: Annotated[int, _d("most workers per stage under --autoscale (KEDA maxReplicaCount); more "
                                             "than topic_partitions would sit idle")] = 4
    autoscale_lag_per_worker: Annotated[int, _d("consumer-group lag (records) one worker of a stage is sized for: "
                                                "wanted = ceil(lag / this) (KEDA lagThreshold)")] = 8
    autoscale_ttft_slo_ms: Annotated[int, _d("TTFT p99 the fleet aims for: above it, a stage of prefill or decode "
                                             "with more unfinished records than workers gets one more worker than "
                                             "its lag asks")] = 2_000
    autoscale_interval_ms: Annotated[int, _d("how often the autoscaler reads lag and TTFT")] = 1_000
    autoscale_scale_down_after_s: Annotated[float, _d("a stage shrinks only after wanting fewer workers this long, "
                                                      "then by one worker (hysteresis; KEDA's scale-down "
                                                      "stabilization window)")] = 30.0
    up_ready_timeout_s: Annotated[float, _d("how long `mmfleet up` waits for every worker group to serve, then as "
                                            "long for the gateway's /ready, before it gives up")] = 180.0
    zygote: Annotated[bool, _d("`mmfleet up` forks workers and the gateway from one process that has imported "
                               "torch, transformers and the model's code once (a zygote): each starts in about a "
                               "second instead of ~7 s of imports. false: each is its own `python -m` process")] = True

    # --- operations
    log_level: Annotated[str, _d("DEBUG, INFO, WARNING or ERROR")] = "INFO"
    log_format: Annotated[str, _d("text (human) or json (one object per line: ts, level, logger, pid, "
                                  "worker, stage, request_id, msg)")] = "text"
    metrics_host: Annotated[str, _d("address each worker's /metrics server binds (0.0.0.0 in "
                                    "containers)")] = "127.0.0.1"
    # 0 lets every worker on a host bind its own port; the bound port is in its liveness record.
    metrics_port: Annotated[int, _d("each worker's /metrics port; 0: an ephemeral port (published in its "
                                    "Redis liveness record); `mmfleet up` gives worker i port+i")] = 0
    # Past one host every advertised address must be the host's own (see shared/process/hostaddr.py).
    advertise_host: Annotated[str, _d("address other hosts reach this process at (liveness records, metrics URL, "
                                      "NIXL peer host); empty: metrics_host unless a wildcard, else the host "
                                      "name")] = ""
    nixl_progress_wake_ms: Annotated[int, _d("NIXL's progress thread sleeps on UCX's event fd, waking at least "
                                             "this often; 0: no thread, Python polls (1 ms after puts)")] = 100
    nixl_net_devices: Annotated[str, _d("UCX network devices NIXL may use (UCX_NET_DEVICES, e.g. eth0); empty: "
                                        "the device holding advertise_host when that is set, else UCX's "
                                        "choice")] = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            re.compile(self.ingress_reply_topic_pattern)
        except re.error as exc:
            raise ValueError(f"ingress_reply_topic_pattern is not a regular expression: {exc}") from None
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, not {self.log_format!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, not {self.log_level!r}")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event_loop must be one of {', '.join(EVENT_LOOPS)}; got {self.event_loop!r}")
        if self.vllm_kv_buffer_device not in VLLM_KV_BUFFER_DEVICES:
            raise ValueError(f"vllm_kv_buffer_device must be one of {', '.join(VLLM_KV_BUFFER_DEVICES)}; "
                             f"got {self.vllm_kv_buffer_device!r}")

    def with_overrides(self, **changes: Any) -> Settings:
        return msgspec.structs.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def __repr__(self) -> str:  # settings end up in logs and tracebacks: never with secrets
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in redacted(self).items()) + ")"

    __str__ = __repr__


def field_names() -> tuple[str, ...]:
    # msgspec puts a base's fields first: list the fleet's own first, then SGLang's knobs, the vLLM ones last
    own = tuple(n for n in Settings.__struct_fields__ if n not in SglangSettings.__struct_fields__)
    sglang = tuple(n for n in SglangSettings.__struct_fields__ if n not in VllmSettings.__struct_fields__)
    return own + sglang + VllmSettings.__struct_fields__


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """A TOML config file's settings. Keys are setting names (or old names, returned as they are
    written); an unknown key is an error."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {p} is not valid TOML: {exc}") from None
    names = set(field_names()) | set(_OLD_NAMES)
    for key in raw:
        if key not in names:
            raise ValueError(f"config file {p}: unknown setting {key!r}; known: {', '.join(sorted(names))}")
    return raw


def from_env(env: Mapping[str, str] | None = None, *, config_file: str | os.PathLike | None = None,
             **overrides: Any) -> Settings:
    """Build settings: defaults < config file < ``env`` (default: ``os.environ``) < ``overrides``.

    The config file is ``config_file`` or, when that is None, ``env[MMFLEET_CONFIG]`` if set.
    Unknown ``MMFLEET_*`` variables and unknown file keys are errors. Tuple settings take
    comma-separated values from the environment, and a list or a string from the file.
    """
    env = os.environ if env is None else env
    names = set(field_names())
    config_file = config_file if config_file is not None else (env.get(CONFIG_ENV) or None)
    # each source's settings under their names now, plus the old names it used ("model_path")
    raw, old_in_file = _new_names(dict(read_config(config_file)) if config_file else {})
    from_vars: dict[str, Any] = {}
    old_names: dict[str, Any] = {}
    for key, value in env.items():
        if key in _ALIASES:
            from_vars.setdefault(_ALIASES[key], value)
        elif key.startswith(ENV_PREFIX) and key != CONFIG_ENV:
            name = key[len(ENV_PREFIX) :].lower()
            if name in _OLD_NAMES:
                old_names[_OLD_NAMES[name]] = value
                continue
            if name not in names:
                raise ValueError(f"unknown setting {key}; known: {', '.join(sorted(names))}")
            from_vars[name] = value  # explicit MMFLEET_ wins over the alias
    old_in_env = set(old_names) - set(from_vars)
    raw.update({**old_names, **from_vars})
    for name, value in list(raw.items()):
        if name in ("media_allow_hosts", "api_key_hashes") and isinstance(value, str):
            raw[name] = tuple(h.strip() for h in value.split(",") if h.strip())
    overrides, old_in_flags = _new_names({k: v for k, v in overrides.items() if v is not None})
    raw.update(overrides)
    # as vLLM: clients ask for the model the operator named. Named by its old name (model_path),
    # the served name stays what it always was (mmfleet-demo): existing deployments keep working.
    by_old_name = "model" in (old_in_flags if "model" in overrides else
                              old_in_env if "model" in from_vars or "model" in old_names else old_in_file)
    if raw.get("model") and not raw.get("served_model_name") and not by_old_name:
        raw["served_model_name"] = raw["model"]
    return msgspec.convert(raw, Settings, strict=False)


def _new_names(values: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """``values`` under today's names (the new name wins over its old one) and the set of
    today's names that were given by their old name only."""
    out = {k: v for k, v in values.items() if k not in _OLD_NAMES}
    via_old = {new for old, new in _OLD_NAMES.items() if old in values and new not in values}
    out.update({new: values[old] for old, new in _OLD_NAMES.items() if new in via_old})
    return out, via_old


def _as_env(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def to_env(settings: Settings) -> dict[str, str]:
    """The environment that reproduces ``settings`` in a child process."""
    return {env_name(name): _as_env(getattr(settings, name)) for name in field_names()}


def child_env(settings: Settings) -> dict[str, str]:
    """Environment for a child process of the fleet: this process's environment without any
    ``MMFLEET_*`` / alias variables (``MMFLEET_CONFIG`` included: the child gets the effective
    settings, not the file), plus exactly ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) and k not in _ALIASES}
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 cores are shared by the whole fleet
    env.setdefault("HF_HUB_OFFLINE", "1")  # models are local paths; never reach for a hub
    env["PYTHONUNBUFFERED"] = "1"
    env.update(to_env(settings))
    return env


# settings whose values are secrets: shown as REDACTED (when set) by ``redacted``
SECRET_FIELDS: frozenset[str] = frozenset({"kafka_sasl_password", "redis_password"})
REDACTED = "***"


def redact_url(url: str) -> str:
    """``url`` with the password of its userinfo replaced (``redis://u:p@h`` → ``redis://u:***@h``)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return url
    userinfo, _, hostpart = rest.partition("@")
    user = userinfo.split(":", 1)[0] + (":" + REDACTED if ":" in userinfo else "")
    return f"{scheme}://{user}@{hostpart}"


def redacted(settings: Settings) -> dict[str, Any]:
    """Every setting by name, secrets replaced: what may be printed or logged."""
    out: dict[str, Any] = {}
    for name in field_names():
        value = getattr(settings, name)
        if name in SECRET_FIELDS and value:
            value = REDACTED
        elif name.endswith("_url") and isinstance(value, str):
            value = redact_url(value)
        out[name] = value
    return out
