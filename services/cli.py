"""``mmfleet``: one command line for every process of the fleet (``mmfleet <command> --help``).

Settings, lowest precedence first: defaults < a TOML config file (--config FILE, or the
MMFLEET_CONFIG variable; keys are setting names, e.g. `gateway_port = 8080`) < environment
variables MMFLEET_<NAME> < the flags of a subcommand. Unknown keys and variables are errors.

Docs: docs/guide/configuration.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from services import cli_vllm
from services.version import version
from shared import logs, settings_doc
from shared import settings as settings_mod
from shared.process import aio

_FLAGS = ("kafka_bootstrap", "redis_url", "model", "model_path", "revision", "log_level", "log_format",
          "gateway_port", "engine", "stage_replicas")


_EPILOG = ("every setting, with its environment variable, default and meaning: `mmfleet settings`\n"
           "(a config file uses the lower-case name without MMFLEET_; KAFKA_BOOTSTRAP and REDIS_URL are\n"
           "honoured as aliases)")


def _parser() -> argparse.ArgumentParser:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(prog="mmfleet", description=head + "\n\n" + rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG)
    p.add_argument("--version", action="version", version=f"mmfleet {version()}")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str, **kw) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_, epilog=_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter, **kw)

    _fleet_commands(add)
    _tool_commands(add, sub)
    return p


def _config_flag(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--config", type=Path, metavar="FILE",
                    help="TOML file of settings (keys are setting names); env MMFLEET_CONFIG")

def _common_flags(sp: argparse.ArgumentParser) -> None:
    _config_flag(sp)
    sp.add_argument("--kafka-bootstrap", help="Kafka bootstrap servers (env KAFKA_BOOTSTRAP)")
    sp.add_argument("--redis-url", help="Redis URL (env REDIS_URL)")
    sp.add_argument("--model", metavar="FOLDER_OR_HUB_ID",
                    help="a local model folder or a hub id in the local Hugging Face cache (env MMFLEET_MODEL); "
                         "default: the tiny offline demo model")
    sp.add_argument("--model-path", metavar="FOLDER_OR_HUB_ID",
                    help="the old name of --model (the served model name then stays mmfleet-demo)")
    sp.add_argument("--revision", help="with a hub id: branch, tag or commit (env MMFLEET_REVISION; default main)")
    sp.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR (env MMFLEET_LOG_LEVEL)")
    sp.add_argument("--log-format", choices=["text", "json"], help="log lines as text or JSON "
                    "(env MMFLEET_LOG_FORMAT)")
    sp.add_argument("--engine", choices=["transformers", "vllm", "sglang"],
                    help="language-model runtime (env MMFLEET_ENGINE; default transformers)")


def _fleet_commands(add) -> None:
    """The fleet's own processes: up, worker, gateway, and the topics and model they need."""
    up = add("up", "start the whole fleet and supervise it (Ctrl-C stops it)")
    _common_flags(up)
    from services.modes import MODES, STAGE_ORDER  # the stage registry (services/stages.py)

    up.add_argument("--mode", default="e-p-d", choices=list(MODES),
                    help="which stages share a worker: epd (one worker), e-pd (encode apart), e-p-d (media-fetch "
                         "+ encode, prefill, decode), ep-d (decode apart), m-e-p-d (every stage apart)")
    up.add_argument("--port", type=int, dest="gateway_port", help="gateway port (env MMFLEET_GATEWAY_PORT)")
    up.add_argument("--log-dir", type=Path, help="write each child's output to DIR/<name>.log")
    up.add_argument("--ready-file", type=Path, help="write the gateway URL to FILE once every stage serves")
    up.add_argument("--autoscale", action="store_true",
                    help="add/remove workers per stage from consumer lag and the TTFT SLO (MMFLEET_AUTOSCALE_*)")
    up.add_argument("--replicas", dest="stage_replicas",
                    help="worker processes per stage, e.g. prefill=3,encode=2 (env MMFLEET_STAGE_REPLICAS)")
    cli_vllm.add_flags(up)

    worker = add("worker", "run one worker process")
    _common_flags(worker)
    worker.add_argument("--stages", required=True,
                        help=f"comma-separated stages: {', '.join(STAGE_ORDER)}")
    cli_vllm.add_flags(worker)

    gw = add("gateway", "run the HTTP gateway")
    _common_flags(gw)
    gw.add_argument("--port", type=int, dest="gateway_port", help="gateway port (env MMFLEET_GATEWAY_PORT)")

    _common_flags(add("topics", "create the fleet's topics if missing"))
    _common_flags(add("model", "print the folder of the model served (--model: a folder or a hub id in the local "
                               "HF cache; none: the tiny demo model, built once)"))


