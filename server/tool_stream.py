"""Streaming a reply that may call tools: text streams as content until a tool call may
begin (a call marker, or a JSON object opening the reply); from there it is held back, and
at the end it goes out as calls, or as content when it does not parse as calls.
``HeldText`` does the holding back for every API (chat's tool-call deltas here, Anthropic's
``tool_use`` blocks, the Responses API's ``function_call`` items);
``ToolCallStream`` is chat's formatter."""

from __future__ import annotations

from typing import Any

from mtplx.request import TokenEvent
from server.tools import CALL_MARKERS, ToolPlan, parse_tool_calls

__all__ = ["HeldText", "ToolCallStream"]


def _held_suffix(text: str) -> int:
    """Length of the longest suffix of ``text`` that may be the start of a call marker."""
    for size in range(min(len(text), max(map(len, CALL_MARKERS))), 0, -1):
        if any(marker.startswith(text[-size:]) for marker in CALL_MARKERS):
            return size
    return 0


class HeldText:
    """One reply's text: what was sent as content, and what is held back."""

    def __init__(self) -> None:
        self.sent = ""
        self.held = ""
        self.in_call = False

    def add(self, text: str) -> str:
        """Add a piece; the content that may go out now."""
        self.held += text
        if self.in_call:
            return ""
        if not self.sent and self.held.lstrip().startswith(("{", "[")):
            self.in_call = True  # a JSON call opens the reply
            return ""
        if not self.sent and not self.held.strip():
            return ""  # leading whitespace: the reply may still open with a JSON call
        starts = [self.held.find(m) for m in CALL_MARKERS if m in self.held]
        if starts:
            cut = min(starts)
            self.in_call = True
        else:
            cut = len(self.held) - _held_suffix(self.held)
        out, self.held = self.held[:cut], self.held[cut:]
        self.sent += out
        return out

    def settle(self, plan: ToolPlan) -> tuple[str, list[dict[str, Any]]]:
        """At the end of the reply: (text still to send as content, the calls in OpenAI's
        shape). Without calls all held text is content; with calls, only the text before
        them that was not sent yet (whitespace alone is dropped)."""
        content, calls = parse_tool_calls(self.sent + self.held, plan)
        if not calls:
            return self.held, []
        # ``content`` is the text before the calls, stripped; the sent part is its prefix
        # once the leading whitespace that went out with it is skipped.
        unsent = (content or "")[len(self.sent.lstrip()) :]
        return (unsent if unsent.strip() else ""), calls


class ToolCallStream:
    """Wraps a chat chunk formatter (``server.routes.chat.ChatChunks``) for a request with
    tools."""

    def __init__(self, chunks: Any, plan: ToolPlan) -> None:
        self.chunks = chunks
        self.plan = plan
        self.wants_logprobs = chunks.wants_logprobs
        self.choices: dict[int, HeldText] = {}

    def _choice(self, index: int) -> HeldText:
        return self.choices.setdefault(index, HeldText())

    def begin(self, index: int) -> dict[str, Any] | None:
        """The role delta."""
        return self.chunks.begin(index)

    def token(self, index: int, event: TokenEvent) -> dict[str, Any] | None:
        """The content that may go out now (None: held back)."""
        out = self._choice(index).add(event.text)
        if not out and not self.wants_logprobs:
            return None
        chunk = self.chunks.token(index, event)
        chunk["choices"][0]["delta"]["content"] = out
        return chunk

    def tail(self, index: int, text: str) -> dict[str, Any] | None:
        """The detokenizer's tail, held back like any text."""
        out = self._choice(index).add(text)
        return self.chunks.tail(index, out) if out else None

    def finish(self, index: int, reason: str) -> list[dict[str, Any]]:
        """Held text as content, or the calls as tool-call deltas; then the finish chunk."""
        unsent, calls = self._choice(index).settle(self.plan)
        out = [self.chunks.tail(index, unsent)] if unsent else []
        if not calls:
            return [*out, self.chunks.finish(index, reason)]
        for position, call in enumerate(calls):
            delta = {"tool_calls": [{"index": position, **call}]}
            out.append(self.chunks._chunk(index, delta))
        return [*out, self.chunks.finish(index, "tool_calls")]

    def usage(self, usage: dict[str, int], mtplx: dict[str, Any]) -> dict[str, Any]:
        """The usage chunk, unchanged."""
        return self.chunks.usage(usage, mtplx)
