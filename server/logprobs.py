"""Logprobs in the two OpenAI shapes: chat (``{"content": [{token, logprob, bytes,
top_logprobs}]}``) and legacy completions (``tokens`` / ``token_logprobs`` /
``top_logprobs`` / ``text_offset``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mtplx.request import TokenEvent

__all__ = ["chat_logprobs", "completion_logprobs"]

TokenText = Callable[[int], str]


def _entry(token_text: TokenText, token_id: int, logprob: float | None) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_text: TokenText, events: Sequence[TokenEvent]) -> dict[str, Any]:
    """``choice.logprobs`` of a chat completion (or chunk) for these tokens."""
    content = []
    for event in events:
        entry = _entry(token_text, event.token_id, event.logprob)
        entry["top_logprobs"] = [
            _entry(token_text, token_id, logprob) for token_id, logprob in event.top_logprobs or ()
        ]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    token_text: TokenText, events: Sequence[TokenEvent], offset: int = 0
) -> dict[str, Any]:
    """``choice.logprobs`` of a completion (or chunk); ``offset`` is where the first token's
    text starts in the choice's text."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for event in events:
        tokens.append(token_text(event.token_id))
        token_logprobs.append(event.logprob)
        top.append({token_text(t): lp for t, lp in event.top_logprobs or ()})
        offsets.append(offset)
        offset += len(event.text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
