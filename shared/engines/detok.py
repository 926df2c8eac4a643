"""Incremental detokenisation and stop-string handling for streamed output.

``IncrementalDetokenizer`` turns token ids into text deltas whose concatenation equals
``tokenizer.decode(all_ids, skip_special_tokens=True)`` (`tokenizers`' ``DecodeStream``, which
holds back a UTF-8 character split over several tokens, plus ``flush``). ``StopChecker`` applies
OpenAI-style stop strings: output is cut before the earliest stop string (not emitted), and a
tail that could still become one is held back until the next delta resolves it.

Design: docs/design/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Per-request, not thread-safe.  ``push(token_id) -> delta``, ``flush() -> rest``.
    ``tokenizer``: a transformers fast tokenizer or a ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # ids pushed since the last text DecodeStream gave back

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly "")."""
        chunk = self._stream.step(self._backend, int(token_id))
        if chunk is None:
            self._held.append(int(token_id))
            return ""
        self._held.clear()
        return chunk

    def flush(self) -> str:
        """Release held-back text at end of stream (incomplete bytes become U+FFFD)."""
        held, self._held = self._held, []
        return self._backend.decode(held, skip_special_tokens=self._skip) if held else ""


@dataclass(frozen=True)
class StopResult:
    """``emit``: text safe to send now.  ``stopped``: a stop string was found; the
    stream ends after ``emit`` and ``matched`` names the stop string."""

    emit: str
    stopped: bool
    matched: str | None = None


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Index of the earliest stop-string occurrence in ``text`` and which one, or None."""
    best: tuple[int, str] | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class StopChecker:
    """Feed text deltas; get back what may be emitted and whether to stop.

    Invariant: emitted text never contains a stop string nor the start of one that
    is still undecided.  After ``stopped`` further feeds are errors.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> StopResult:
        if self.stopped:
            raise RuntimeError("StopChecker already stopped")
        buf = self._held + delta
        hit = find_stop(buf, self._stops)
        if hit is not None:
            self._held = ""
            self.stopped = True
            return StopResult(emit=buf[: hit[0]], stopped=True, matched=hit[1])
        keep = partial_stop_len(buf, self._stops)
        self._held = buf[len(buf) - keep :] if keep else ""
        return StopResult(emit=buf[: len(buf) - keep], stopped=False)

    def flush(self) -> str:
        """End of stream without a stop: release the held-back tail."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
