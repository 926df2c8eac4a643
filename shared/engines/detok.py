"""Incremental detokenisation and stop-string handling for streamed output.

``IncrementalDetokenizer`` turns a stream of token ids into text deltas whose
concatenation equals ``tokenizer.decode(all_ids, skip_special_tokens=...)``.  A
byte-level BPE can split one UTF-8 character over several tokens; while the decoded
tail is incomplete (ends in U+FFFD) the text is held back, and released once the
character completes (or by ``flush`` at the end).

``StopChecker`` applies OpenAI-style stop strings to that text stream: output is cut
before the earliest stop string (which is not emitted), and a tail that could still
become a stop string is held back until the next delta resolves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

_REPLACEMENT = "\ufffd"
# Tokens decoded again as context before the unread ones; byte-level tokens of one
# character never span more than 4 bytes, so a small window suffices.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Per-request, not thread-safe.  ``push(token_id) -> delta``, ``flush() -> rest``."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        # ids[_prefix:_read] were already emitted and are re-decoded only as context
        # (decoding a byte-level token alone can differ from decoding it in sequence).
        self._prefix = 0
        self._read = 0
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False
        )

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly "")."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""  # nothing new, or an incomplete multi-byte character at the end
        delta = full_text[len(prefix_text) :]
        self._read = len(self._ids)
        self._prefix = max(self._prefix, self._read - _CONTEXT_TOKENS)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Release held-back text at end of stream (incomplete bytes become U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        delta = full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else ""
        self._read = len(self._ids)
        self.text += delta
        return delta


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
