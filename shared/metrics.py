"""Prometheus metrics of every process, on the default registry, and their ``/metrics`` endpoint.

Every series the fleet defines is declared here (other modules add their own to the same
registry), so one file lists what an operator can scrape; names carry their unit. The gateway
adds :func:`metrics_view` to its own aiohttp app; a worker runs :class:`MetricsServer`
(``metrics_host`` / ``metrics_port``, 0 = ephemeral), whose bound port goes into its liveness
record.

Design: docs/guide/observability.md.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest

# 1 ms .. 2 min: one set of buckets spans a tiny model's milliseconds and a real one's seconds.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                     60.0, 120.0)
# inter-token gaps are short: 0.5 ms .. 5 s
ITL_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# Outcomes of one record in a stage runner (the label values of STAGE_RECORDS).
OUTCOMES = ("ok", "failed", "deadline", "dead_letter", "duplicate", "aborted")

# ------------------------------------------------------------------------------- gateway
REQUESTS = Counter("mmfleet_requests_total", "HTTP requests answered by the gateway, by status code",
                   ["status"])
TTFT = Histogram("mmfleet_ttft_seconds", "gateway: request received to first token available",
                 buckets=LATENCY_BUCKETS_S)
ITL = Histogram("mmfleet_itl_seconds", "gateway: gap between consecutive token deltas of a request",
                buckets=ITL_BUCKETS_S)
E2E = Histogram("mmfleet_e2e_seconds", "gateway: request received to response complete",
                buckets=LATENCY_BUCKETS_S)
INFLIGHT = Gauge("mmfleet_inflight_requests", "gateway: requests admitted and not yet answered")
ADMISSION_REJECTIONS = Counter("mmfleet_admission_rejections_total",
                               "gateway: requests refused with 429, by reason", ["reason"])

# ------------------------------------------------------------------------------- stages
STAGE_QUEUE_WAIT = Histogram("mmfleet_stage_queue_wait_seconds",
                             "record produced to picked up by the stage (0 for in-process hand-over)",
                             ["stage"], buckets=LATENCY_BUCKETS_S)
STAGE_TRANSFER = Histogram("mmfleet_stage_transfer_seconds",
                           "time a stage's handler spent moving data (NIXL pulls/puts, media loads)",
                           ["stage"], buckets=LATENCY_BUCKETS_S)
STAGE_COMPUTE = Histogram("mmfleet_stage_compute_seconds",
                          "time a stage's handler spent on one record apart from transfers",
                          ["stage"], buckets=LATENCY_BUCKETS_S)
STAGE_RECORDS = Counter("mmfleet_stage_records_total",
                        "records a stage finished, by outcome (" + " / ".join(OUTCOMES) + "); a stage "
                        "handed its message in memory by another in its worker counts its ok ones",
                        ["stage", "outcome"])
EARLY_STARTS = Counter("mmfleet_early_starts_total",
                       "records a stage started on the copy a doorbell ring carried (shared.transport.early), by "
                       "outcome: started, adopted (its record came and it finished the record), dropped "
                       "(its record did not come in time, or its partition went)", ["stage", "outcome"])
COMPUTE_JOBS = Counter("mmfleet_compute_jobs_total",
                       "jobs a compute lane ran, by where: thread (the lane's compute thread) or inline (the "
                       "event loop's, the thread being idle and the job short: shared.process.compute)",
                       ["lane", "where"])
CONSUMER_LAG = Gauge("mmfleet_consumer_lag_records",
                     "records behind the partition's high watermark (highwater - position)",
                     ["stage", "partition"])
# what a worker's transformers engine loaded (shared.models.loading): an encode worker's LM part
# is 0, a prefill / decode worker's encoder part is 0; process_resident_memory_bytes beside it
MODEL_WEIGHT_BYTES = Gauge("mmfleet_model_weight_bytes",
                           "bytes of model weights this worker holds, by part (encoder: vision / audio tower + "
                           "projector; lm: the language model)", ["part"])
# how full the transformers engine's batched decode steps are (shared.engines.batched): CPU per
# token falls with the batch, so a fleet whose decode batches stay small pays more per token
DECODE_BATCH = Histogram("mmfleet_decode_batch_sequences", "sequences stepped by one batched decode forward",
                         buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))
PREFILL_BATCH = Histogram("mmfleet_prefill_batch_sequences", "prompts computed by one prefill forward",
                          buckets=(1, 2, 3, 4, 6, 8, 12, 16))

# ------------------------------------------------------------------------------- NIXL
NIXL_BYTES = Counter("mmfleet_nixl_bytes_total",
                     "tensor bytes: in = pulled from a peer's pool (a NIXL READ, or a copy out of its "
                     "mapped pool on this host), out = leased in this pool for peers to read", ["direction"])
NIXL_CROSS_HOST_BYTES = Counter("mmfleet_nixl_cross_host_bytes_total",
                                "tensor bytes READ over NIXL from a peer whose advertised host is not this "
                                "process's (a subset of mmfleet_nixl_bytes_total{direction=in})", ["peer_host"])
NIXL_POOL_USED = Gauge("mmfleet_nixl_pool_used_bytes",
                       "bytes of this process's NIXL pool in use (leased or staging); see pool_bytes")
NIXL_TRANSFER = Histogram("mmfleet_nixl_transfer_seconds",
                          "one pull of a peer's tensor, end to end (a NIXL READ, or a copy out of its pool "
                          "mapped on this host)",
                          buckets=LATENCY_BUCKETS_S)

# ------------------------------------------------------------------------------- media
# the one value set of every ``modality`` label (an embeddings item counts as its modality): the
# label's cardinality is bounded by it, whatever requests send
MODALITIES = ("image", "video", "audio")
MEDIA_FETCH_BYTES = Counter("mmfleet_media_fetch_bytes_total",
                            "media bytes media-fetch loaded, by source: http (downloaded, or served by the "
                            "fetch cache), inline (pulled from the gateway), file; and by modality",
                            ["source", "modality"])
REQUEST_MEDIA_ITEMS = Histogram("mmfleet_request_media_items",
                                "gateway: media items of one admitted chat request, by modality (every "
                                "modality observed for every request, 0 included)", ["modality"],
                                buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32))
MEDIA_TOKENS = Counter("mmfleet_media_tokens_total",
                       "prefill: prompt tokens the media items of the requests it ran became, by modality",
                       ["modality"])
MEDIA_FETCH = Histogram("mmfleet_media_fetch_seconds", "loading one media item's bytes, by source",
                        ["source"], buckets=LATENCY_BUCKETS_S)


def modality_of(kind: str) -> str:
    """The ``modality`` label of a media item's kind (``video_embeds`` -> ``video``)."""
    modality = kind.removesuffix("_embeds")
    return modality if modality in MODALITIES else "other"


