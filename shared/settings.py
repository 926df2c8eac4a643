"""Settings: read once in ``main`` (environment ``MMFLEET_<NAME>``, then CLI overrides), then
passed down. Nothing else in the code base reads the environment.

Units are in the names (``_ms``, ``_bytes``, ``_s``). ``KAFKA_BOOTSTRAP`` and ``REDIS_URL``
are honoured as well-known aliases of ``MMFLEET_KAFKA_BOOTSTRAP`` / ``MMFLEET_REDIS_URL``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

ENV_PREFIX = "MMFLEET_"
_ALIASES = {"KAFKA_BOOTSTRAP": "kafka_bootstrap", "REDIS_URL": "redis_url"}
_MiB = 1024 * 1024


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "mmfleet")


class Settings(msgspec.Struct, kw_only=True, frozen=True):
    """Every knob of a process. Defaults fit the local demo on a 2-core machine."""

    # --- where things are
    kafka_bootstrap: str = "127.0.0.1:9092"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "mm"
    model_path: str = ""  # empty: the tiny offline demo model named by demo_model, built once under cache_dir
    # which tiny offline demo family to build and serve when model_path is empty (see
    # shared.models.registry.DEMOS): qwen2-vl (image + video) | qwen2-audio (audio) | llava (image) | llava-next-video (video)
    demo_model: str = "qwen2-vl"
    served_model_name: str = "mmfleet-demo"
    cache_dir: str = msgspec.field(default_factory=_default_cache_dir)
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8000

    # --- Kafka
    topic_partitions: int = 4
    # How long the broker may hold a fetch when no data is waiting. The embedded tansu broker
    # does not answer a waiting fetch when data arrives, so this is the per-hop latency floor
    # there (p50 ~ half of it): 500 ms (aiokafka's default) adds ~250 ms per hop; 10 ms costs
    # ~5 ms per hop and roughly 10-20 % of a core across four idle consumers plus the broker.
    # Apache Kafka answers as soon as data arrives: raise this to 500 there.
    fetch_max_wait_ms: int = 10
    max_poll_records: int = 16
    stage_concurrency: int = 8  # in-flight messages per worker; beyond it partitions pause
    max_attempts: int = 3  # failures of one record before it goes to mm.dead-letter
    drain_timeout_ms: int = 10_000  # SIGTERM: wait this long for in-flight work, then cancel
    # claim on (request, stage) while working; a crashed holder's claim lapses after this
    stage_lease_ms: int = 15_000
    done_ttl_s: int = 3_600  # how long "this stage finished this request" is remembered
    max_restarts: int = 3  # restarts from the source after lost tensor owners, then a 503

    # --- tensors (NIXL)
    pool_bytes: int = 256 * _MiB
    lease_ttl_ms: int = 120_000

    # --- compute
    engine: str = "transformers"  # language-model runtime: transformers | vllm
    torch_threads: int = 1
    encode_max_batch_items: int = 16
    encode_batch_wait_ms: int = 2
    decode_concurrency: int = 16

    # --- requests
    request_timeout_ms: int = 120_000
    default_max_tokens: int = 64
    max_tokens_limit: int = 4096
    max_request_bytes: int = 32 * _MiB
    max_media_items: int = 8
    max_inflight_requests: int = 256
    stream_maxlen: int = 100_000
    stream_ttl_s: int = 600

    # --- media
    max_image_bytes: int = 16 * _MiB
    max_image_pixels: int = 40_000_000
    media_fetch_timeout_ms: int = 10_000  # a whole media fetch, redirects included
    # Hosts whose URLs may be fetched even though they resolve to loopback / private addresses:
    # "host" (any port) or "host:port" (that port only; IPv6 as "[::1]:8080"). Matched on the
    # name as written in the URL, never on what it resolves to. Empty: only public addresses.
    media_allow_hosts: tuple[str, ...] = ()
    media_connect_timeout_ms: int = 3_000  # one TCP (+TLS) connect to a media host
    media_read_timeout_ms: int = 5_000  # longest wait for the next bytes of a media response
    media_max_redirects: int = 3  # redirects followed per media URL; each hop is re-checked
    # Directory that file:// media URLs may name (symlinks resolved, escapes refused). Empty: refused.
    media_file_root: str = ""
    media_cache_bytes: int = 64 * _MiB  # media-fetch LRU of fetched bytes (http(s)), in bytes; 0: off
    media_cache_ttl_s: int = 300  # how long fetched bytes of a URL may be served from that cache
    # --- video (decoded with PyAV in media-fetch's compute lane)
    max_video_bytes: int = 64 * _MiB  # fetched / inline bytes of one video
    max_video_duration_s: float = 600.0  # longer videos are refused (413) before any frame is decoded
    max_video_frames: int = 32  # frames one video may give the model (num_frames / fps beyond it: 400)
    max_video_side: int = 4096  # longest side of a video frame, in pixels (larger: 413)
    video_num_frames: int = 8  # frames sampled uniformly over the video when the request names none
    # > 0: sample this many frames per second when the request names no num_frames / fps
    # (capped at max_video_frames); 0: sample video_num_frames uniformly
    video_fps: float = 0.0
    # frames PyAV may decode to find the sampled ones: bounds the CPU a high-frame-rate video costs
    max_video_decoded_frames: int = 20_000
    # --- audio (soundfile / PyAV in media-fetch's compute lane, resampled to the model's rate)
    max_audio_bytes: int = 16 * _MiB  # fetched / inline bytes of one audio clip
    max_audio_duration_s: float = 30.0  # longer clips are refused (413); Qwen2-Audio hears 30 s at most

    log_level: str = "INFO"

    def with_overrides(self, **changes: Any) -> Settings:
        return msgspec.structs.replace(self, **{k: v for k, v in changes.items() if v is not None})


def field_names() -> tuple[str, ...]:
    return Settings.__struct_fields__


def from_env(env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Build settings from ``env`` (default: ``os.environ``) plus explicit overrides.

    Unknown ``MMFLEET_*`` variables are an error, so a typo never silently falls back to a
    default. Tuple settings take comma-separated values.
    """
    env = os.environ if env is None else env
    names = set(field_names())
    raw: dict[str, Any] = {}
    for key, value in env.items():
        if key in _ALIASES:
            raw.setdefault(_ALIASES[key], value)
        elif key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX) :].lower()
            if name not in names:
                raise ValueError(f"unknown setting {key}; known: {', '.join(sorted(names))}")
            raw[name] = value  # explicit MMFLEET_ wins over the alias
    for name, value in list(raw.items()):
        if name == "media_allow_hosts" and isinstance(value, str):
            raw[name] = tuple(h.strip() for h in value.split(",") if h.strip())
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return msgspec.convert(raw, Settings, strict=False)


def to_env(settings: Settings) -> dict[str, str]:
    """The environment that reproduces ``settings`` in a child process."""
    out: dict[str, str] = {}
    for name in field_names():
        value = getattr(settings, name)
        if isinstance(value, tuple):
            value = ",".join(value)
        elif isinstance(value, bool):
            value = "true" if value else "false"
        out[ENV_PREFIX + name.upper()] = str(value)
    return out


def child_env(settings: Settings) -> dict[str, str]:
    """Environment for a child process of the fleet: this process's environment without any
    ``MMFLEET_*`` / alias variables, plus exactly ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) and k not in _ALIASES}
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 cores are shared by the whole fleet
    env.setdefault("HF_HUB_OFFLINE", "1")  # models are local paths; never reach for a hub
    env["PYTHONUNBUFFERED"] = "1"
    env.update(to_env(settings))
    return env
