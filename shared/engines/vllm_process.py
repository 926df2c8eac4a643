"""What the vLLM engine needs around vLLM itself: the engine-core parent watchdog and process
extension (fast exit), building the ``AsyncLLM`` (its environment), vLLM's request-error family,
orderly shutdown, prompt rendering and the eos list. Imports no vLLM at module level (the engine
core imports this module by name, as ``worker_extension_cls``).

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
extension's set-up call. A core that finds its parent already dead when it gets there (killed
during the core's first seconds of imports) exits at once: vLLM would wait minutes for the
handshake with it.

Processes. ``AsyncLLM`` always runs the engine core (scheduler + model) in a child process,
started with ``spawn`` (vLLM's CPU platform forces spawn); the parent only renders inputs and
relays outputs over ZMQ. With ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (vLLM's default) the CPU
platform adds a SECOND child, a multiproc-executor worker under the engine core, which
busy-polls its queue (~13% of a core while idle, measured) and made decode slower (4.4 vs
3.6 ms/token) and start-up longer. This engine sets it to ``0``: the model runs inside the
engine-core process (uniproc executor), ONE child, ~1.6% of a core while idle. Spawn re-imports
the parent's ``__main__`` module, so the program must be ``__main__``-guarded
(``python -m services.cli worker`` and pytest are). vLLM warns "global random seed is set ...
VLLM_ENABLE_V1_MULTIPROCESSING is set to False": it does not apply to ``AsyncLLM`` (the seed is
set in the child only).

Shutdown. ``VllmEngine.stop`` (idempotent) aborts what is in flight (those iterators end), stops
vLLM's output relay, then runs ``AsyncLLM.shutdown(timeout)`` in a thread (SIGTERM to the
engine core, orderly teardown, join; SIGKILL after ``shutdown_timeout_s``) and joins the
process objects (vLLM does not reap a process it had to kill). ~1.5 s. The engine core also
gets :class:`EngineProcessExtension` (vLLM's ``worker_extension_cls`` hook): a parent watchdog
(vLLM leaves the engine core running forever if the worker is SIGKILLed) and a ``gc.freeze()``
at exit (interpreter teardown GC took 3–5 s, past vLLM's 5 s kill deadline). Python's
``multiprocessing`` resource tracker (started by the first spawn, one per interpreter, exits
with it) is the only child left after ``stop()``.

CPU threads. vLLM's CPU backend binds OpenMP threads to cores by default
(``VLLM_CPU_OMP_THREADS_BIND=auto``: one pinned thread per physical core, minus a reserved
one), which on a small machine shared with other workers pins the model onto a core others
use. ``build_async_llm`` sets, only while the engine is being built (the spawned child inherits
them; the parent's environment is then restored, dropping what importing vLLM and its CPU platform
write into it — ``LD_PRELOAD`` (torch's libgomp), ``LD_LIBRARY_PATH``,
``VLLM_WORKER_MULTIPROC_METHOD=spawn``, ``TORCHINDUCTOR_*``, ``NUMEXPR_MAX_THREADS``, ... —
which would otherwise leak into every later subprocess of the worker):
- ``VLLM_CPU_OMP_THREADS_BIND=nobind``: no affinity (measured: affinity list stays 0-1);
- ``OMP_NUM_THREADS=<num_threads>`` (default 1): the engine core's torch intra-op threads
  (with ``nobind`` vLLM leaves them to the environment and blocks ``torch.set_num_threads``);
  one busy thread during decode (the engine core has ~48 threads, all idle but that one);
- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: see above;
- ``MMFLEET_ENGINE_PARENT_PID``: the watchdog's (the only variable read here, in the core).
With the KV side channel's (``shared.engines.vllm_pd``), these are the only variables touched.

KV cache: ``kv_cache_bytes`` (engine arg ``kv_cache_memory_bytes``; ``VLLM_CPU_KVCACHE_SPACE``
is the env equivalent) is allocated up front; with it set vLLM also skips its profiling
warm-up. Default: 512 MiB on CPU (``None`` would make vLLM reserve ``gpu_memory_utilization``
of ALL host memory); on a GPU, ``None`` means vLLM's sizing from ``gpu_memory_utilization``.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

# Set only while AsyncLLM is built (see the module docstring); the spawned engine core inherits
# them, with the caller's (OMP_NUM_THREADS, the watchdog's, the KV side channel's).
BUILD_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # no core pinning on a shared machine
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # model in the engine-core process: 1 child, not 2
}


def build_async_llm(env: dict[str, str], engine_args: dict):
    """``AsyncLLM.from_engine_args`` with ``BUILD_ENV`` + ``env`` set only while it spawns the
    engine core (blocking: call it off the event loop), the parent's environment restored after;
    the engine core gets :class:`EngineProcessExtension`."""
    saved = dict(os.environ)
    os.environ.update(BUILD_ENV)
    os.environ.update(env)
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**engine_args, worker_extension_cls=f"{__name__}.EngineProcessExtension")
        return AsyncLLM.from_engine_args(args)
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
    Returns whether the watchdog runs in this process."""
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

    - Parent watchdog: armed already (module docstring); this reports whether it runs.
    - Fast exit: the interpreter's final garbage collection over the engine core's heap takes
      3–5 s on 2 busy cores, past vLLM's 5 s grace before it SIGKILLs the process (and then
      never reaps it). ``gc.freeze()`` at exit skips that scan (what vLLM itself does on ROCm);
      the OS reclaims the memory."""

    def mmfleet_setup_engine_process(self) -> bool:
        from shared import gcpolicy

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
