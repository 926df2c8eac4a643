"""The forms a completions ``prompt`` takes (OpenAI's and vLLM's): a text, token ids, or a list
of texts or of token-id lists. One prompt is served: a request is one token stream from the
gateway to decode and back, so a list of several is a 400 naming ``prompt`` (send them as
separate requests). Token ids are taken as given (no BOS added, as vLLM takes them), each checked
against the tokenizer's vocabulary. Design: docs/guide/api.md.
"""

from __future__ import annotations

from shared.stage import RequestFailed


def single(prompt: str | list) -> str | list[int]:
    """The one prompt ``prompt`` holds: its text or its token ids; raises ``RequestFailed``."""
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise RequestFailed.bad_request("prompt: an empty list holds no prompt", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return list(prompt)
    kinds = {type(p) for p in prompt}
    if len(kinds) > 1:
        raise RequestFailed.bad_request("prompt: a list holds texts, or token ids, or lists of token ids, not a "
                                        "mix of them", param="prompt")
    if len(prompt) > 1:
        raise RequestFailed.bad_request(
            f"prompt: {len(prompt)} prompts in one request; this server serves one prompt per request (each "
            "request is one token stream through the fleet), so send them as separate requests", param="prompt")
    if not prompt[0]:
        raise RequestFailed.bad_request("prompt: an empty list of token ids", param="prompt")
    return prompt[0]


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    """``ids`` when each is a token id of the tokenizer (0..vocab_size-1), else a 400 naming ``param``."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestFailed.bad_request(f"{param}: token id {bad} is not in this model's vocabulary "
                                        f"(0..{vocab_size - 1})", param=param)
    return ids


def text_bytes(prompt: str | list) -> int:
    """UTF-8 bytes of a completions prompt's texts (token ids are bounded by the context instead)."""
    texts = (prompt,) if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
    return sum(len(t.encode()) for t in texts)
