"""The vLLM engine on vLLM's v1 ``AsyncLLM``: generate (prefill + decode in one place), or prefill
and decode apart with the KV moved engine to engine (:mod:`shared.engines.vllm_pd`). Serves
``generate`` from prompt ids with one placeholder per media item plus precomputed embeddings
(:mod:`shared.engines.vllm_inputs`), no ``encode``, ``remote_kv`` in e-p-d and ep-d, and
``kv_events`` from vLLM's prefix cache in the fleet's block keys. Token ids stream as vLLM
produces them, eos included and last; greedy tokens equal ``generate()``. vLLM is imported
lazily; processes and threads: :mod:`shared.engines.vllm_process`.

Design: docs/design/vllm-engine.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import msgspec
import torch

from shared import protocol
from shared.engines import vllm_config, vllm_kv_events, vllm_pd, vllm_process, vllm_sampling
from shared.engines.base import Capabilities, EngineError, MediaEmbeds, PrefillOutput
from shared.engines.sampling import continuation, stop_token_set
from shared.engines.vllm_inputs import PromptBuilder
from shared.settings_vllm import VllmSettings
from shared.transfer.tensors import OwnerGoneError

log = logging.getLogger(__name__)

_MiB = 1 << 20
CPU_KV_CACHE_BYTES = 512 * _MiB  # default KV cache on CPU: ~500k tokens of the tiny model


class VllmEngine:
    name = "vllm"
    capabilities = Capabilities(encode=False, generate=True, kv_export=True, kv_import=True, remote_kv=True,
                                kv_events=True, cache_salt=True)

    def __init__(
        self,
        model_dir: str | Path,
        *,
        serving: VllmSettings | None = None,
        max_media_items: int = 8,
        mm_limits: dict[str, int] | None = None,
        kv_cache_bytes: int | None = None,
        num_threads: int = 1,
        seed: int = 0,
        dtype: str = "float32",
        shutdown_timeout_s: float = 20.0,
        kv_role: str | None = None,
        kv_host: str = "127.0.0.1",
        kv_lease_s: int = 30,
        kv_block_size: int = 16,
        kv_event_wait_s: float = 1.0,
        device: str = "cpu",
        kv_buffer_device: str = "auto",
    ) -> None:
        """``serving``: vLLM's serving knobs (``vllm_*`` settings; defaults: vLLM's);
        ``max_media_items``: media items per prompt at most, ``mm_limits``: per modality
        (default: ``max_media_items`` each). ``kv_role``: None (generate only),
        ``vllm_pd.PRODUCER`` (prefill apart) or ``vllm_pd.CONSUMER`` (decode apart);
        ``kv_host``: the address consumers reach this engine's NIXL side channel at;
        ``kv_lease_s``: how long a producer keeps unread KV;
        ``kv_block_size``: the fleet's KV block (hashing, routing): vLLM's block is the
        smallest multiple of it and 32 (:mod:`shared.engines.vllm_kv_events`), and a producer
        reports its prefix cache's changes in those keys, waiting up to ``kv_event_wait_s``
        for a prefill's own block events. ``device``: cpu | cuda | cuda:N (the vLLM build must
        run there); ``kv_buffer_device``: where the connector's blocks live (vllm_pd)."""
        from transformers import AutoTokenizer, GenerationConfig

        self._model_dir = Path(model_dir)
        # None: a fixed 512 MiB on CPU (vLLM would otherwise reserve gpu_memory_utilization of
        # ALL host memory), vLLM's own sizing from gpu_memory_utilization on a GPU.
        self._device = str(device)
        self._kv_buffer_device = vllm_pd.kv_buffer_device(kv_buffer_device, self._device)
        if kv_cache_bytes is None and self._device == "cpu":
            kv_cache_bytes = CPU_KV_CACHE_BYTES
        self._kv_cache_bytes = kv_cache_bytes
        self._serving = serving or VllmSettings()
        self._num_threads = num_threads
        self._seed = seed
        self._dtype = dtype
        self._shutdown_timeout_s = shutdown_timeout_s
        self._kv_role = kv_role
        self._kv_host = kv_host
        self._kv_lease_s = kv_lease_s
        self.kv_block_size = kv_block_size
        self.block_size = vllm_kv_events.vllm_block_size(kv_block_size)
        self._kv_event_wait_s = kv_event_wait_s

        config = json.loads((self._model_dir / "config.json").read_text())
        text_cfg = config.get("text_config", config)
        self.hidden_size: int = int(text_cfg["hidden_size"])
        model_len = int(text_cfg["max_position_embeddings"])
        # above the model's: refused at start (vllm_config.refusals), and by vLLM itself
        self.max_model_len: int = self._serving.vllm_max_model_len_tokens or model_len
        self.tokenizer = AutoTokenizer.from_pretrained(str(self._model_dir))
        self.eos_token_ids: frozenset[int] = vllm_process.eos_ids(self._model_dir, text_cfg, GenerationConfig)
        # refuses (ValueError naming the reason) a family or modality vLLM cannot take as embeddings
        self.prompts = PromptBuilder(self._model_dir, self.tokenizer, max_media_items, mm_limits)
        self.modalities = self.prompts.modalities
        self._events: vllm_kv_events.EventSubscriber | None = None  # a producer's cache events

        self._llm = None  # vllm AsyncLLM once started
        self._in_flight: set[str] = set()
        self._stopping = False
        self.startup_s: float | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._llm is not None:
            return
        self._stopping = False
        t0 = time.monotonic()
        # connect first: the engine core binds the path; no prefix cache, no block events to wait for
        if self._kv_role == vllm_pd.PRODUCER and self._serving.vllm_enable_prefix_caching:
            self._events = vllm_kv_events.EventSubscriber(
                vllm_kv_events.ipc_endpoint(),
                vllm_kv_events.BlockTranslator(self.block_size // self.kv_block_size))
            self._events.start()
        # Building the engine blocks (spawns the engine core and waits for it to load the
        # model): run it off the event loop. AsyncLLM binds to the running loop only when a
        # request arrives (its output handler starts on the first add_request).
        box: list = []
        # (the engine travels in ``box``, not as the thread's return value: asyncio keeps the
        # last to_thread future alive, and with it a reference that would outlive stop())
        try:
            await asyncio.to_thread(lambda: box.append(self._build()))
        except BaseException:
            await self._stop_events()
            raise
        self._llm = box.pop()
        self.max_model_len = int(self._llm.model_config.max_model_len)
        try:
            armed = await self._llm.collective_rpc("mmfleet_setup_engine_process", timeout=30)
        except Exception as exc:  # noqa: BLE001 — a missing watchdog must not fail start-up
            armed = [exc]
        if armed != [True]:
            log.warning("vllm engine core has no parent watchdog (%r): it would outlive a SIGKILLed worker", armed)
        self.startup_s = time.monotonic() - t0
        log.info("vllm engine up in %.1f s (model %s, max_model_len %d)", self.startup_s,
                 self._model_dir, self.max_model_len)
        if self.prompts.raw:
            log.info("vllm takes %s %s as raw media (its own processor and encoder; the encode stage passes "
                     "them through), %s as embeddings", self.prompts.family, ", ".join(sorted(self.prompts.raw)),
                     ", ".join(sorted(self.modalities - self.prompts.raw)) or "nothing")

    def _build(self):
        from vllm.platforms import current_platform

        vllm_pd.check_platform(self._device, current_platform.device_type)
        env = {"OMP_NUM_THREADS": str(self._num_threads), **vllm_process.watchdog_env()}
        if (visible := vllm_pd.visible_devices(self._device, dict(os.environ))) is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        if self._kv_role is not None:
            env.update(vllm_pd.side_channel_env(self._kv_host, vllm_pd.free_port(self._kv_host)))
        return vllm_process.build_async_llm(env, self.engine_args())

    def engine_args(self) -> dict:
        """vLLM's engine arguments for this engine (:func:`vllm_config.engine_args` + its KV
        connector and event configs); builds nothing (``vllm_process.engine_config`` reads them
        back as vLLM's config)."""
        args = vllm_config.engine_args(
            self._model_dir, self._serving, device=self._device, dtype=self._dtype, seed=self._seed,
            max_model_len=self.max_model_len, block_size=self.block_size, kv_cache_bytes=self._kv_cache_bytes,
            limits=self.prompts.limits(), kv_role=self._kv_role)
        if self._kv_role is not None:
            args["kv_transfer_config"] = vllm_pd.transfer_config(self._kv_role, self._kv_lease_s,
                                                                 self._kv_buffer_device)
        if self._events is not None:
            args["kv_events_config"] = vllm_kv_events.events_config(self._events.endpoint)
        return args

    async def stop(self) -> None:
        llm, self._llm = self._llm, None
        if llm is None:
            return
        self._stopping = True
        # End every open stream first: a generate() waiting on a shut-down engine never wakes.
        if self._in_flight:
            with contextlib.suppress(Exception):
                await llm.abort(list(self._in_flight))
        # Stop the output relay before the engine core goes: otherwise it sees the core die and
        # logs an EngineDeadError at ERROR level during an orderly stop.
        handler = getattr(llm, "output_handler", None)
        if handler is not None and not handler.done():
            handler.cancel()
            await asyncio.wait([handler])
        procs = list(getattr(getattr(getattr(llm.engine_core, "resources", None), "engine_manager", None),
                             "processes", None) or [])
        await asyncio.to_thread(vllm_process.shutdown, llm, procs, self._shutdown_timeout_s)
        del llm  # drop the last reference now, not at interpreter exit (its __del__ shuts down again)
        await self._stop_events()

    async def _stop_events(self) -> None:
        events, self._events = self._events, None
        if events is not None:
            await events.stop()

    async def abort(self, request_id: str) -> None:
        llm = self._llm
        if llm is not None and request_id in self._in_flight:
            await llm.abort(request_id)

    # ------------------------------------------------------------------ unsupported
    async def encode(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int], n_tokens: int) -> torch.Tensor:
        raise EngineError("vllm engine cannot encode (capability 'encode' is False): "
                          "the encode stage uses the transformers vision encoder")

    async def decode(self, request_id: str, kv: torch.Tensor, rope_delta: int, prompt_len: int, first_token: int,
                     sampling: protocol.Sampling, resume: tuple[int, ...] = (),
                     prompt_ids: tuple[int, ...] = ()) -> AsyncIterator[int]:
        raise EngineError("vllm engine cannot import a packed KV tensor: its KV moves engine to engine "
                          "(capability 'remote_kv', decode_remote)")
        yield  # pragma: no cover  (makes this an async generator, like the protocol's decode)

    # ------------------------------------------------------------------ prefill / decode apart
    async def prefill(self, request_id: str, prompt_ids: list[int], images: list[MediaEmbeds],
                      sampling: protocol.Sampling, prefix_kv: torch.Tensor | None = None,
                      block_keys: Sequence[int] = (), cache_salt: str = "") -> PrefillOutput:
        """Prompt → first token, the KV left in this engine for a consumer (kv_producer only).

        ``block_keys``: the prompt's block hashes in the fleet's keys; the output's
        ``kv_changes`` are this engine's prefix-cache changes since the last prefill in those
        keys (this request's blocks included: it waits up to ``kv_event_wait_s`` for their
        events), ``cached_tokens`` the positions vLLM's prefix cache gave."""
        if self._kv_role != vllm_pd.PRODUCER:
            raise EngineError("this vllm engine was not built as a KV producer (kv_role); it cannot prefill apart")
        params = self._sampling_params(msgspec.structs.replace(sampling, max_tokens=1),
                                       kv_transfer={"do_remote_decode": True})
        events = self._events
        session = f"{request_id}#{uuid.uuid4().hex[:8]}"  # a redelivered request_id is a new session
        if events is not None:
            events.translator.register(session, block_keys)
        # (registrations are kept, LRU-bounded, past this call: events that trail it still translate)
        first, kv_params, prompt_len, cached = None, None, 0, 0
        prompt = self.prompts.build(prompt_ids, images, cache_salt=cache_salt)
        async with contextlib.aclosing(self._outputs(request_id, prompt, params, session_id=session)) as outs:
            async for out in outs:
                prompt_len = len(out.prompt_token_ids or ()) or prompt_len
                cached = int(getattr(out, "num_cached_tokens", 0) or 0)
                completion = out.outputs[0] if out.outputs else None
                if completion is not None and completion.token_ids and first is None:
                    first = vllm_sampling.sampled(completion, 0, sampling)
                if out.finished:
                    kv_params = out.kv_transfer_params
        if first is None:
            raise EngineError(f"vllm produced no first token for {request_id!r}")
        changes = None
        if events is not None:  # the prompt's whole vLLM blocks that have keys: wait for their events
            want = min(prompt_len // self.block_size, len(block_keys) // events.translator.ratio)
            changes = await events.changes_after(session, want, self._kv_event_wait_s)
        media = [protocol.MediaShape(getattr(m, "kind", "image"), tuple(m[1]), _tokens_of(m),
                                     float(getattr(m, "second_per_grid_t", 0.0))) for m in images]
        if any(m.kind in self.prompts.raw for m in media):  # vLLM's own processor counted these items' tokens
            counted = len(prompt_ids) + sum(m.n_tokens - 1 for m in media)
            if prompt_len != counted:
                raise EngineError(f"vLLM expanded the prompt of {request_id!r} to {prompt_len} tokens where the "
                                  f"fleet counted {counted}: raw-media token counts disagree")
        return PrefillOutput(first_token=first, kv=None, rope_delta=0, prompt_len=prompt_len,
                             engine_kv=vllm_pd.to_wire(kv_params, media), cached_tokens=cached, kv_changes=changes)

    async def decode_remote(self, request_id: str, prompt_ids: list[int], kv: protocol.EngineKv, first_token: int,
                            sampling: protocol.Sampling, resume: tuple[int, ...] = ()) -> AsyncIterator[int]:
        """Read the producer's KV, then continue after ``first_token`` (kv_consumer only).

        The request given to vLLM is the prompt + ``first_token`` + ``resume``; the positions
        after the producer's are computed here. Yields ``resume``, then new tokens. A failed
        read raises :class:`OwnerGoneError` (the runner restarts the request from its source)."""
        if self._kv_role != vllm_pd.CONSUMER:
            raise EngineError("this vllm engine was not built as a KV consumer (kv_role); it cannot decode apart")
        for token in resume:
            yield token
        remaining = sampling.max_tokens - 1 - len(resume)
        # Nothing left to generate: still read once (one discarded token), which tells the
        # producer to free the blocks now; unread, its engine core would keep stepping, a busy
        # loop, until their lease passes.
        done = remaining <= 0 or (first_token, *resume)[-1] in stop_token_set(sampling, self.eos_token_ids)
        ids, shapes = self.prompts.expand_raw(list(prompt_ids), kv.media)  # raw items need no media here
        media = vllm_pd.placeholder_media(tuple(shapes), self.hidden_size)
        prompt = self.prompts.build(ids, media, tail=(first_token, *resume), raw_expanded=True)
        params = self._sampling_params(msgspec.structs.replace(sampling, max_tokens=1 if done else remaining),
                                       kv_transfer=vllm_pd.from_wire(kv), already=1 + len(resume),
                                       prefix=(int(first_token), *resume))
        stops = stop_token_set(sampling, self.eos_token_ids)
        produced = 0
        async with contextlib.aclosing(self._outputs(request_id, prompt, params)) as outs:
            async for out in outs:
                completion = out.outputs[0] if out.outputs else None
                if completion is None or done:
                    continue
                if completion.finish_reason == "error":
                    raise OwnerGoneError(f"vllm could not read the prompt's KV from engine {kv.remote_engine_id} at "
                                         f"{kv.remote_host}:{kv.remote_port} (producer gone or its lease passed)")
                for i, token in enumerate(completion.token_ids):
                    produced += 1
                    yield vllm_sampling.sampled(completion, i, sampling)
                    if token in stops or produced >= remaining:
                        return

    # ------------------------------------------------------------------ generate
    async def generate(self, request_id: str, prompt_ids: list[int], images: list[MediaEmbeds],
                       sampling: protocol.Sampling, resume: tuple[int, ...] = (),
                       cache_salt: str = "") -> AsyncIterator[int]:
        """Prefill + decode in vLLM; yields completion token ids (eos included when produced).
        ``cache_salt``: the request's cache scope (vLLM's prefix cache shares blocks within it only).

        ``resume`` (tokens an earlier attempt already streamed, from the token log): yielded
        first, and appended to the prompt so vLLM continues after them with the remaining
        budget. Greedy continuations equal an uninterrupted run; seeded sampling continues
        from a fresh draw (vLLM's sampler has no notion of a step index).
        """
        for token in resume:
            yield token
        rest = continuation(sampling, resume, self.eos_token_ids)
        if rest is None:
            return
        sampling, stops = rest
        produced = 0
        prompt = self.prompts.build(prompt_ids, images, tail=tuple(resume), cache_salt=cache_salt)
        params = self._sampling_params(sampling, already=len(resume), prefix=tuple(resume))
        async with contextlib.aclosing(self._outputs(request_id, prompt, params)) as outs:
            async for out in outs:
                completion = out.outputs[0] if out.outputs else None
                if completion is not None:
                    for i, token in enumerate(completion.token_ids):
                        produced += 1
                        yield vllm_sampling.sampled(completion, i, sampling)
                        if token in stops or produced >= sampling.max_tokens:
                            return

    async def _outputs(self, request_id: str, prompt: dict, params, session_id: str | None = None) -> AsyncIterator:
        """vLLM's outputs for one request until it finishes; closing this iterator early
        aborts the request (callers hold it in ``contextlib.aclosing``, so closing them closes
        it at once rather than when it is garbage-collected). Requests vLLM refuses raise
        :class:`EngineError`. ``session_id``: stamped by vLLM on the request's KV events."""
        llm = self._llm
        if llm is None:
            raise EngineError("vllm engine is not started" if not self._stopping else "vllm engine is stopping")
        if request_id in self._in_flight:
            raise EngineError(f"request {request_id!r} is already running on this engine")
        rejected = vllm_process.request_errors()
        try:
            engine_input = await vllm_process.render(llm, prompt)
        except rejected as exc:
            raise EngineError(f"vllm rejected the prompt: {exc}") from exc

        self._in_flight.add(request_id)
        stream = llm.generate(engine_input, params, request_id, session_id=session_id)
        try:
            async for out in stream:
                yield out
                if out.finished:
                    return
        except rejected as exc:  # e.g. prompt longer than max_model_len, caught at add_request
            raise EngineError(f"vllm rejected the request: {exc}") from exc
        finally:
            self._in_flight.discard(request_id)
            # Closing vLLM's generator while its request still runs aborts it (AsyncLLM.generate
            # aborts on GeneratorExit): covers our consumer's aclose() and a request that ended
            # on our side first (eos / max_tokens seen before vLLM marked it finished).
            with contextlib.suppress(Exception):
                await stream.aclose()

    def _sampling_params(self, sampling: protocol.Sampling, kv_transfer: dict | None = None, already: int = 0,
                         prefix: tuple[int, ...] = ()):
        return vllm_sampling.sampling_params(sampling, self.eos_token_ids, kv_transfer, already, prefix)


def _tokens_of(item: MediaEmbeds) -> int:
    """An item's prompt tokens: its own count (raw media), else its embedding's rows."""
    return int(getattr(item, "n_tokens", 0) or item[0].shape[0])
