"""mmfleet's benchmark harness: workloads, load shapes, an SSE client with per-chunk timing,
targets (the fleet, the same engine in one process, ``vllm serve``) and reports.

Entry points: ``python -m loadtest <command>`` and :func:`loadtest.cli.main` (what ``mmfleet
bench`` calls); the harness's reference is ``loadtest/README.md``. Design: docs/benchmarks/README.md.
"""
