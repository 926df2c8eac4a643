"""Batched decode: one forward for one step of many sequences, and the loop that gathers them.

``decode_steps(compute, items)``: ``items`` = ``(DecodeState, token_id)`` per sequence (each
state owned by one caller, any cache lengths, any ``rope_delta``). One sequence runs the
family's own ``decode_step`` unchanged. Several run as ONE batched forward: each sequence's KV
is left-padded to the longest with an attention mask that hides the padding, positions are
passed per sequence (M-RoPE: ``cache_len + rope_delta`` on the three axes, exactly what
``decode_step`` passes), and the new K/V column of each sequence is appended to its own
``DynamicCache``. Padded KV, rebuilt each step from the per-sequence caches, so sequences join
and leave between any two steps at no cost beyond the copy.

``DecodeBatcher``: callers ``await step(state, token)``; the loop runs a batch when every
sequence registered as active (``open`` … ``close``) has a step waiting, or ``max_wait_ms``
after the first waiting step, whichever comes first (a sequence busy writing its last token
to a client must not stall the others for long). At most ``max_batch`` per forward.
"""

from __future__ import annotations

import asyncio

import torch


def _uses_mrope(compute) -> bool:
    return getattr(compute, "mrope", False)


@torch.inference_mode()
def decode_steps(compute, items: list) -> list[torch.Tensor]:
    """Next-token logits (float32 [vocab]) per ``(state, token)``, in order; appends the token
    to each state's cache like ``decode_step`` does."""
    if len(items) == 1:
        state, token = items[0]
        return [compute.decode_step(state, token)]
    from transformers import DynamicCache

    lens = [state.cache.get_seq_length() for state, _ in items]
    width = max(lens)
    n_layers = len(items[0][0].cache.layers)
    layers = []
    for li in range(n_layers):
        ks, vs = [], []
        for (state, _), n in zip(items, lens, strict=True):
            k, v = state.cache.layers[li].keys, state.cache.layers[li].values
            pad = width - n
            if pad:  # left padding: every sequence's new token lands in the same last column
                k = torch.nn.functional.pad(k, (0, 0, pad, 0))
                v = torch.nn.functional.pad(v, (0, 0, pad, 0))
            ks.append(k)
            vs.append(v)
        layers.append((torch.cat(ks), torch.cat(vs)))
    cache = DynamicCache(ddp_cache_data=layers, config=compute.cache_config)
    dev = getattr(compute, "device", "cpu")  # the model's device (settings device)
    mask = torch.zeros(len(items), width + 1, dtype=torch.long, device=dev)
    for i, n in enumerate(lens):
        mask[i, width - n:] = 1
    text = torch.tensor(lens, dtype=torch.long, device=dev).view(len(items), 1)
    if _uses_mrope(compute):
        deltas = torch.tensor([state.rope_delta for state, _ in items], dtype=torch.long,
                              device=dev).view(len(items), 1)
        position_ids = torch.cat([text[None], (text + deltas)[None].expand(3, -1, -1)], dim=0)
    else:
        position_ids = text
    out = compute.model(input_ids=torch.tensor([[t] for _, t in items], dtype=torch.long, device=dev),
                        position_ids=position_ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    for i, (state, _) in enumerate(items):
        for li in range(n_layers):
            layer = out.past_key_values.layers[li]
            state.cache.update(layer.keys[i:i + 1, :, -1:].clone(), layer.values[i:i + 1, :, -1:].clone(), li)
        state.seq_len = lens[i] + 1
    return [out.logits[i, -1].to(torch.float32).clone() for i in range(len(items))]


class DecodeBatcher:
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
                continue
            deadline = loop.time() + self._max_wait_s
            while len(self._waiting) < min(self._active, self._max_batch):
                left = deadline - loop.time()
                if left <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except TimeoutError:
                    break
            batch, self._waiting = self._waiting[:self._max_batch], self._waiting[self._max_batch:]
            live = [b for b in batch if not b[2].cancelled()]
            if self._waiting:
                self._wake.set()
            if not live:
                continue
            try:
                logits = await self._lane.run(decode_steps, self._compute, [(s, t) for s, t, _ in live])
            except Exception as exc:  # noqa: BLE001 - each caller sees the failure of its step
                for _, _, fut in live:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.forwards += 1
            self.steps += len(live)
            for (_, _, fut), out in zip(live, logits, strict=True):
                if not fut.done():
                    fut.set_result(out)
