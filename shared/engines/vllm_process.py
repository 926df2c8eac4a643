"""What the vLLM engine needs around vLLM itself: building the ``AsyncLLM`` under its environment
(:func:`build_async_llm`: one engine-core child, no core pinning), the engine core's parent
watchdog (:func:`arm_parent_watchdog`) and fast exit (:class:`EngineProcessExtension`), vLLM's
request-error family, orderly shutdown, prompt rendering and the eos list. Imports no vLLM at
module level (the engine core imports this module by name, as ``worker_extension_cls``).

Design: docs/design/vllm-engine.md.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

# Set only while AsyncLLM is built (see build_async_llm); the spawned engine core inherits
# them, with the caller's (OMP_NUM_THREADS, the watchdog's, the KV side channel's).
BUILD_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # no core pinning on a shared machine
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # model in the engine-core process: 1 child, not 2
}


def build_async_llm(env: dict[str, str], engine_args: dict):
    """``AsyncLLM.from_engine_args`` with ``BUILD_ENV`` + ``env`` set only while it spawns the
    engine core (blocking: call it off the event loop), the parent's environment restored after
    (dropping what importing vLLM and its CPU platform write into it: ``LD_PRELOAD``,
    ``LD_LIBRARY_PATH``, ``VLLM_WORKER_MULTIPROC_METHOD``, ``TORCHINDUCTOR_*``, ...); the engine
    core gets :class:`EngineProcessExtension`.

    ``AsyncLLM`` runs the engine core (scheduler + model) in a child started with ``spawn`` (which
    re-imports ``__main__``: the program must be ``__main__``-guarded). vLLM's default
    multiprocessing adds a second child on CPU, a multiproc-executor worker that busy-polls its
    queue (~13 % of a core while idle) and made decode slower (4.4 vs 3.6 ms/token);
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the model in the engine core (~1.6 % of a core idle).
    vLLM's CPU backend pins one OpenMP thread per physical core by default, onto cores other
    workers use; ``VLLM_CPU_OMP_THREADS_BIND=nobind`` pins nothing, and ``OMP_NUM_THREADS`` (in
    ``env``) sets the engine core's torch threads (with ``nobind`` vLLM leaves them to it)."""
    with _build_env(env):
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(_async_engine_args(engine_args))


def engine_config(env: dict[str, str], engine_args: dict):
    """The ``VllmConfig`` :func:`build_async_llm` would start an engine core with, built the same
    way (same environment, same usage context) but starting nothing: for checks and tests."""
    with _build_env(env):
        from vllm.usage.usage_lib import UsageContext

        return _async_engine_args(engine_args).create_engine_config(UsageContext.ENGINE_CONTEXT)


def _async_engine_args(engine_args: dict):
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**engine_args, worker_extension_cls=f"{__name__}.EngineProcessExtension")


@contextlib.contextmanager
def _build_env(env: dict[str, str]):
    saved = dict(os.environ)
    os.environ.update(BUILD_ENV)
    os.environ.update(env)
    try:
        yield
    finally:
        # The child has its environment; give the parent back its own (vLLM's CPU platform
        # writes LD_PRELOAD & co. into os.environ, which would leak into later subprocesses).
        os.environ.clear()
        os.environ.update(saved)


PARENT_ENV = "MMFLEET_ENGINE_PARENT_PID"
WATCHDOG_GRACE_S = 15.0
_armed = False


def watchdog_env() -> dict[str, str]:
    """Set in the environment while the engine core is spawned: who its parent is."""
    return {PARENT_ENV: str(os.getpid())}


