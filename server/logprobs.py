"""Logprobs in the two OpenAI shapes: chat (``{"content": [{token, logprob, bytes,
top_logprobs}]}``) and legacy completions (``tokens`` / ``token_logprobs`` /
``top_logprobs`` / ``text_offset``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mtplx.request import PromptLogprob, TokenEvent

__all__ = ["chat_logprobs", "completion_logprobs", "echoed_logprobs", "vllm_prompt_logprobs"]

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


def echoed_logprobs(
    token_text: TokenText, scored: Sequence[PromptLogprob], completion: dict[str, Any]
) -> dict[str, Any]:
    """``choice.logprobs`` of a completion with ``echo``: the prompt's tokens first (the
    first one's logprob and alternatives null, as OpenAI's legacy API gave them), then the
    completion's (``completion``: ``completion_logprobs`` of its tokens, offsets counted
    from the start of the echoed text)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for entry in scored:
        text = token_text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top.append(
            None if entry.logprob is None else {token_text(t): lp for t, lp in entry.top_logprobs}
        )
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens + completion["tokens"],
        "token_logprobs": token_logprobs + completion["token_logprobs"],
        "top_logprobs": top + completion["top_logprobs"],
        "text_offset": offsets + completion["text_offset"],
    }


def vllm_prompt_logprobs(
    token_text: TokenText, scored: Sequence[PromptLogprob]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or a map from token id
    (a string) to ``{"logprob", "rank", "decoded_token"}``: the prompt's own token and the
    most likely alternatives."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in scored:
        if entry.logprob is None:
            out.append(None)
            continue
        ranked = {entry.token_id: (entry.logprob, entry.rank)}
        for rank, (token_id, logprob) in enumerate(entry.top_logprobs, start=1):
            ranked.setdefault(token_id, (logprob, rank))
        out.append(
            {
                str(token_id): {
                    "logprob": logprob,
                    "rank": rank,
                    "decoded_token": token_text(token_id),
                }
                for token_id, (logprob, rank) in ranked.items()
            }
        )
    return out
