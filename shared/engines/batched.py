"""Batched decode: one forward for one step of many sequences, and the loop that gathers them.

:func:`decode_steps` runs one sequence through the family's own ``decode_step`` and several as
ONE forward, each sequence's KV left-padded to the longest under a mask that hides the padding,
positions per sequence (M-RoPE: ``cache_len + rope_delta`` on the three axes). The padded batch
(:class:`Stack`) is kept while the same sequences step together. :class:`DecodeBatcher` gathers
the steps of the sequences generating at once into such forwards.

Design: docs/design/decode-core.md.
"""

from __future__ import annotations

import asyncio

import torch

from shared import metrics
from shared.process.aio import wait_event


def _uses_mrope(compute) -> bool:
    return getattr(compute, "mrope", False)


class Stack:
    """The padded KV of the last batched step, owned by one :class:`DecodeBatcher` and used on
    its lane only. While it holds ``members``, their own ``state.cache`` are stale: the truth
    is row ``i``'s last ``lens[i]`` columns here (:meth:`write_back` puts it back).

    A step appends its column to the stack, as a lone sequence's step appends to its own cache;
    only when the set of sequences changes is it written back (views, no copy) and rebuilt.
    Rebuilding every step copied all the batch's KV 3-4 times a step: at 2.2k-token contexts a
    batched step of 4 took 1.7x as long as 4 lone steps."""

    def __init__(self) -> None:
        self.members: list = []
        self.cache = None  # DynamicCache over [len(members), kv_heads, width, head_dim] per layer
        self.lens: list[int] = []
        self.builds = 0  # stacks built, and batched steps that found theirs built (stats and tests)
        self.reused = 0

    def holds(self, states: list) -> bool:
        return len(states) == len(self.members) and all(a is b for a, b in zip(states, self.members, strict=True))

    def write_back(self) -> None:
        """Give each member its own KV again (views into the stack: no copy) and empty it. The
        members' own cache objects are kept and their layers repointed: building a
        DynamicCache costs ~0.1 ms, as much as a tiny model's decode step."""
        if self.cache is not None:
            width = self.cache.get_seq_length()
            for li, layer in enumerate(self.cache.layers):
                for i, (state, n) in enumerate(zip(self.members, self.lens, strict=True)):
                    own = state.cache.layers[li]
                    own.keys, own.values = layer.keys[i:i + 1, :, width - n:], layer.values[i:i + 1, :, width - n:]
        self.drop()

    def drop(self) -> None:
        self.members, self.cache, self.lens = [], None, []

    def build(self, compute, states: list) -> None:
        """Stack ``states``' own caches, left-padded to the longest."""
        from shared.engines.kv_grow import growing_cache

        lens = [state.cache.get_seq_length() for state in states]
        width = max(lens)
        layers = []
        for li in range(len(states[0].cache.layers)):
            ks, vs = [], []
            for state, n in zip(states, lens, strict=True):
                k, v = state.cache.layers[li].keys, state.cache.layers[li].values
                pad = width - n
                if pad:  # left padding: every sequence's new token lands in the same last column
                    k = torch.nn.functional.pad(k, (0, 0, pad, 0))
                    v = torch.nn.functional.pad(v, (0, 0, pad, 0))
                ks.append(k)
                vs.append(v)
            layers.append((torch.cat(ks), torch.cat(vs)))
        self.members, self.lens = list(states), lens
        self.builds += 1
        self.cache = growing_cache(compute.cache_config, layers)


