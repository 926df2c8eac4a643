"""The transformers engine: the CPU reference, every capability (encode, generate, KV export and
import), on the family's split compute path, loading only the ``parts`` the worker runs
(:mod:`shared.models.loading`) on the settings' ``device`` / ``dtype``. All model work runs on
one ``ComputeLane`` thread. Concurrent encoder calls meet in a ``MicroBatcher``; decode steps of
all sequences generating at once in a ``DecodeBatcher`` (:mod:`shared.engines.batched`); prefills
that arrive while the lane is busy in a ``LaneBatcher`` (:mod:`shared.engines.batched_prefill`).
Token loops check for an abort between steps.

Design: docs/guide/modes-and-engines.md.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import torch

from shared import protocol
from shared.engines.base import Capabilities, MediaEmbeds, PrefillOutput
from shared.engines.batched import DecodeBatcher
from shared.engines.batched_prefill import prefill_many
from shared.engines.sampling import DecodeSeq, sample_at, stop_token_set, with_logprob
from shared.engines.structured import LazyGrammars
from shared.process.compute import ComputeLane, LaneBatcher, MicroBatcher

log = logging.getLogger(__name__)


def compute_class(model_dir: str | Path):
    """The family's split compute path (one interface: encode_media, prefill, start_decode,
    decode_step, and the model facts)."""
    from shared.models.registry import family_of

    name = family_of(model_dir).name
    if name == "qwen2_audio":
        from shared.engines.qwen2_audio import Qwen2AudioCompute

        return Qwen2AudioCompute
    if name == "llava":
        from shared.engines.llava import LlavaCompute

        return LlavaCompute
    if name == "qwen2_5_vl":
        from shared.engines.qwen2_5_vl import Qwen2_5_VLCompute

        return Qwen2_5_VLCompute
    if name == "llava_next":
        from shared.engines.llava import LlavaNextCompute

        return LlavaNextCompute
    if name == "llava_next_video":
        from shared.engines.llava import LlavaNextVideoCompute

        return LlavaNextVideoCompute
    from shared.engines.qwen2_vl import Qwen2VLCompute

    return Qwen2VLCompute


class TransformersEngine:
    name = "transformers"
    capabilities = Capabilities(encode=True, generate=True, kv_export=True, kv_import=True, prefix_kv=True)

    def __init__(self, model_dir: str | Path, *, encode_max_batch_items: int = 0,
                 encode_batch_wait_ms: float = 2.0, device: str = "cpu", dtype: str = "auto",
                 decode_max_batch: int = 16, prefill_max_batch: int = 8,
                 parts: frozenset[str] | None = None, inline_max_ms: float = 0.0) -> None:
        self._model_dir = Path(model_dir)
        self._inline_max_ms = inline_max_ms  # ComputeLane's; CPU only (below)
        self._parts = parts  # None: the whole model
        self._device, self._dtype = device, dtype  # settings device / dtype (shared.process.device)
        # 0: one item per encoder forward on CPU, where a batch costs the sum of its items and only
        # holds back its first ones (a cold window's first request waits for every request's images:
        # docs/benchmarks/window.md); a GPU runs a batch in about the time of one item
        self._batch_items = encode_max_batch_items or (1 if str(device).startswith("cpu") else 16)
        self._batch_wait_ms = encode_batch_wait_ms
        self._lane: ComputeLane | None = None
        self._batcher: MicroBatcher | None = None
        self._decode_max_batch = decode_max_batch
        self._decoder: DecodeBatcher | None = None
        self._prefill_max_batch = prefill_max_batch
        self._prefiller: LaneBatcher | None = None
        self._aborted: set[str] = set()
        # the request's grammar advanced over a prefix (sampling.structured), None without one
        self._constraint = LazyGrammars(lambda: (self.tokenizer, self.eos_token_ids))
        self.compute = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.compute is not None:
            return
        from shared.engines.qwen2_vl import MediaPixels

        # On a GPU a job's wall time is mostly the device's, and CUDA's current device is per thread:
        # only CPU compute runs inline
        inline_ms = self._inline_max_ms if str(self._device).startswith("cpu") else 0.0
        self._lane = ComputeLane(f"transformers-{self._model_dir.name}", inline_max_ms=inline_ms)
        cls = compute_class(self._model_dir)
        self.compute = await self._lane.run(lambda: cls(self._model_dir, device=self._device, dtype=self._dtype,
                                                        parts=self._parts))
        _report_memory(self.compute)
        if not getattr(self.compute, "supports_prefix_kv", False):  # only the M-RoPE path reuses a prefix
            self.capabilities = dataclasses.replace(self.capabilities, prefix_kv=False)
        compute = self.compute

        def encode_batch(items):
            return compute.encode_media([MediaPixels(*item) for item in items])

        self._batcher = MicroBatcher(encode_batch, self._lane, max_items=self._batch_items,
                                     max_wait_ms=self._batch_wait_ms, size_of=lambda item: int(item[0].shape[0]))
        await self._batcher.start()
        self._decoder = DecodeBatcher(compute, self._lane, max_batch=self._decode_max_batch)
        self._prefiller = LaneBatcher(lambda items: prefill_many(compute, items), self._lane,
                                      max_items=self._prefill_max_batch, size_of=_prefill_positions)

    async def stop(self) -> None:
        if self._decoder is not None:
            await self._decoder.stop()
            self._decoder = None
        if self._batcher is not None:
            await self._batcher.stop()
            self._batcher = None
        if self._lane is not None:
            self._lane.close()
            self._lane = None

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    # ------------------------------------------------------------------ model facts
    @property
    def tokenizer(self):
        return self.compute.tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.compute.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.compute.max_model_len

    @property
    def prefill_stats(self) -> tuple[int, int]:
        """(prefill batches run, prompts prefilled)."""
        return (self._prefiller.batches, self._prefiller.items) if self._prefiller else (0, 0)

    @property
    def encode_stats(self) -> tuple[int, int]:
        """(forwards run, items encoded) — how well requests were batched."""
        return (self._batcher.batches, self._batcher.items) if self._batcher else (0, 0)

    # ------------------------------------------------------------------ work
    async def encode(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int], n_tokens: int,
                     kind: str = "image", meta: tuple[int, ...] = ()) -> torch.Tensor:
        return await self._batcher.submit((pixels, grid_thw, n_tokens, kind, tuple(meta)))

    async def prefill(self, request_id: str, prompt_ids: list[int], media: list[MediaEmbeds],
                      sampling: protocol.Sampling, prefix_kv: torch.Tensor | None = None) -> PrefillOutput:
        result = await self._prefiller.submit((prompt_ids, media, prefix_kv))
        constraint = self._constraint(sampling, result.last_logits)
        logits = result.last_logits if constraint is None else constraint.mask(result.last_logits)
        first = sample_at(logits, sampling, step=0, prompt_ids=prompt_ids,
                          stop_ids=stop_token_set(sampling, self.eos_token_ids))
        first = with_logprob(first, result.last_logits, sampling)
        return PrefillOutput(first_token=first, kv=result.kv, rope_delta=result.rope_delta,
                             prompt_len=result.prompt_len)

    async def generate(self, request_id: str, prompt_ids: list[int], media: list[MediaEmbeds],
                       sampling: protocol.Sampling, resume: tuple[int, ...] = ()) -> AsyncIterator[int]:
        out = await self.prefill(request_id, prompt_ids, media, sampling)
        first = resume[0] if resume else out.first_token
        yield first
        async for token in self.decode(request_id, out.kv, out.rope_delta, out.prompt_len, first, sampling,
                                       resume=resume[1:], prompt_ids=tuple(prompt_ids)):
            yield token

    async def decode(self, request_id: str, kv: torch.Tensor, rope_delta: int, prompt_len: int, first_token: int,
                     sampling: protocol.Sampling, resume: tuple[int, ...] = (),
                     prompt_ids: tuple[int, ...] = ()) -> AsyncIterator[int]:
        """Yields tokens 2.. of the completion until a stop token (yielded; eos and
        ``stop_token_ids``, see ``sampling.stop_token_set``) or ``max_tokens``. ``prompt_ids``:
        the prompt as the gateway tokenized it (``repetition_penalty`` counts its tokens).

        ``resume``: tokens 2.. already generated by an earlier attempt (from the request's token
        log); they are fed through the model instead of being sampled, and yielded, so the
        sequence continues exactly where the log ends.
        """
        seq = DecodeSeq(sampling, self.eos_token_ids, first_token, resume=resume, prompt_ids=prompt_ids,
                        constraint_for=self._constraint)
        if seq.finished:
            return
        self._aborted.discard(request_id)
        state = await self._lane.run(self.compute.start_decode, kv, rope_delta, prompt_len, size=prompt_len)
        decoder = self._decoder
        decoder.open()
        try:
            while not seq.finished and request_id not in self._aborted:
                yield seq.next(await decoder.step(state, seq.token))
        finally:
            decoder.close()
            self._aborted.discard(request_id)


def _prefill_positions(item: tuple) -> int:
    """A prefill's size for the lane: its prompt's positions with the media's."""
    prompt_ids, media, _prefix_kv = item
    return len(prompt_ids) + sum(int(m[0].shape[0]) for m in media)  # MediaEmbeds, or (embeds, grid_thw)


def _report_memory(compute) -> None:
    """What the loaded model holds, by part, and the process's resident memory now."""
    from shared import metrics
    from shared.models.loading import resident_bytes, weight_bytes

    held = weight_bytes(compute.model)
    for part, n in held.items():
        metrics.MODEL_WEIGHT_BYTES.labels(part).set(n)
    mib = 1024 * 1024
    log.info("model loaded: %s weights, encoder %.1f MiB, LM %.1f MiB; process resident %.1f MiB",
             str(compute.dtype).removeprefix("torch."), held["encoder"] / mib, held["lm"] / mib,
             resident_bytes() / mib)


def preload_family(model_dir: str | Path) -> None:
    """Imports what :meth:`TransformersEngine.start` will for this model (its family's compute
    path, the model and processor classes) without loading weights: the zygote's preload
    (shared/process/zygote_main.py)."""
    from transformers import AutoConfig, AutoProcessor

    compute_class(model_dir)
    AutoProcessor.from_pretrained(str(model_dir))
    config = AutoConfig.from_pretrained(str(model_dir))
    import transformers

    for name in config.architectures or ():
        getattr(transformers, name, None)  # the lazy module imports the modeling code