def _tool_commands(add, sub) -> None:
    """The operator's tools: submit, top, keys, settings, doctor, bench."""
    submit = add("submit", "run a JSONL file of requests through the Kafka ingress; replies to a JSONL file "
                           "(resumable: ids already answered are skipped)")
    _common_flags(submit)
    submit.add_argument("input", type=Path, help="requests, one per line: {custom_id, url?, body}")
    submit.add_argument("output", type=Path, help="replies are appended here, one per line")
    submit.add_argument("--reply-topic", help="topic to read replies from (default: mm.replies.<input stem>)")
    submit.add_argument("--api-key-file", type=Path,
                        help="file holding the API key (default: env OPENAI_API_KEY; never pass a key as a flag)")
    submit.add_argument("--max-outstanding", type=int, default=1000, help="unanswered requests at most")
    submit.add_argument("--no-progress", action="store_true", help="no progress bar")

    top = add("top", "the live fleet view in the terminal: stages, lag, latencies, caches, processes "
                     "(from Redis liveness records and each process's /metrics)")
    _config_flag(top)
    top.add_argument("--redis-url", help="Redis URL (env REDIS_URL)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between frames (default 2)")

    keys = add("keys", "API key helpers")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    keys_sub.add_parser("hash", help="read one API key from stdin, print its sha256 (what settings hold)")

    st = add("settings", "list every setting with its environment variable, default and meaning")
    _config_flag(st)
    shape = st.add_mutually_exclusive_group()
    shape.add_argument("--effective", action="store_true",
                       help="print MMFLEET_<NAME>=value as in force here (defaults < file < environment; "
                            "secrets redacted)")
    shape.add_argument("--markdown", action="store_true",
                       help="print the table as Markdown (as in docs/guide/configuration.md)")
    doctor = add("doctor", "print the compute device, the tensor transfer paths this host offers, and a "
                           "1/16/256 MiB bandwidth probe of each (between two processes)")
    _config_flag(doctor)
    doctor.add_argument("--device", help="cpu, cuda or cuda:N (default: setting device)")
    doctor.add_argument("--sizes", default="1,16,256", help="probe sizes, MiB, comma-separated")
    sub.add_parser("bench", add_help=False,
                   help="benchmark the fleet against inproc and vllm serve (mmfleet bench --help; settings "
                        "from MMFLEET_CONFIG and MMFLEET_* variables)")


def load_settings(args: argparse.Namespace, env=None) -> settings_mod.Settings:
    """The process's settings: defaults < ``--config`` (or MMFLEET_CONFIG) < environment < flags."""
    overrides = {k: getattr(args, k, None) for k in _FLAGS}
    overrides.update(cli_vllm.overrides(args))
    return settings_mod.from_env(env, config_file=getattr(args, "config", None), **overrides)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the harness (loadtest/) is an optional plug-in loaded by name: it
        import importlib  # imports the services to run fleets, not the other way round

        return importlib.import_module("loadtest.cli").main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "keys":  # needs no settings
        from services.gateway.auth import hash_key

        key = sys.stdin.readline().strip()
        if not key:
            print("mmfleet keys hash: no key on stdin", file=sys.stderr)
            return 2
        print(hash_key(key))
        return 0
    try:
        settings = load_settings(args)
    except ValueError as exc:  # unknown key / variable, unreadable file, a value that does not convert
        parser.exit(2, f"mmfleet {args.command}: {exc}\n")
    if args.command == "settings":
        if args.effective:
            print("\n".join(f"{settings_mod.env_name(k)}={settings_mod._as_env(v)}"
                            for k, v in settings_mod.redacted(settings).items()))
        else:
            print(settings_doc.markdown_table() if args.markdown else settings_doc.help_table())
        return 0
    logs.setup(settings, process=args.command)
    if args.command in ("up", "worker", "gateway"):  # long-lived fleet processes: shared/process/gcpolicy.py
        from shared.process import gcpolicy
        from shared.process.device import keep_triton_out

        gcpolicy.starting()
        keep_triton_out(settings.device)  # before anything imports torch._dynamo
    return _COMMANDS[args.command](args, settings)