def arm_parent_watchdog() -> bool:
    """In a child spawned with :func:`watchdog_env` (only there): watch the parent, once.
    Returns whether the watchdog runs in this process.

    vLLM does not stop its engine core when the process that spawned it dies without ``stop()``
    (SIGKILL, OOM kill): the core lives on, holding the model and its KV cache. A thread waits on
    the parent's death (``parent_process().sentinel``, else ``getppid()`` polling), then SIGTERMs
    the core (vLLM's orderly shutdown) and ``_exit``s after ``WATCHDOG_GRACE_S``. Armed at the
    earliest point each program offers: the worker's ``__main__`` (``services.cli``), this
    module's import in the core, and the extension's set-up call. A core whose parent is already
    dead exits at once: vLLM would wait minutes for the handshake with it."""
    global _armed
    if _armed:
        return True
    expected = os.environ.get(PARENT_ENV)
    if not expected:
        return False  # not spawned by an engine's build
    if expected != str(os.getppid()):
        if _alive(int(expected)):
            return False  # a grandchild (e.g. a multiproc executor worker): its own parent watches it
        # The parent died before this process got here (its first seconds go to imports): vLLM
        # would wait minutes for a handshake with it. Nothing here is worth an orderly exit.
        os._exit(1)
    import multiprocessing
    import signal
    import threading

    parent = multiprocessing.parent_process()
    sentinel = parent.sentinel if parent is not None and parent.pid == int(expected) else None

    def watch() -> None:
        if sentinel is not None:
            from multiprocessing.connection import wait

            wait([sentinel])  # readable (EOF) once the parent is gone
        else:
            while str(os.getppid()) == expected:
                time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(WATCHDOG_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="mmfleet-parent-watch", daemon=True).start()
    _armed = True
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EngineProcessExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``), so it runs in the engine-core
    process; ``start()`` calls :meth:`mmfleet_setup_engine_process` once via ``collective_rpc``.

    - Parent watchdog: armed already (:func:`arm_parent_watchdog`); this reports whether it runs.
    - Fast exit: the interpreter's final garbage collection over the engine core's heap takes
      3–5 s on 2 busy cores, past vLLM's 5 s grace before it SIGKILLs the process (and then
      never reaps it). ``gc.freeze()`` at exit skips that scan (what vLLM itself does on ROCm);
      the OS reclaims the memory."""

    def mmfleet_setup_engine_process(self) -> bool:
        from shared.process import gcpolicy

        gcpolicy.freeze_at_exit()
        return arm_parent_watchdog()


def request_errors() -> tuple[type[BaseException], ...]:
    """vLLM's exceptions that mean "this request cannot be served" (its 4xx family and the
    plain ValueError/TypeError of input validation); engine failures (EngineDeadError, ...)
    propagate as they are."""
    errors: tuple[type[BaseException], ...] = (ValueError, TypeError)
    try:
        from vllm.exceptions import GracefulHTTPError, VLLMClientError
    except ImportError:
        return errors
    return (*errors, VLLMClientError, GracefulHTTPError)


def shutdown(llm, procs: list, timeout_s: float) -> None:
    """``AsyncLLM.shutdown`` (SIGTERM, wait up to ``timeout_s``, then SIGKILL), then reap: vLLM
    does not join a process it had to kill, which would stay a zombie until this one exits.
    Blocking (~1.5 s): ``VllmEngine.stop`` runs it in a thread. Python's ``multiprocessing``
    resource tracker is the only child left after it."""
    llm.shutdown(timeout=timeout_s)
    for proc in procs:
        proc.join(timeout=5)


async def render(llm, prompt: dict):
    """Token prompt (+ multimodal data) → vLLM's engine input, off the event loop.

    vLLM 0.32 wants prompts rendered by its renderer (raw dicts still work but are deprecated);
    builds without that API take the raw dict."""
    try:
        from vllm.renderers.inputs.preprocess import parse_model_prompt
    except ImportError:
        return prompt
    (engine_input,) = await llm.renderer.render_cmpl_async([parse_model_prompt(llm.model_config, prompt)])
    return engine_input


def eos_ids(model_dir: Path, text_cfg: dict, generation_config_cls) -> frozenset[int]:
    """The eos list ``generate()`` stops on — the same rule as ``Qwen2VLCompute``."""
    eos = None
    with contextlib.suppress(OSError):
        eos = generation_config_cls.from_pretrained(str(model_dir)).eos_token_id
    if eos is None:
        eos = text_cfg.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    return frozenset(int(i) for i in ids)


# In the engine core, vLLM imports this module while it starts its executor: arm there too (a
# no-op in every other process).
arm_parent_watchdog()
