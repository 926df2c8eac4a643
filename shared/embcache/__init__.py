"""The fleet's embedding cache (issue #6): a repeated media item is not encoded twice anywhere
in the fleet while its embedding is still held.

- :mod:`.identity`: the cache key (mm_hash + the model and processor that shape the embedding).
- :mod:`.store`: an encode worker's pinned, byte-bounded LRU in its NIXL pool; publishes and
  deletes index entries as it inserts and evicts.
- :mod:`.index`: the Redis index (advisory: owner gone / failed read → encode again) and the
  ``SET NX PX`` lease that coalesces concurrent encodes of one key across workers.
- :mod:`.recent`: prefill's small LRU of embeddings it pulled recently.
- :mod:`.metrics`: the Prometheus series.
"""
