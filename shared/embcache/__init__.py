"""The fleet's embedding cache: a repeated media item is not encoded twice anywhere in the fleet
while its embedding is still held. :mod:`.identity`: the cache key; :mod:`.store`: an encode
worker's pinned, byte-bounded LRU in its NIXL pool; :mod:`.index`: the advisory Redis index and
the ``SET NX PX`` lease that coalesces concurrent encodes; :mod:`.coalesce`: encode's path through
them; :mod:`.pull`: prefill's side; :mod:`.recent`: prefill's LRU of recent pulls;
:mod:`.metrics`: the Prometheus series.

Design: docs/design/embedding-cache.md.
"""
