"""The decode core's process (``python -m shared.engines.decode_core_main``, started by
:class:`~shared.engines.decode_core.CoreDecodeEngine`): it loads the LM, says ``Ready``, then
serves the worker's frames on its one thread until EOF (see :mod:`shared.engines.decode_core`
for the contract).

Design: docs/design/decode-core.md.
"""

from __future__ import annotations

import argparse
import logging
import select
import signal
import socket

import msgspec
import torch

from shared.engines.decode_core import HEAD, Abort, Ready, Step, ToCore, Token, frame
from shared.engines.sampling import DecodeSeq

log = logging.getLogger(__name__)


class _Seq:
    __slots__ = ("state", "seq")

    def __init__(self, state, seq: DecodeSeq) -> None:
        self.state, self.seq = state, seq


class Core:
    """The core's loop (its process's only thread): read, step, send."""

    def __init__(self, compute, sock: socket.socket, max_batch: int) -> None:
        from shared.engines.batched import Stack
        from shared.engines.structured import LazyGrammars

        self._compute = compute
        self._sock = sock
        self._max_batch = max(1, max_batch)
        self._buf = bytearray()
        self._seqs: dict[int, _Seq] = {}
        self._stack = Stack()
        self._grammars = LazyGrammars(lambda: (compute.tokenizer, compute.eos_token_ids))
        self._decoder = msgspec.msgpack.Decoder(ToCore)
        self._failed: list[Token] = []  # failures outside a forward, sent with the next Step

    def serve(self) -> None:
        self._sock.setblocking(False)
        while self._read(block=not self._seqs and not self._failed):
            if self._seqs:
                self._step()
            elif self._failed:
                self._send(Step(self._failed, batch=0))
                self._failed = []
            if not self._seqs and self._stack.members:
                self._stack.drop()  # nobody decoding: free the KV the stack holds

    def _read(self, block: bool) -> bool:
        """Take in every frame that arrived (waiting for one when ``block``); False at EOF."""
        if block:
            select.select([self._sock], [], [])
        while True:
            try:
                chunk = self._sock.recv(1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                return False
            self._buf += chunk
        while len(self._buf) >= HEAD.size:
            n = HEAD.unpack_from(self._buf)[0]
            if len(self._buf) < HEAD.size + n:
                break
            with memoryview(self._buf) as view, view[HEAD.size:HEAD.size + n] as body:
                msg = self._decoder.decode(body)  # copies out: the buffer may shrink below
            del self._buf[:HEAD.size + n]
            self._handle(msg)
        return True

    def _handle(self, msg) -> None:
        if isinstance(msg, Abort):
            self._seqs.pop(msg.sid, None)
            return
        try:
            kv = torch.frombuffer(msg.kv, dtype=torch.uint8).view(getattr(torch, msg.kv_dtype))
            state = self._compute.start_decode(kv.reshape(msg.kv_shape), msg.rope_delta, msg.prompt_len)
        except Exception as exc:  # noqa: BLE001 - this request fails, the core goes on
            log.exception("decode core: request %d could not start", msg.sid)
            self._failed.append(Token(msg.sid, error=f"{type(exc).__name__}: {exc}"))
            return
        seq = DecodeSeq(msg.sampling, self._compute.eos_token_ids, msg.first_token, resume=msg.resume,
                        prompt_ids=msg.prompt_ids, constraint_for=self._grammars)
        self._seqs[msg.sid] = _Seq(state, seq)

    def _step(self) -> None:
        from shared.engines.batched import decode_steps

        sids = list(self._seqs)[:self._max_batch]
        if len(self._seqs) > self._max_batch:  # more than one forward holds: the others go first next
            for sid in sids:
                self._seqs[sid] = self._seqs.pop(sid)
        batch = [self._seqs[sid] for sid in sids]
        out, self._failed = self._failed, []
        try:
            logits = decode_steps(self._compute, [(s.state, s.seq.token) for s in batch], self._stack)
        except Exception as exc:  # noqa: BLE001 - the batch's requests fail (their KV is torn), the core goes on
            log.exception("decode core: a forward of %d sequences failed", len(batch))
            for sid in sids:
                del self._seqs[sid]
                out.append(Token(sid, error=f"{type(exc).__name__}: {exc}"))
            self._send(Step(out, batch=0))
            return
        for sid, s, lg in zip(sids, batch, logits, strict=True):
            try:
                token = s.seq.next(lg)
            except Exception as exc:  # noqa: BLE001 - e.g. a grammar that cannot go on: this request alone
                del self._seqs[sid]
                out.append(Token(sid, error=f"{type(exc).__name__}: {exc}"))
                continue
            if s.seq.finished:
                del self._seqs[sid]
            out.append(Token(sid, int(token), getattr(token, "logprob", None), last=s.seq.finished))
        self._send(Step(out, batch=len(batch)))

    def _send(self, msg) -> None:
        data = memoryview(frame(msg))
        while data:
            try:
                data = data[self._sock.send(data):]
            except BlockingIOError:  # the worker is behind: wait for room (backpressure)
                select.select([], [self._sock], [])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="the decode core's process (started by its worker)")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the worker too: the core ends at its EOF
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s decode-core[%(process)d] %(message)s")
    sock = socket.socket(fileno=args.fd)
    torch.set_num_threads(args.threads)
    from shared.engines.transformers_engine import compute_class
    from shared.models.loading import LM

    compute = compute_class(args.model_dir)(args.model_dir, device=args.device, dtype=args.dtype,
                                            parts=frozenset({LM}))
    sock.sendall(frame(Ready(tuple(sorted(compute.eos_token_ids)), int(compute.max_model_len))))
    try:
        Core(compute, sock, args.max_batch).serve()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the worker is gone
    log.info("decode core: the worker closed its end; exiting")


if __name__ == "__main__":
    main()