def observe_request_media(kinds: list[str]) -> None:
    """One admitted request's media items (their kinds), counted per modality."""
    counted = [modality_of(k) for k in kinds]
    for modality in MODALITIES:
        REQUEST_MEDIA_ITEMS.labels(modality).observe(counted.count(modality))


def watch_pool(agent) -> None:
    """Report ``agent``'s (the process's one TransferAgent) pool use at each scrape."""
    NIXL_POOL_USED.set_function(lambda: agent.stats()["used_bytes"])


def observe_span(stage: str, queue_ms: float, transfer_ms: float, total_ms: float) -> None:
    """One handler call's span (see ``shared.tracing``): compute = total - transfer."""
    STAGE_QUEUE_WAIT.labels(stage).observe(max(queue_ms, 0.0) / 1000)
    STAGE_TRANSFER.labels(stage).observe(max(transfer_ms, 0.0) / 1000)
    STAGE_COMPUTE.labels(stage).observe(max(total_ms - transfer_ms, 0.0) / 1000)


def exposition() -> bytes:
    return generate_latest(REGISTRY)


async def metrics_view(_request: web.Request) -> web.Response:
    """``GET /metrics``: the default registry in Prometheus text format."""
    resp = web.Response(body=exposition())
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


class MetricsServer:
    """A process's own ``/metrics`` server. ``port`` is the one actually bound once started."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", metrics_view)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]  # the ephemeral port, when 0 was asked

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> MetricsServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