def _up(args: argparse.Namespace, settings: settings_mod.Settings) -> int:
    from services.supervisor import run_up

    return aio.run(run_up(settings, mode=args.mode, log_dir=args.log_dir, ready_file=args.ready_file,
                          autoscale=args.autoscale), settings.event_loop)


def _worker(args: argparse.Namespace, settings: settings_mod.Settings) -> int:
    from services.worker import run_worker
    from shared.engines.registry import uses_decode_core
    from shared.process import zygote

    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    spawner = None
    if zygote.preloaded and uses_decode_core(settings, tuple(stages)):
        # forked by the zygote, so still one thread with everything imported: fork a zygote
        # of our own here, for the decode core (and its restarts) to start without imports
        from shared.process.zygote_main import fork_here

        spawner = fork_here()
    return aio.run(run_worker(settings, stages, spawner), settings.event_loop)


def _gateway(args: argparse.Namespace, settings: settings_mod.Settings) -> int:
    from services.gateway.main import run_gateway

    return aio.run(run_gateway(settings), settings.event_loop)


def _topics(args: argparse.Namespace, settings: settings_mod.Settings) -> int:
    from services.stages import fleet_topics
    from shared.transport.bus import ensure_topics

    asyncio.run(ensure_topics(settings, fleet_topics(settings)))
    print("\n".join(fleet_topics(settings)))
    return 0


def _top(args: argparse.Namespace, settings: settings_mod.Settings) -> int:
    from services.fleetview.top import run_top

    try:
        return asyncio.run(run_top(settings, once=args.once, interval_s=args.interval))
    except KeyboardInterrupt:
        return 0


def _doctor(args: argparse.Namespace, settings: settings_mod.Settings) -> int:
    from shared.transfer.probe import doctor_report

    try:
        print(asyncio.run(doctor_report(args.device or settings.device, tuple(int(s) for s in args.sizes.split(",")))))
    except ValueError as exc:  # a device that is not there
        print(f"mmfleet doctor: {exc}", file=sys.stderr)
        return 1
    return 0


def _model(args: argparse.Namespace, settings: settings_mod.Settings) -> int:
    from shared.models.registry import resolve_model_path

    try:
        print(resolve_model_path(settings))
    except ValueError as exc:  # not a folder, not in the hub cache
        print(f"mmfleet model: {exc}", file=sys.stderr)
        return 1
    return 0


def _submit(args: argparse.Namespace, settings: settings_mod.Settings) -> int:
    import os

    from services.submit import submit

    # the client's own key (not a fleet setting): a file, else the variable OpenAI clients use
    api_key = args.api_key_file.read_text().strip() if args.api_key_file else os.environ.get("OPENAI_API_KEY")
    try:
        result = asyncio.run(submit(settings, args.input, args.output, reply_topic=args.reply_topic,
                                    api_key=api_key, max_outstanding=args.max_outstanding,
                                    progress=not args.no_progress))
    except (ValueError, TimeoutError) as exc:
        print(f"mmfleet submit: {exc}", file=sys.stderr)
        return 1
    print(f"sent {result.sent}, skipped {result.skipped} already answered, wrote {result.written} replies "
          f"({result.errors} errors) to {args.output}")
    return 0


_COMMANDS = {"up": _up, "worker": _worker, "gateway": _gateway, "topics": _topics, "submit": _submit,
             "top": _top, "doctor": _doctor, "model": _model}


if __name__ == "__mp_main__":
    # A multiprocessing spawn child of a worker (vLLM's engine core imports this module as its
    # __mp_main__ before anything else): die with the worker, even if it is SIGKILLed while
    # its engine is still starting. A no-op in any other child.
    from shared.engines.vllm_process import arm_parent_watchdog

    arm_parent_watchdog()

if __name__ == "__main__":
    sys.exit(main())
