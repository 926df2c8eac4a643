"""mmfleet's benchmark harness: workloads, load shapes, an SSE client with per-chunk timing,
targets (the fleet, the same engine in one process, ``vllm serve``) and reports.

Entry points: ``python -m loadtest run|suite|media-server|inproc`` and
:func:`loadtest.cli.main` (what ``mmfleet bench`` calls). See ``loadtest/README.md``.
"""
