"""Decode in a process of its own: the transformers engine's decode core.

The LM, the batched steps and the sampling run in a child process
(:mod:`shared.engines.decode_core_main`) whose one thread does nothing else, instead of sharing a
GIL with the worker's event loop; the worker (:class:`CoreDecodeEngine`) keeps the I/O (Kafka,
Redis, NIXL) and only sends work and reads tokens, exactly the tokens of
``TransformersEngine.decode``. Worker ↔ core: one socketpair, length-prefixed msgpack frames.

Design: docs/design/decode-core.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator

import msgspec
import torch

from shared import metrics, protocol
from shared.engines.base import Capabilities, EngineError, SampledToken
from shared.engines.sampling import DecodeSeq
from shared.process.aio import succeeded

log = logging.getLogger(__name__)

HEAD = struct.Struct("<I")  # a frame: this length, then that many bytes of msgpack
READY_TIMEOUT_S = 600.0  # loading a real checkpoint can take minutes


# The decode core's private protocol: worker ↔ core frames over a socket pair (process-local,
# never on the fleet's wire, see shared.protocol). To the core: ``Start`` (the
# packed KV's bytes inline), ``Abort``. From it: ``Ready`` once the model is loaded, then one
# ``Step`` per forward: each stepped sequence's token, or its error. The core steps every active
# sequence (``max_batch`` per forward, in turn) back to back and reads what arrived between two
# steps; with none active it blocks on the socket. A full socket (a worker not reading) stops it:
# that is the backpressure.
class Start(msgspec.Struct, tag=True):
    sid: int  # the worker's id for this decode (a request may be decoded again: its retry)
    kv: bytearray  # the packed KV (``compute.start_decode``'s input), raw; writable, so the core wraps it as is
    kv_dtype: str
    kv_shape: tuple[int, ...]
    rope_delta: int
    prompt_len: int
    first_token: int
    sampling: protocol.Sampling
    resume: tuple[int, ...] = ()
    prompt_ids: tuple[int, ...] = ()


class Abort(msgspec.Struct, tag=True):
    sid: int


class Ready(msgspec.Struct, tag=True):
    eos_token_ids: tuple[int, ...]
    max_model_len: int


class Token(msgspec.Struct, array_like=True):
    sid: int
    token: int = -1
    logprob: protocol.TokenLogprob | None = None
    last: bool = False  # the sequence's last token: it left the core
    error: str | None = None  # the sequence failed and left the core


class Step(msgspec.Struct, tag=True):
    tokens: list[Token]
    batch: int  # sequences in the forward (0: failures before any forward)


ToCore = Start | Abort
FromCore = Ready | Step


def frame(msg) -> bytes:
    body = msgspec.msgpack.encode(msg)
    return HEAD.pack(len(body)) + body


class _Gone:
    """Queued to every decode in flight when the core died."""

    def __init__(self, why: str) -> None:
        self.why = why


class CoreDecodeEngine:
    """The ``Engine`` of a decode-only worker with ``decode_core`` on: ``decode`` through the core
    (the same :func:`~shared.engines.batched.decode_steps` and
    :class:`~shared.engines.sampling.DecodeSeq` as ``TransformersEngine.decode``).

    ``start`` spawns the core and returns while it loads its model (the worker joins its groups
    meanwhile); ``started`` waits for its Ready, and the worker is listed as serving only then. A
    core that dies fails the decodes in flight (``EngineError``; the runner retries them) and the
    next decode starts a new one. The core exits at EOF, i.e. when the worker closes or dies."""

    name = "transformers"
    capabilities = Capabilities(encode=False, generate=False, kv_export=False, kv_import=True, decodes_ahead=True)
    core_module = "shared.engines.decode_core_main"  # what the child runs (``python -m``)

    def __init__(self, model_dir, *, device: str = "cpu", dtype: str = "auto", max_batch: int = 16,
                 torch_threads: int = 1, spawner=None) -> None:
        self._model_dir = str(model_dir)
        self._spawner = spawner  # a shared.process.zygote.Zygote that forks the core (no imports to pay), else Popen
        self._argv = [sys.executable, "-m", self.core_module, "--model-dir", self._model_dir,
                      "--device", device, "--dtype", dtype, "--max-batch", str(max_batch),
                      "--threads", str(torch_threads)]
        self.tokenizer = None
        self.eos_token_ids: frozenset[int] = frozenset()
        self.max_model_len = 0
        self._proc = None  # subprocess.Popen, or shared.process.zygote.Adopted
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.Task | None = None
        self._boot: asyncio.Task | None = None  # the core's start: done once its Ready arrived
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue] = {}
        self._by_request: dict[str, set[int]] = {}
        self._aborted: set[int] = set()
        self.forwards = 0  # forwards the core ran, and sequence-steps in them (stats and tests)
        self.steps = 0
        self.starts = 0  # cores started (a restart after a crash counts)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Starts the core and loads the tokenizer; returns before the core has loaded its model
        (:meth:`started` waits for that), so the worker's start-up overlaps the core's."""
        async with self._lock:
            if self._boot is None:
                self._spawn()
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(_load_tokenizer, self._model_dir)

    async def started(self) -> None:
        """Returns once the core has loaded its model; EngineError if it could not."""
        await self._ensure_core()

    async def stop(self) -> None:
        async with self._lock:
            await self._close_core("the decode engine stopped")

    async def abort(self, request_id: str) -> None:
        for sid in self._by_request.get(request_id, ()):
            self._abort(sid)

    @property
    def pid(self) -> int | None:
        """The core's pid while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _died(self) -> bool:
        """The core started, and has died since (its reader saw EOF, or it exited)."""
        started = self._boot is not None and succeeded(self._boot)
        return started and (self._writer is None or self._proc is None or self._proc.poll() is not None)

    def _spawn(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [*self._argv, "--fd", str(theirs.fileno())]
        try:
            self._proc = None
            if self._spawner is not None:  # in this worker's process group, as a Popen child would be
                from shared.process.zygote import ZygoteGone

                try:
                    self._proc = self._spawner.spawn(argv, dict(os.environ), None, new_session=False,
                                                     pass_fds=(theirs.fileno(),))
                except ZygoteGone:
                    self._spawner = None
            if self._proc is None:
                self._proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self._boot = asyncio.create_task(self._await_ready(mine, self._proc), name="decode-core-boot")

    async def _await_ready(self, sock: socket.socket, proc) -> None:
        reader, self._writer = await asyncio.open_unix_connection(sock=sock)
        try:
            head = await asyncio.wait_for(reader.readexactly(HEAD.size), READY_TIMEOUT_S)
            ready = msgspec.msgpack.decode(await reader.readexactly(HEAD.unpack(head)[0]), type=FromCore)
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError) as exc:
            try:  # EOF comes a moment before the exit: wait for the code that says why
                code = await asyncio.to_thread(proc.wait, 2)
            except subprocess.TimeoutExpired:
                code = None
            raise EngineError(f"the decode core did not start ({type(exc).__name__}; exit code {code}); "
                              "its log is in this worker's") from None
        if not isinstance(ready, Ready):
            raise EngineError(f"the decode core said {type(ready).__name__} before Ready")
        self.eos_token_ids, self.max_model_len = frozenset(ready.eos_token_ids), ready.max_model_len
        self.starts += 1
        self._reader = asyncio.create_task(self._read(reader), name="decode-core-reader")
        log.info("decode core started: pid %d, model %s", proc.pid, self._model_dir)

    async def _ensure_core(self) -> None:
        async with self._lock:
            if self._boot is None or self._died():  # none yet (or a failed start reported), or one gone
                await self._close_core("the decode core is restarting")
                self._spawn()
            try:
                await asyncio.shield(self._boot)  # done already, but for the first decodes
            except Exception:  # noqa: BLE001 - reported to this caller; the next one starts a new core
                await self._close_core("the decode core did not start")
                raise

    async def _close_core(self, why: str) -> None:
        boot, self._boot = self._boot, None
        if boot is not None:
            boot.cancel()
            await asyncio.gather(boot, return_exceptions=True)
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()  # the core sees EOF and exits
        task, self._reader = self._reader, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), 10)
            except TimeoutError:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        self._fail_all(why)

    def _fail_all(self, why: str) -> None:
        for q in self._queues.values():
            q.put_nowait(_Gone(why))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        decoder = msgspec.msgpack.Decoder(FromCore)
        try:
            while True:
                head = await reader.readexactly(HEAD.size)
                msg = decoder.decode(await reader.readexactly(HEAD.unpack(head)[0]))
                if not isinstance(msg, Step):
                    continue
                if msg.batch:
                    self.forwards += 1
                    self.steps += msg.batch
                    metrics.DECODE_BATCH.observe(msg.batch)
                for tok in msg.tokens:
                    q = self._queues.get(tok.sid)
                    if q is not None:
                        q.put_nowait(tok)
        except (asyncio.IncompleteReadError, ConnectionError):
            code = self._proc.poll() if self._proc is not None else None
            why = f"the decode core exited (code {code})"
        except Exception as exc:  # noqa: BLE001 - a frame this side cannot read: no decode could go on
            log.exception("the decode core's output could not be read")
            why = f"the decode core's output could not be read ({type(exc).__name__})"
        log.error("%s; failing the %d decodes in flight", why, len(self._queues))
        writer, self._writer = self._writer, None  # the next decode starts a new core
        if writer is not None:
            writer.close()
        self._fail_all(why)

    # ------------------------------------------------------------------ work
    def _send(self, msg) -> None:
        if self._writer is None:
            raise EngineError("the decode core is not running")
        self._writer.write(frame(msg))  # one write per frame: frames never interleave

    def _abort(self, sid: int) -> None:
        if sid in self._queues and sid not in self._aborted:
            self._aborted.add(sid)
            self._queues[sid].put_nowait(None)  # wakes the iterator, which ends
            if self._writer is not None:
                self._send(Abort(sid))

    async def decode(self, request_id: str, kv: torch.Tensor, rope_delta: int, prompt_len: int, first_token: int,
                     sampling: protocol.Sampling, resume: tuple[int, ...] = (),
                     prompt_ids: tuple[int, ...] = ()) -> AsyncIterator[int]:
        """As ``TransformersEngine.decode``; the steps and the sampling run in the core."""
        await self._ensure_core()  # first: the eos ids come with the core's Ready
        if DecodeSeq(sampling, self.eos_token_ids, first_token).finished:  # nothing to generate after it
            return
        kv = kv.detach().to("cpu").contiguous()
        start = Start(sid=next(self._ids), kv=memoryview(kv.view(torch.uint8).numpy()),
                      kv_dtype=str(kv.dtype).removeprefix("torch."), kv_shape=tuple(kv.shape),
                      rope_delta=int(rope_delta), prompt_len=int(prompt_len), first_token=int(first_token),
                      sampling=sampling, resume=tuple(int(t) for t in resume),
                      prompt_ids=tuple(int(t) for t in prompt_ids))
        del kv
        sid, q = start.sid, asyncio.Queue()
        self._queues[sid] = q
        self._by_request.setdefault(request_id, set()).add(sid)
        ended = False
        try:
            self._send(start)
            await self._writer.drain()  # a large KV: wait for the socket rather than buffer without bound
            del start
            while True:
                tok = await q.get()
                if tok is None:  # aborted
                    ended = True
                    return
                if isinstance(tok, _Gone):
                    ended = True
                    raise EngineError(tok.why)
                if tok.error is not None:
                    ended = True
                    raise EngineError(f"decode failed in the decode core: {tok.error}")
                ended = tok.last
                yield SampledToken(tok.logprob) if tok.logprob is not None else tok.token
                if tok.last:
                    return
        finally:
            if not ended:  # the caller stopped early (a stop string, a client gone): free the core's slot
                self._abort(sid)
            self._queues.pop(sid, None)
            self._aborted.discard(sid)
            sids = self._by_request.get(request_id)
            if sids is not None:
                sids.discard(sid)
                if not sids:
                    del self._by_request[request_id]


def _load_tokenizer(model_dir: str):
    """The tokenizer the model's processor holds (the stream's detokenizer), without the rest
    of the processor."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
