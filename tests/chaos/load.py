"""What the chaos tests share: a steady streaming load of mixed text/image requests, a fault
injected while it runs, and the temperature-0 references every completion must equal."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import openai

from tests.e2e.test_skeleton import gradient_image, noise_image, png_data_url, ref_parts, reference_text

MAX_TOKENS = 24
TIMEOUT_MS = 90_000
PROMPTS = [
    ([], "Tell me a story about the sea."),
    ([noise_image(21)], "Describe what you see."),
    ([], "List three colours."),
    ([gradient_image()], "What is in the picture?"),
]

T = TypeVar("T")


def reference_texts(model_dir) -> list[str]:
    return [reference_text(model_dir, ref_parts(len(imgs), text) if imgs else text, imgs, max_tokens=MAX_TOKENS)
            for imgs, text in PROMPTS]


async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str, str]:
    """Request ``i`` (prompt ``i % len(PROMPTS)``), streamed: (i, outcome, text or error)."""
    imgs, text = PROMPTS[i % len(PROMPTS)]
    content = text if not imgs else [*({"type": "image_url", "image_url": {"url": png_data_url(im)}} for im in imgs),
                                     {"type": "text", "text": text}]
    pieces = []
    try:
        stream = await client.chat.completions.create(
            model="mmfleet-demo", stream=True, temperature=0, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": content}])
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
        return i, "completed", "".join(pieces)
    except openai.APIStatusError as exc:
        return i, f"error {exc.status_code}", str(exc)
    except openai.APIError as exc:  # an SSE error event after the first token
        return i, "error event", str(exc)


async def load_with_fault(base: str, requests: int, concurrency: int,
                          fault: Callable[[list[asyncio.Task]], Awaitable[T]],
                          timeout_ms: int = TIMEOUT_MS) -> tuple[list, T, list]:
    """``requests`` streamed requests, ``concurrency`` at a time; ``fault(tasks)`` runs while they
    do. Returns (results, what the fault returned, one more round of every prompt after it). A
    request still unfinished 3 deadlines (``timeout_ms``: the fleet's request deadline) later
    fails the gather: a hang is an error."""
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                                timeout=timeout_ms / 1000 + 30)
    sem = asyncio.Semaphore(concurrency)

    async def guarded(i: int):
        async with sem:
            return await one(client, i)

    try:
        tasks = [asyncio.create_task(guarded(i)) for i in range(requests)]
        injected = await fault(tasks)
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout_ms / 1000 * 3)
        after = [await one(client, i) for i in range(len(PROMPTS))]  # the service after the fault
    finally:
        await client.close()
    return results, injected, after
