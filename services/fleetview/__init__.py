"""The operator's view of a running fleet: ``collect`` gathers a ``snapshot`` (liveness records in
Redis + every process's ``/metrics``), which ``page`` serves as the gateway's live ``/fleet``
page and ``top`` draws in a terminal (``mmfleet top``).

Design: docs/guide/observability.md.
"""
