"""The SGLang engine on ``sglang.Engine`` (in-process; its scheduler and detokenizer are child
processes): ``generate`` (prefill + decode in one place: epd, e-pd) from prompt ids plus
precomputed embeddings (:mod:`shared.engines.sglang_inputs`), no ``encode``, no KV hand-off
(SGLang's disaggregation runs decode first: docs/design/sglang-engine.md says why the fleet's
prefill-first stages do not drive it yet). SGLang's tokenizer manager runs on a loop of its
own in one thread, so it never installs signal handlers on the worker's loop nor runs its
tokenising there; each stream chunk is pulled across. Sampling: :mod:`shared.engines.sglang_sampling`.
SGLang is imported in :meth:`SglangEngine.start` only; start-up refusals: :mod:`shared.engines.sglang_config`.

Design: docs/design/sglang-engine.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import torch

from shared import protocol
from shared.engines import sglang_config, sglang_sampling
from shared.engines.base import Capabilities, EngineError, MediaEmbeds, PrefillOutput
from shared.engines.sampling import continuation
from shared.engines.sglang_inputs import PromptBuilder
from shared.settings_sglang import SglangSettings

log = logging.getLogger(__name__)


class SglangEngine:
    name = "sglang"
    capabilities = Capabilities(encode=False, generate=True, kv_export=False, kv_import=False)

    def __init__(self, model_dir: str | Path, *, serving: SglangSettings | None = None, max_media_items: int = 8,
                 modalities: frozenset[str] | None = None, device: str = "cuda", dtype: str = "bfloat16",
                 seed: int = 0, shutdown_timeout_s: float = 20.0) -> None:
        """``serving``: SGLang's serving knobs (``sglang_*`` settings); ``modalities``: the media
        taken as embeddings (default: what the registry says the fleet serves with SGLang);
        ``device``: cuda | cuda:N."""
        from transformers import AutoTokenizer, GenerationConfig

        from shared.engines.vllm_process import eos_ids

        self._model_dir = Path(model_dir)
        self._serving = serving or SglangSettings()
        self._device = str(device)
        self._dtype = dtype
        self._seed = seed
        self._shutdown_timeout_s = shutdown_timeout_s
        config = json.loads((self._model_dir / "config.json").read_text())
        text_cfg = config.get("text_config", config)
        self.max_model_len: int = self._serving.sglang_context_length_tokens or int(text_cfg["max_position_embeddings"])
        self.tokenizer = AutoTokenizer.from_pretrained(str(self._model_dir))
        self.eos_token_ids: frozenset[int] = eos_ids(self._model_dir, text_cfg, GenerationConfig)
        self.prompts = PromptBuilder(self._model_dir, self.tokenizer, max_media_items, modalities)
        self.modalities = self.prompts.modalities
        self._engine = None  # sglang.Engine once started
        self._loop: asyncio.AbstractEventLoop | None = None  # SGLang's own, in self._thread
        self._thread: threading.Thread | None = None
        self._rids: dict[str, str] = {}  # our request id -> SGLang's rid, while in flight
        self._stopping = False
        self.startup_s: float | None = None

    def server_args(self) -> dict:
        """``sglang.Engine``'s keyword arguments for this engine (builds nothing)."""
        return sglang_config.server_args(self._model_dir, self._serving, dtype=self._dtype, seed=self._seed,
                                         context_length=self.max_model_len,
                                         gpu_id=sglang_config.gpu_index(self._device))

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._engine is not None:
            return
        why = sglang_config.startup_refusal(self._device)
        if why:
            raise EngineError(why)
        self._stopping = False
        t0 = time.monotonic()
        os.environ.update(sglang_sampling.RAW_LOGPROBS_ENV)  # read by SGLang's sampler in its children
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="sglang-loop", daemon=True)
        self._thread.start()
        self._loop = loop
        try:
            self._engine = await self._on_sglang_loop(self._build())
        except BaseException:
            await self._close_loop()
            raise
        self.startup_s = time.monotonic() - t0
        log.info("sglang engine up in %.1f s (model %s, context %d)", self.startup_s, self._model_dir,
                 self.max_model_len)

    async def _build(self):
        # on SGLang's loop: Engine() binds to the running loop it finds, and its tokenizer manager
        # starts its handle loop (and signal handlers, main thread only) on the first request's loop
        import sglang

        return sglang.Engine(**self.server_args())

    async def _on_sglang_loop(self, coro):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def stop(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        self._stopping = True
        for rid in list(self._rids.values()):
            with contextlib.suppress(Exception):
                engine.tokenizer_manager.abort_request(rid=rid)
        # Engine.shutdown() kills every child of THIS process (kill_process_tree(os.getpid())):
        # only the engine's own children go here
        pids = list(engine.get_all_child_pids())
        await asyncio.to_thread(_end_processes, pids, self._shutdown_timeout_s)
        del engine
        await self._close_loop()

    async def _close_loop(self) -> None:
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            await asyncio.to_thread(thread.join, 10)
        if not loop.is_running():
            loop.close()

    async def abort(self, request_id: str) -> None:
        engine, rid = self._engine, self._rids.get(request_id)
        if engine is not None and rid is not None:
            self._loop.call_soon_threadsafe(engine.tokenizer_manager.abort_request, rid)

    # ------------------------------------------------------------------ unsupported
    async def encode(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int], n_tokens: int,
                     kind: str = "image", meta: tuple[int, ...] = ()) -> torch.Tensor:
        raise EngineError("sglang engine cannot encode (capability 'encode' is False): "
                          "the encode stage uses the transformers vision encoder")

    async def prefill(self, request_id: str, prompt_ids: list[int], media: list[MediaEmbeds],
                      sampling: protocol.Sampling, prefix_kv: torch.Tensor | None = None) -> PrefillOutput:
        raise EngineError("sglang engine cannot prefill apart from decode (capability 'kv_export' is False): "
                          "SGLang's disaggregation is decode-first, see docs/design/sglang-engine.md")

    async def decode(self, request_id: str, kv: torch.Tensor, rope_delta: int, prompt_len: int, first_token: int,
                     sampling: protocol.Sampling, resume: tuple[int, ...] = (),
                     prompt_ids: tuple[int, ...] = ()) -> AsyncIterator[int]:
        raise EngineError("sglang engine cannot import a KV cache (capability 'kv_import' is False)")
        yield  # pragma: no cover  (makes this an async generator, like the protocol's decode)

    async def decode_remote(self, request_id: str, prompt_ids: list[int], kv: protocol.EngineKv, first_token: int,
                            sampling: protocol.Sampling, resume: tuple[int, ...] = ()) -> AsyncIterator[int]:
        raise EngineError("sglang engine cannot read a remote KV cache (capability 'remote_kv' is False)")
        yield  # pragma: no cover

    # ------------------------------------------------------------------ generate
    async def generate(self, request_id: str, prompt_ids: list[int], images: list[MediaEmbeds],
                       sampling: protocol.Sampling, resume: tuple[int, ...] = ()) -> AsyncIterator[int]:
        """Prompt (+ embeddings) → completion tokens, eos included when produced and last.
        ``resume``: tokens of an earlier attempt, yielded first and given to SGLang as prompt."""
        for token in resume:
            yield token
        rest = continuation(sampling, resume, self.eos_token_ids)
        if rest is None:
            return
        sampling, stops = rest
        request = {**self.prompts.build(prompt_ids, images, tail=tuple(resume)),
                   "sampling_params": sglang_sampling.sampling_params(sampling, already=len(resume)),
                   **sglang_sampling.logprob_args(sampling)}
        if len(request["input_ids"]) + sampling.max_tokens > self.max_model_len:
            raise EngineError(f"prompt of {len(request['input_ids'])} tokens + max_tokens {sampling.max_tokens} "
                              f"exceeds this engine's context of {self.max_model_len}")
        reader = sglang_sampling.StreamReader(sampling)
        produced = 0
        async with contextlib.aclosing(self._chunks(request_id, request)) as chunks:
            async for chunk in chunks:
                for token in reader.feed(chunk):
                    produced += 1
                    yield token
                    if token in stops or produced >= sampling.max_tokens:
                        return

    async def _chunks(self, request_id: str, request: dict) -> AsyncIterator[dict]:
        """SGLang's stream chunks for one request, each pulled from SGLang's loop; closing this
        early aborts the request there. Requests SGLang refuses raise :class:`EngineError`."""
        engine = self._engine
        if engine is None:
            raise EngineError("sglang engine is not started" if not self._stopping else "sglang engine is stopping")
        if request_id in self._rids:
            raise EngineError(f"request {request_id!r} is already running on this engine")
        rid = f"{request_id}#{uuid.uuid4().hex[:8]}"  # a redelivered request id is a new SGLang request
        self._rids[request_id] = rid
        finished = False
        stream = None
        try:
            try:
                stream = await self._on_sglang_loop(engine.async_generate(rid=rid, stream=True, **request))
                while True:
                    try:
                        chunk = await self._on_sglang_loop(stream.__anext__())
                    except StopAsyncIteration:
                        finished = True
                        return
                    finished = (chunk.get("meta_info") or {}).get("finish_reason") is not None
                    yield chunk
                    if finished:
                        return
            except (ValueError, TypeError) as exc:  # SGLang's refusals: too long, bad multimodal input
                raise EngineError(f"sglang rejected the request: {exc}") from exc
        finally:
            self._rids.pop(request_id, None)
            if not finished and self._loop is not None:
                self._loop.call_soon_threadsafe(engine.tokenizer_manager.abort_request, rid)
            if stream is not None and self._loop is not None:
                with contextlib.suppress(Exception):
                    await self._on_sglang_loop(stream.aclose())


def _end_processes(pids: list[int], timeout_s: float) -> None:
    """SIGTERM each process and its descendants, SIGKILL what is left after ``timeout_s``."""
    import psutil  # SGLang's own dependency: there whenever an engine started

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            p = psutil.Process(pid)
            procs += [*p.children(recursive=True), p]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
