"""The Anthropic Messages API's named stream events (``event: <type>``), for replies with
and without tools, with and without thinking."""

from __future__ import annotations

import json
from typing import Any

from mtplx.request import FinishEvent, TokenEvent
from server.anthropic_api import anthropic_usage, stop_reason, thinking_block, tool_use_block
from server.errors import APIError
from server.reasoning import ReplyReasoning
from server.streaming import SSE, data_event
from server.tool_stream import HeldText
from server.tools import ToolPlan

__all__ = ["AnthropicEvents"]


class AnthropicEvents:
    """The stream: ``message_start``, ``ping``, a text block (``content_block_start``, one
    ``content_block_delta`` per piece of text, ``content_block_stop``), a ``tool_use`` block
    per call (``content_block_start`` with ``input: {}``, its input as one
    ``input_json_delta``, ``content_block_stop``), ``message_delta`` (stop reason, usage, and
    MTPLX's ``mtplx`` statistics), ``message_stop``; a failure after the start is an
    ``error`` event.

    Without tools the text block opens at once. With tools (``plan``) text is held back
    while it may be a call (``HeldText``), so the text block opens with the first text that
    goes out, or at the end when the reply calls nothing: a reply that only calls tools has
    no text block, as in the whole ``message``.

    A reasoning model's reply (``reasoning``) first has a ``thinking`` block
    (``thinking_delta`` events) while it thinks; the text block then opens with the first
    text of the answer (a reply that only thought has no text block)."""

    def __init__(
        self,
        message_id: str,
        model: str,
        input_tokens: int,
        plan: ToolPlan | None = None,
        reasoning: ReplyReasoning | None = None,
    ) -> None:
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self.plan = plan
        self.held = HeldText() if plan is not None else None
        self.splitter = reasoning.splitter() if reasoning is not None else None
        self.blocks = 0  # content blocks opened so far
        self.text_open = False
        self.thinking_open = False
        self.thought = False
        self.ended: tuple[str | None, str | None] = (None, None)
        self.called = False

    @staticmethod
    def _event(kind: str, **fields: Any) -> SSE:
        return data_event({"type": kind, **fields}, event=kind)

    def _open(self, block: dict[str, Any]) -> SSE:
        self.blocks += 1
        return self._event("content_block_start", index=self.blocks - 1, content_block=block)

    def _text(self, text: str) -> list[SSE]:
        """A text delta, opening the text block first if it is not open."""
        if not text:
            return []
        events = [] if self.text_open else [self._open({"type": "text", "text": ""})]
        self.text_open = True
        delta = {"type": "text_delta", "text": text}
        return [*events, self._event("content_block_delta", index=self.blocks - 1, delta=delta)]

    def _thinking(self, text: str) -> list[SSE]:
        """A thinking delta, opening the thinking block first if it is not open."""
        if not text:
            return []
        events = [] if self.thinking_open else [self._open(thinking_block(""))]
        self.thinking_open = self.thought = True
        delta = {"type": "thinking_delta", "thinking": text}
        return [*events, self._event("content_block_delta", index=self.blocks - 1, delta=delta)]

    def _end_thinking(self) -> list[SSE]:
        """Close the thinking block (before any other block opens)."""
        if not self.thinking_open:
            return []
        self.thinking_open = False
        return [self._event("content_block_stop", index=self.blocks - 1)]

    def _split(self, text: str, final: bool = False) -> tuple[list[SSE], str]:
        """The thinking events of a piece, and its answer text."""
        if self.splitter is None:
            return [], text
        reasoning, content = self.splitter.add(text) if text or not final else ("", "")
        if final:
            more_reasoning, more_content = self.splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        events = self._thinking(reasoning)
        if content or final:
            events += self._end_thinking()
        return events, content

    def opening(self, index: int) -> list[SSE]:
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        events = [self._event("message_start", message=message)]
        if self.plan is None and self.splitter is None:
            self.text_open = True
            events.append(self._open({"type": "text", "text": ""}))
        return [*events, self._event("ping")]

    def token(self, index: int, event: TokenEvent) -> list[SSE]:
        events, text = self._split(event.text)
        return events + self._text(text if self.held is None else self.held.add(text))

    def _tool_use(self, call: dict[str, Any]) -> list[SSE]:
        """One call's block: opened with an empty input, which the delta fills (the SDK
        accumulates ``partial_json`` and parses it)."""
        block = tool_use_block(call)
        partial = json.dumps(block["input"], ensure_ascii=False)
        start = self._open({**block, "input": {}})
        delta = {"type": "input_json_delta", "partial_json": partial}
        index = self.blocks - 1
        return [
            start,
            self._event("content_block_delta", index=index, delta=delta),
            self._event("content_block_stop", index=index),
        ]

    def finish(self, index: int, event: FinishEvent) -> list[SSE]:
        self.ended = (event.finish_reason, event.stop_sequence)
        events, text = self._split(event.text, final=True)
        if self.held is None or self.plan is None:
            rest, calls = text, []
        else:
            self.held.add(text)
            rest, calls = self.held.settle(self.plan)
        events += self._text(rest)
        if not calls and not self.text_open and not self.thought:
            # A reply without calls has its text block (unless it only thought).
            self.text_open = True
            events.append(self._open({"type": "text", "text": ""}))
        if self.text_open:
            events.append(self._event("content_block_stop", index=self.blocks - 1))
        self.called = bool(calls)
        for call in calls:
            events += self._tool_use(call)
        return events

    def closing(self, usage: dict[str, Any], mtplx: dict[str, Any]) -> list[SSE]:
        reason, sequence = self.ended
        delta = {
            "stop_reason": stop_reason(reason, sequence, self.called),
            "stop_sequence": None if self.called else sequence,
        }
        counts = anthropic_usage(usage)
        return [
            self._event("message_delta", delta=delta, usage=counts, mtplx=mtplx),
            self._event("message_stop"),
        ]

    def failure(self, error: APIError) -> list[SSE]:
        return [data_event(error.anthropic_body(), event="error")]