@torch.inference_mode()
def decode_steps(compute, items: list, stack: Stack | None = None) -> list[torch.Tensor]:
    """Next-token logits (float32 [vocab], on the CPU) per ``(state, token)``, in order; appends
    the token to each state's KV like ``decode_step`` does (into ``stack`` while it holds the state)."""
    stack = stack if stack is not None else Stack()
    states = [state for state, _ in items]
    if len(items) == 1:
        if stack.members:
            stack.write_back()
        return [compute.decode_step(states[0], items[0][1])]
    if stack.holds(states):
        stack.reused += 1
    else:
        stack.write_back()
        stack.build(compute, states)
    lens = stack.lens
    width = stack.cache.get_seq_length()
    dev = getattr(compute, "device", "cpu")  # the model's device (settings device)
    mask = torch.zeros(len(items), width + 1, dtype=torch.long, device=dev)
    for i, n in enumerate(lens):
        mask[i, width - n:] = 1
    text = torch.tensor(lens, dtype=torch.long, device=dev).view(len(items), 1)
    if _uses_mrope(compute):
        deltas = torch.tensor([state.rope_delta for state in states], dtype=torch.long,
                              device=dev).view(len(items), 1)
        position_ids = torch.cat([text[None], (text + deltas)[None].expand(3, -1, -1)], dim=0)
    else:
        position_ids = text
    try:
        out = compute.model(input_ids=torch.tensor([[t] for _, t in items], dtype=torch.long, device=dev),
                            position_ids=position_ids, attention_mask=mask, past_key_values=stack.cache,
                            use_cache=True)
    except BaseException:
        # a forward that failed half-way may have appended to some layers only, and the states'
        # own caches are stale: nobody may step these sequences again (their requests fail)
        for state in states:
            state.cache = None
        stack.drop()
        raise
    stack.lens = [n + 1 for n in lens]
    for state, n in zip(states, stack.lens, strict=True):
        state.seq_len = n
    # on the CPU in float32, as a lone step's logits: sampling's seeded generators are CPU ones
    return list(out.logits[:, -1].to("cpu", torch.float32, copy=True).unbind(0))


class DecodeBatcher:
    """Callers ``await step(state, token)``; the loop runs a batch when every sequence registered
    as active (``open`` … ``close``) has a step waiting, or ``max_wait_ms`` after the first waiting
    step, whichever comes first (a sequence busy writing its last token to a client must not stall
    the others for long). At most ``max_batch`` per forward."""

    def __init__(self, compute, lane, *, max_batch: int = 16, max_wait_ms: float = 3.0) -> None:
        self._compute = compute
        self._lane = lane
        self._max_batch = max_batch
        self._max_wait_s = max_wait_ms / 1000
        self._active = 0
        self._waiting: list[tuple[object, int, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.forwards = 0  # batched forwards run, and sequence-steps in them (stats and tests)
        self.steps = 0
        self.stack = Stack()  # the padded KV carried between steps (touched on the lane only)

    def open(self) -> None:
        self._active += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="decode-batcher")

    def close(self) -> None:
        self._active -= 1
        self._wake.set()  # the others may all be waiting for this one

    async def step(self, state, token: int) -> torch.Tensor:
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((state, token, fut))
        self._wake.set()
        return await fut

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._waiting:
                if self._active <= 0 and self.stack.members:  # nobody decoding: free the KV it holds
                    await self._lane.run(self.stack.drop)
                continue
            deadline = loop.time() + self._max_wait_s
            while len(self._waiting) < min(self._active, self._max_batch):
                left = deadline - loop.time()
                if left <= 0:
                    break
                self._wake.clear()
                if not await wait_event(self._wake, left):
                    break
            batch, self._waiting = self._waiting[:self._max_batch], self._waiting[self._max_batch:]
            live = [b for b in batch if not b[2].cancelled()]
            if self._waiting:
                self._wake.set()
            if not live:
                continue
            try:
                logits = await self._lane.run(decode_steps, self._compute, [(s, t) for s, t, _ in live], self.stack,
                                              size=len(live))
            except Exception as exc:  # noqa: BLE001 - each caller sees the failure of its step
                for _, _, fut in live:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.forwards += 1
            self.steps += len(live)
            metrics.DECODE_BATCH.observe(len(live))
            for (_, _, fut), out in zip(live, logits, strict=True):
                if not fut.done():
                    fut.set_result(out)
