"""KV-aware routing: block hashes, the prefill workers' prefix cache, the routing table in
Redis and the router that picks a ``mm.prefill`` partition.

Design: docs/design/kv-routing.md.
"""
