"""``mmfleet``: one command line for every process of the fleet.

  mmfleet up        the whole fleet locally (broker, Redis, workers, gateway)
  mmfleet worker    one worker process running the given stages
  mmfleet gateway   the OpenAI-compatible HTTP gateway
  mmfleet topics    create the topics (idempotent) and list them
  mmfleet bench     benchmark the fleet against in-process and vllm serve (see loadtest/README.md)
  mmfleet model     build the tiny offline demo model (cached) and print its path

Settings come from ``MMFLEET_<NAME>`` environment variables (``mmfleet settings`` lists them
with their defaults); the flags below override them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from shared import settings as settings_mod


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmfleet", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--kafka-bootstrap", help="Kafka bootstrap servers (env KAFKA_BOOTSTRAP)")
        sp.add_argument("--redis-url", help="Redis URL (env REDIS_URL)")
        sp.add_argument("--model-path", help="local model directory; default: the tiny offline demo model")
        sp.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR")
        sp.add_argument("--engine", choices=["transformers", "vllm"],
                        help="language-model runtime (env MMFLEET_ENGINE; default transformers)")

    up = sub.add_parser("up", help="start the whole fleet and supervise it (Ctrl-C stops it)")
    common(up)
    up.add_argument("--mode", default="e-p-d", choices=["epd", "e-pd", "e-p-d", "ep-d"],
                    help="which stages share a worker: epd (one worker), e-pd (encode apart), e-p-d (all "
                         "apart), ep-d (decode apart)")
    up.add_argument("--port", type=int, dest="gateway_port", help="gateway port (default 8000)")
    up.add_argument("--log-dir", type=Path, help="write each child's output to DIR/<name>.log")
    up.add_argument("--ready-file", type=Path, help="write the gateway URL to FILE once every stage serves")
    up.add_argument("--replicas", help="workers per stage, e.g. encode=2,prefill=3 (env MMFLEET_STAGE_REPLICAS; "
                                       "default 1 each)")

    worker = sub.add_parser("worker", help="run one worker process")
    common(worker)
    worker.add_argument("--stages", required=True,
                        help="comma-separated stages: media-fetch, encode, prefill, decode")

    gw = sub.add_parser("gateway", help="run the HTTP gateway")
    common(gw)
    gw.add_argument("--port", type=int, dest="gateway_port")

    topics = sub.add_parser("topics", help="create the fleet's topics if missing")
    common(topics)

    model = sub.add_parser("model", help="build (once) the tiny demo model and print its path")
    common(model)

    sub.add_parser("settings", help="list every setting with its environment variable and default")
    sub.add_parser("bench", add_help=False,
                   help="benchmark the fleet against inproc and vllm serve (mmfleet bench --help)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the harness has its own parser
        from loadtest.cli import main as bench_main

        return bench_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "settings":
        defaults = settings_mod.Settings()
        for name in settings_mod.field_names():
            print(f"{settings_mod.ENV_PREFIX}{name.upper():<28} {getattr(defaults, name)!r}")
        return 0
    overrides = {k: getattr(args, k, None) for k in ("kafka_bootstrap", "redis_url", "model_path", "log_level",
                                                      "gateway_port", "engine")}
    if getattr(args, "replicas", None):
        overrides["stage_replicas"] = tuple(e.strip() for e in args.replicas.split(",") if e.strip())
    settings = settings_mod.from_env(**overrides)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")
    if args.command == "up":
        from services.supervisor import run_up

        return asyncio.run(run_up(settings, mode=args.mode, log_dir=args.log_dir, ready_file=args.ready_file))
    if args.command == "worker":
        from services.worker import run_worker

        return asyncio.run(run_worker(settings, [s.strip() for s in args.stages.split(",") if s.strip()]))
    if args.command == "gateway":
        from services.gateway.main import run_gateway

        return asyncio.run(run_gateway(settings))
    if args.command == "topics":
        from shared.bus import ensure_topics
        from shared.keys import ALL_TOPICS

        asyncio.run(ensure_topics(settings))
        print("\n".join(ALL_TOPICS))
        return 0
    if args.command == "model":
        from shared.models.registry import resolve_model_path

        print(resolve_model_path(settings))
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
