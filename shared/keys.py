"""Topic names and Redis key builders: the only place that spells either.

Keys are namespaced by a prefix (settings ``redis_prefix``) so several fleets or test runs can
share one Redis without colliding.

Design: docs/design/architecture.md.
"""

from __future__ import annotations

TOPIC_MEDIA_FETCH = "mm.media-fetch"
TOPIC_ENCODE = "mm.encode"
TOPIC_PREFILL = "mm.prefill"
TOPIC_DECODE = "mm.decode"
TOPIC_DEAD_LETTER = "mm.dead-letter"
TOPIC_REQUESTS = "mm.requests"
# error replies to ingress requests that named no reply_to (settings may name another topic)
TOPIC_REPLY_ERRORS = "mm.replies.errors"

# the topics beside the stages' (each stage names its own in services/<stage>/spec.py;
# services.stages.fleet_topics lists them all)
INFRA_TOPICS: tuple[str, ...] = (TOPIC_DEAD_LETTER, TOPIC_REQUESTS, TOPIC_REPLY_ERRORS)


# the Kafka ingress: one consumer group over mm.requests (every gateway joins it); its
# request_id claims go through StageLedger under this stage name
INGRESS_STAGE = "ingress"


def consumer_group(stage: str) -> str:
    """One consumer group per stage: adding workers to a stage splits its partitions."""
    return f"mmfleet.{stage}"


class RedisKeys:
    """Redis key builders under one prefix."""

    def __init__(self, prefix: str = "mm") -> None:
        self.prefix = prefix

    def token_stream(self, request_id: str) -> str:
        """The request's token log (a Redis stream of ``StreamEvent`` entries)."""
        return f"{self.prefix}:stream:{request_id}"

    def stream_wake(self, reader_id: str) -> str:
        """A process's wake-up stream for its one token-stream reader (``shared.transport.stream_mux``)."""
        return f"{self.prefix}:stream-wake:{reader_id}"

    def token_seq(self, request_id: str) -> str:
        """Next delta sequence number of the request's token log: deltas are appended only at
        it (compare-and-append), so two decodes of one request never both write a token."""
        return f"{self.prefix}:seq:{request_id}"

    def lease(self, request_id: str, stage: str) -> str:
        """``SET NX PX`` claim on (request, stage) for idempotent redelivery."""
        return f"{self.prefix}:lease:{stage}:{request_id}"

    def acked(self, topic: str, request_id: str, attempt: int) -> str:
        """A carried stage record the broker acked: its partition, written by the producer with
        its ack's ring; an early run's guarded stream writes read it (``shared.transport.early``)."""
        return f"{self.prefix}:acked:{topic}:{request_id}:{attempt}"

    def done(self, request_id: str, stage: str) -> str:
        """Set once (request, stage)'s outputs are acknowledged: redeliveries skip the work."""
        return f"{self.prefix}:done:{stage}:{request_id}"

    def attempts(self, request_id: str) -> str:
        """Counter of the request's attempts: every restart from the source takes a fresh number,
        so two restarts (a lost tensor owner, a broker that lost its records) never share one."""
        return f"{self.prefix}:attempts:{request_id}"

    def broker_epoch(self) -> str:
        """Bumped by whoever restarts a broker that keeps records in memory only (``mmfleet up``'s
        embedded broker), before the new one starts: records and offsets of the old one are gone,
        so consumers drop their watermarks and commit nothing decided before the bump."""
        return f"{self.prefix}:broker-epoch"

    def broker_ready(self) -> str:
        """Bumped once that new broker's topics exist: gateways then re-drive their unfinished
        requests from the source. Not earlier: the embedded broker acks a record produced to a
        topic it does not know yet, then hides it once the topic is created."""
        return f"{self.prefix}:broker-ready"

    def abort(self, request_id: str) -> str:
        """Set by the gateway when the client went away: stages stop working on the request."""
        return f"{self.prefix}:abort:{request_id}"

    def embedding_index(self, cache_key: str) -> str:
        """Where the embedding of ``cache_key`` is held (an ``EmbeddingIndexEntry``, with a TTL)."""
        return f"{self.prefix}:emb:{cache_key}"

    def embedding_lease(self, cache_key: str) -> str:
        """``SET NX PX`` claim of the worker encoding ``cache_key`` now (others wait for it)."""
        return f"{self.prefix}:emb-lease:{cache_key}"

    def encoder_items(self) -> str:
        """Fleet-wide count of items through an encoder forward (INCRBY; an operator stat)."""
        return f"{self.prefix}:stats:encoder-items"

    def worker(self, worker_id: str) -> str:
        """A worker's liveness record (stage, pid, started), refreshed with a TTL."""
        return f"{self.prefix}:worker:{worker_id}"

    def alive(self, worker_id: str) -> str:
        """Set (with a TTL) while a worker's process runs, partitions or not: its NIXL pool can
        be read from. The embedding index checks owners here, so a rebalance, in which a live
        owner briefly holds no partition (and has no ``worker`` record), drops nothing."""
        return f"{self.prefix}:alive:{worker_id}"

    def rate(self, key_id: str, window: int) -> str:
        """Requests an API key (by its hash prefix, never the key) made in one rate window."""
        return f"{self.prefix}:rate:{key_id}:{window}"

    def kv_blocks(self, worker_id: str) -> str:
        """Set of KV block hashes (decimal) a prefill worker's prefix cache holds (written by it)."""
        return f"{self.prefix}:kv:blocks:{worker_id}"

    def kv_load(self, worker_id: str) -> str:
        """Hash of a prefill worker's load (in-flight, queued tokens), refreshed with a TTL."""
        return f"{self.prefix}:kv:load:{worker_id}"

    def kv_owners(self, topic: str) -> str:
        """Hash partition -> worker id of who consumes each partition of ``topic`` (rewritten on
        every rebalance and refreshed while the worker lives)."""
        return f"{self.prefix}:kv:owners:{topic}"

    def kv_route(self, request_id: str) -> str:
        """JSON object: one routing decision for ``request_id`` and what its prefill met (``shared.kv.audit``)."""
        return f"{self.prefix}:kv:route:{request_id}"

    def kv_event_lags(self) -> str:
        """List of recent cache-change-to-table lags in ms (prefill workers' table writes), newest first, bounded."""
        return f"{self.prefix}:stats:kv-event-lags"

    def workers_pattern(self) -> str:
        """``SCAN MATCH`` pattern over every worker's liveness record."""
        return f"{self.prefix}:worker:*"

    def workers_index(self) -> str:
        """Sorted set of the worker records' keys, scored by their last write (unix ms): readers
        list live workers from it (``shared.transport.liveness``), not by a SCAN of the keyspace."""
        return f"{self.prefix}:workers"

    def gateway(self, gateway_id: str) -> str:
        """A gateway's liveness record (its URL), refreshed with a TTL."""
        return f"{self.prefix}:gateway:{gateway_id}"

    def gateways_pattern(self) -> str:
        """``SCAN MATCH`` pattern over every gateway's liveness record."""
        return f"{self.prefix}:gateway:*"

    def gateways_index(self) -> str:
        """Sorted set of the gateway records' keys, scored by their last write (see ``workers_index``)."""
        return f"{self.prefix}:gateways"

    def fleet(self) -> str:
        """The claim of the one ``mmfleet up`` whose namespace this prefix is (a ``FleetInfo``, with
        a TTL its supervisor refreshes): a second fleet on the same Redis and prefix refuses to start."""
        return f"{self.prefix}:fleet"
