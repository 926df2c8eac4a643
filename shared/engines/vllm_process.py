"""What the vLLM engine needs around vLLM itself: the engine-core parent watchdog and process
extension (fast exit), vLLM's request-error family, orderly shutdown, prompt rendering and the
eos list. Imports no vLLM at module level (the engine core imports this module by name, as
``worker_extension_cls``); see :mod:`shared.engines.vllm_engine` for why each exists.

Parent watchdog: vLLM does not stop its engine core when the process that spawned it dies
without calling ``stop()`` (SIGKILL, OOM kill): the core lives on, holding the model and its
KV cache (one was seen after a chaos run: its worker was killed while the engine was starting,
before any hook of ours had run in the core). :func:`watchdog_env` names the parent in the
environment the core is spawned with, and :func:`arm_parent_watchdog` (idempotent; a no-op in
any other process) starts a thread in the core that waits on the parent's death — the pipe
multiprocessing keeps to a spawned child's parent (``parent_process().sentinel``), else
``getppid()`` polling — then SIGTERMs the core (vLLM's orderly shutdown; during construction
vLLM only records it and exits once built) and ``_exit``s after 15 s if that did not end it.
It is armed at the earliest point each program offers: the worker's ``__main__``
(``services.cli``, which spawn re-imports in the child before anything of vLLM), this module's
import in the core (vLLM imports it at executor start, for any ``__main__``), and the
extension's set-up call.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

PARENT_ENV = "MMFLEET_ENGINE_PARENT_PID"
WATCHDOG_GRACE_S = 15.0
_armed = False


def watchdog_env() -> dict[str, str]:
    """Set in the environment while the engine core is spawned: who its parent is."""
    return {PARENT_ENV: str(os.getpid())}


def arm_parent_watchdog() -> bool:
    """In a child spawned with :func:`watchdog_env` (only there): watch the parent, once.
    Returns whether the watchdog runs in this process."""
    global _armed
    if _armed:
        return True
    expected = os.environ.get(PARENT_ENV)
    if not expected or expected != str(os.getppid()):
        return False  # not an engine core, or its parent is already gone (the core then stops on
        # its own: vLLM's handshake with a dead parent fails)
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
                time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(WATCHDOG_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="mmfleet-parent-watch", daemon=True).start()
    _armed = True
    return True


class EngineProcessExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``), so it runs in the engine-core
    process; ``start()`` calls :meth:`mmfleet_setup_engine_process` once via ``collective_rpc``.

    - Parent watchdog: armed already (module docstring); this reports whether it runs.
    - Fast exit: the interpreter's final garbage collection over the engine core's heap takes
      3–5 s on 2 busy cores, past vLLM's 5 s grace before it SIGKILLs the process (and then
      never reaps it). ``gc.freeze()`` at exit skips that scan (what vLLM itself does on ROCm);
      the OS reclaims the memory."""

    def mmfleet_setup_engine_process(self) -> bool:
        import atexit
        import gc

        atexit.register(gc.freeze)
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
    does not join a process it had to kill, which would stay a zombie until this one exits."""
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
# no-op in every other process; see the module docstring).
arm_parent_watchdog()
