"""Workloads: a seed and a few numbers → the exact list of requests to send.

``build(config)`` is a pure function of ``config`` (seed included); ``render`` makes one request
an OpenAI chat-completion body (streamed, ``include_usage``, temperature 0 by default). Images are
:class:`ImageRef` names sent as ``data:`` URLs or media-server ``http`` URLs. Kinds: ``text``;
``image`` (one fresh image); ``random-mm`` (images, sizes, words, max_tokens drawn per request);
``reuse`` (each image slot from a ``pool_size`` pool with probability ``reuse_ratio``);
``multiturn`` (sessions of ``turns`` turns resending the conversation with fixed assistant
replies and the last ``window`` images; turn-major); ``sliding-window`` (users of ``turns`` turns,
each one user message of the last ``window`` images: the first turn all new, then the oldest out
and one new in; turn-major). Words, not tokens. Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from loadtest.images import ImageRef, data_url

KINDS = ("text", "image", "random-mm", "reuse", "multiturn", "sliding-window")
_WORDS = ("the cat sat on a mat while blue birds sang over green hills and red boats drifted past old "
          "stone towers under bright summer skies near quiet rivers where children played with small "
          "wooden toys beside tall trees full of ripe yellow fruit and soft white clouds moved slowly "
          "across the wide open land toward distant mountains covered in snow").split()
_ASSISTANT_REPLY = "I see it. What else would you like to know?"


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "image"
    num_requests: int = 32
    seed: int = 0
    max_tokens: tuple[int, int] = (32, 32)  # (min, max) drawn per request
    text_words: tuple[int, int] = (8, 16)
    images: tuple[int, int] = (1, 1)  # per request (random-mm, reuse) or per turn (multiturn)
    resolutions: tuple[tuple[int, int], ...] = ((224, 224), (448, 336))
    image_format: str = "png"  # png | jpg
    pool_size: int = 8
    reuse_ratio: float = 0.5
    turns: int = 3
    window: int = 2

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Message:
    role: str
    text: str
    images: tuple[ImageRef, ...] = ()


@dataclass(frozen=True)
class RequestSpec:
    index: int
    messages: tuple[Message, ...]
    max_tokens: int
    session: int | None = None
    turn: int | None = None

    @property
    def images(self) -> tuple[ImageRef, ...]:
        return tuple(img for m in self.messages for img in m.images)


@dataclass
class _Gen:
    """The random state of one build: every draw goes through it, in a fixed order."""

    cfg: WorkloadConfig
    rng: random.Random = field(init=False)
    next_seed: int = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.cfg.seed)
        self.next_seed = self.cfg.seed * 1_000_003 + 1  # image seeds of different workloads differ

    def text(self) -> str:
        n = self.rng.randint(*self.cfg.text_words)
        return " ".join(self.rng.choice(_WORDS) for _ in range(n)).capitalize() + "?"

    def fresh_image(self) -> ImageRef:
        w, h = self.rng.choice(self.cfg.resolutions)
        self.next_seed += 1
        return ImageRef(self.next_seed, w, h, self.cfg.image_format)

    def max_tokens(self) -> int:
        return self.rng.randint(*self.cfg.max_tokens)


def build(cfg: WorkloadConfig) -> list[RequestSpec]:
    if cfg.kind not in KINDS:
        raise ValueError(f"unknown workload {cfg.kind!r}; choose from {', '.join(KINDS)}")
    if cfg.num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    g = _Gen(cfg)
    if cfg.kind == "multiturn":
        return _multiturn(g)
    if cfg.kind == "sliding-window":
        return _sliding_window(g)
    pool: list[ImageRef] = [g.fresh_image() for _ in range(cfg.pool_size)] if cfg.kind == "reuse" else []
    out = []
    for i in range(cfg.num_requests):
        if cfg.kind == "text":
            images: tuple[ImageRef, ...] = ()
        elif cfg.kind == "image":
            images = (g.fresh_image(),)
        else:  # random-mm, reuse
            n = g.rng.randint(*cfg.images)
            images = tuple(g.rng.choice(pool) if cfg.kind == "reuse" and g.rng.random() < cfg.reuse_ratio
                           else g.fresh_image() for _ in range(n))
        out.append(RequestSpec(i, (Message("user", g.text(), images),), g.max_tokens()))
    return out


def _multiturn(g: _Gen) -> list[RequestSpec]:
    cfg = g.cfg
    n_sessions = max(1, -(-cfg.num_requests // cfg.turns))
    per_session: list[list[RequestSpec]] = []
    for s in range(n_sessions):
        history: list[Message] = []
        turns = []
        for t in range(cfg.turns):
            n = g.rng.randint(*cfg.images)
            history.append(Message("user", g.text(), tuple(g.fresh_image() for _ in range(n))))
            turns.append(RequestSpec(-1, _window(history, cfg.window), g.max_tokens(), session=s, turn=t))
            history.append(Message("assistant", _ASSISTANT_REPLY))
        per_session.append(turns)
    ordered = [sess[t] for t in range(cfg.turns) for sess in per_session]
    return [RequestSpec(i, r.messages, r.max_tokens, r.session, r.turn)
            for i, r in enumerate(ordered[:cfg.num_requests])]


def _sliding_window(g: _Gen) -> list[RequestSpec]:
    """Each user's turn t shows images t .. t+window-1 of that user's own stream of fresh images:
    4 of 5 seen before at window 5, but never at the same place, so only an embedding cache (no
    prefix cache) saves their encode. Drawn user by user, so a user's content does not depend on
    how many users there are."""
    cfg = g.cfg
    if cfg.window < 1:
        raise ValueError("sliding-window needs window >= 1")
    n_users = max(1, -(-cfg.num_requests // cfg.turns))
    per_user = []
    for u in range(n_users):
        stream = [g.fresh_image() for _ in range(cfg.window)]
        turns = []
        for t in range(cfg.turns):
            if t:
                stream = [*stream[1:], g.fresh_image()]
            turns.append(RequestSpec(-1, (Message("user", g.text(), tuple(stream)),), g.max_tokens(),
                                     session=u, turn=t))
        per_user.append(turns)
    ordered = [user[t] for t in range(cfg.turns) for user in per_user]
    return [RequestSpec(i, r.messages, r.max_tokens, r.session, r.turn)
            for i, r in enumerate(ordered[:cfg.num_requests])]


def sessions_of(specs: list[RequestSpec]) -> list[list[int]]:
    """The indices of each session's requests in turn order (requests without a session: one
    each), sessions in order of their first request."""
    groups: dict[object, list[int]] = {}
    for k, spec in enumerate(specs):
        groups.setdefault(("s", spec.session) if spec.session is not None else ("r", k), []).append(k)
    return [sorted(g, key=lambda k: specs[k].turn or 0) for g in groups.values()]


def _window(history: list[Message], window: int) -> tuple[Message, ...]:
    """The conversation with only its last ``window`` images kept (older ones dropped)."""
    keep = window
    out = []
    for m in reversed(history):
        kept = m.images[max(0, len(m.images) - keep):] if keep > 0 else ()
        keep -= len(kept)
        out.append(Message(m.role, m.text, kept))
    return tuple(reversed(out))


def image_url(ref: ImageRef, delivery: str, media_base: str | None) -> str:
    if delivery == "data":
        return data_url(ref)
    if delivery == "http":
        if not media_base:
            raise ValueError("http delivery needs the media server's base URL")
        return f"{media_base}/img/{ref.name}"
    raise ValueError(f"unknown delivery {delivery!r}; choose data or http")


def render(spec: RequestSpec, *, model: str, delivery: str = "data", media_base: str | None = None,
           temperature: float = 0.0) -> dict:
    """One streamed OpenAI chat-completion body (usage requested: the client counts tokens by it)."""
    messages = []
    for m in spec.messages:
        if not m.images:
            messages.append({"role": m.role, "content": m.text})
            continue
        parts = [{"type": "image_url", "image_url": {"url": image_url(img, delivery, media_base)}}
                 for img in m.images]
        messages.append({"role": m.role, "content": [*parts, {"type": "text", "text": m.text}]})
    return {"model": model, "messages": messages, "max_tokens": spec.max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
