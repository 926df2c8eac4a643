"""What the vLLM engine needs around vLLM itself: the engine-core process extension (parent
watchdog, fast exit), vLLM's request-error family, orderly shutdown, prompt rendering and the
eos list. Imports no vLLM at module level (the engine core imports this module by name, as
``worker_extension_cls``); see :mod:`shared.engines.vllm_engine` for why each exists.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path


class EngineProcessExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``), so it runs in the engine-core
    process; ``start()`` calls :meth:`mmfleet_setup_engine_process` once via ``collective_rpc``.

    - Parent watchdog: vLLM does not stop the engine core when its parent dies without
      calling ``stop()`` (SIGKILL, OOM kill): it would live on, holding the model and KV cache.
      A daemon thread polls the parent pid every second; once the process is re-parented it
      SIGTERMs its own process (vLLM's orderly engine-core shutdown) and exits hard if that
      has not ended it within 15 s.
    - Fast exit: the interpreter's final garbage collection over the engine core's heap takes
      3–5 s on 2 busy cores, past vLLM's 5 s grace before it SIGKILLs the process (and then
      never reaps it). ``gc.freeze()`` at exit skips that scan (what vLLM itself does on ROCm);
      the OS reclaims the memory."""

    def mmfleet_setup_engine_process(self) -> int:
        import atexit
        import gc
        import signal
        import threading

        atexit.register(gc.freeze)
        parent = os.getppid()

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(15.0)
            os._exit(1)

        threading.Thread(target=watch, name="mmfleet-parent-watch", daemon=True).start()
        return parent


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
