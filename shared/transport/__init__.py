"""How a record moves: the generic stage runner over one consume loop, the Kafka bus, the ledger
of claims and done-marks, the token streams, the Redis clients, liveness, and the doorbell with
early start. Nothing here knows what a stage computes. Design: docs/design/runner.md.
"""
