"""What the Responses API sends back: the ``response`` object at each stage (echoing the
request's settings) and the typed stream events, each with ``sequence_number``; for replies
with and without function calls, with and without thinking (a ``reasoning`` item first,
its text as ``reasoning_text`` content)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from mtplx.request import FinishEvent, TokenEvent
from server.errors import APIError
from server.reasoning import ReplyReasoning, SplitReply
from server.responses_api import ResponsesRequest
from server.streaming import SSE, data_event
from server.tool_stream import HeldText
from server.tools import ToolPlan

__all__ = ["ResponseBuilder", "ResponsesEvents"]

Calls = list[dict[str, Any]]


def _usage(usage: dict[str, Any], reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage["total_tokens"],
    }


def reply_status(finish_reason: str | None, calls: Calls) -> str:
    """ "incomplete" when max_output_tokens cut a reply that calls nothing, else
    "completed"."""
    return "incomplete" if finish_reason == "length" and not calls else "completed"


class ResponseBuilder:
    """The ``response`` object at each stage, echoing the request's settings."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.body = body
        self.model = model

    def item(self, text: str | None, status: str) -> dict[str, Any]:
        """The assistant message item; ``text`` None: no content part yet."""
        content = [] if text is None else [self.part(text)]
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def reasoning_item(self, text: str | None, status: str) -> dict[str, Any]:
        """The ``reasoning`` item; ``text`` None: no content part yet."""
        content = [] if text is None else [self.reasoning_part(text)]
        return {
            "id": self.reasoning_id,
            "type": "reasoning",
            "summary": [],
            "content": content,
            "status": status,
        }

    @staticmethod
    def reasoning_part(text: str) -> dict[str, Any]:
        """A ``reasoning_text`` content part."""
        return {"type": "reasoning_text", "text": text}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        """An ``output_text`` content part."""
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        """A ``function_call`` item from a parsed call (OpenAI chat's shape, as
        ``server.tools.parse_tool_calls`` makes them): ``call_id`` is the call's id, the
        item's id the same with ``fc_``; ``arguments`` stay empty while in progress (the
        stream's deltas fill them)."""
        return {
            "id": "fc_" + call["id"].removeprefix("call_"),
            "type": "function_call",
            "status": status,
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status == "completed" else "",
        }

    def output(
        self, text: str, calls: Calls, status: str, reasoning: SplitReply | None = None
    ) -> list[dict[str, Any]]:
        """The output items: the reasoning when the model thought ("completed" once its
        thinking ended, else the reply's status), the message (unless it is empty and there
        are calls or reasoning), then a ``function_call`` item per call."""
        thought = reasoning.reasoning if reasoning is not None else None
        items = []
        if thought:
            assert reasoning is not None
            done = "completed" if reasoning.closed else status
            items.append(self.reasoning_item(thought, done))
        if text or not (calls or thought):
            items.append(self.item(text, status))
        return items + [self.call_item(call) for call in calls]

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        mtplx: dict[str, Any] | None = None,
        error: dict[str, str] | None = None,
        reasoning_tokens: int = 0,
    ) -> dict[str, Any]:
        """The whole object; ``incomplete_details`` when status is "incomplete"."""
        body = self.body
        reply: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": (
                True if body.parallel_tool_calls is None else body.parallel_tool_calls
            ),
            "previous_response_id": None,
            "reasoning": {
                "effort": body.reasoning.effort if body.reasoning else None,
                "summary": None,  # no summaries are written
            },
            "store": False,  # nothing is kept, whatever the request asked
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
            "tools": body.tools or [],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": None if usage is None else _usage(usage, reasoning_tokens),
            "user": body.user,
            "metadata": body.metadata or {},
        }
        if status in ("completed", "incomplete"):
            reply["completed_at"] = int(time.time())
        if mtplx is not None:
            reply["mtplx"] = mtplx
        return reply

    def final(
        self,
        reply: tuple[str, Calls],
        finish_reason: str | None,
        usage: dict[str, Any],
        mtplx: dict[str, Any],
        reasoning: SplitReply | None = None,
    ) -> dict[str, Any]:
        """The finished response from ``reply`` (text, calls) and its ``reasoning``:
        "incomplete" when max_output_tokens cut it."""
        text, calls = reply
        status = reply_status(finish_reason, calls)
        output = self.output(text, calls, status, reasoning)
        thinking = reasoning.reasoning_pieces if reasoning is not None else 0
        return self.response(status, output, usage, mtplx, reasoning_tokens=thinking)


class ResponsesEvents:
    """The typed stream: ``response.created``, ``response.in_progress``, the message item
    (``response.output_item.added``, ``response.content_part.added``, one
    ``response.output_text.delta`` per piece, ``response.output_text.done``,
    ``response.content_part.done``, ``response.output_item.done``), a ``function_call`` item
    per call (``response.output_item.added`` with empty arguments,
    ``response.function_call_arguments.delta``, ``response.function_call_arguments.done``,
    ``response.output_item.done``), then ``response.completed`` (``response.incomplete`` when
    max_output_tokens cut it, as OpenAI sends). A failure after the start is an ``error``
    event and ``response.failed``.

    Without tools the message item opens at once. With tools (``plan``) text is held back
    while it may be a call (``HeldText``): the message item opens with the first text that
    goes out, or at the end when the reply calls nothing, so a reply that only calls
    functions has no message item, as in the whole response.

    A reasoning model's reply (``reasoning``) first has a ``reasoning`` item while it
    thinks (``response.output_item.added``, ``response.content_part.added``, one
    ``response.reasoning_text.delta`` per piece, ``response.reasoning_text.done``,
    ``response.content_part.done``, ``response.output_item.done``); the message item then
    opens with the first text of the answer."""

    def __init__(
        self,
        builder: ResponseBuilder,
        plan: ToolPlan | None = None,
        reasoning: ReplyReasoning | None = None,
    ) -> None:
        self.builder = builder
        self.plan = plan
        self.held = HeldText() if plan is not None else None
        self.splitter = reasoning.splitter() if reasoning is not None else None
        self.sequence = 0
        self.text = ""
        self.message_open = False
        self.message_index = 0
        self.thought = ""
        self.reasoning_open = False
        self.reasoning_index = 0
        self.items = 0  # output items added so far
        self.output: list[dict[str, Any]] = []
        self.status = "completed"

    def _event(self, kind: str, **fields: Any) -> SSE:
        event = data_event({"type": kind, "sequence_number": self.sequence, **fields}, kind)
        self.sequence += 1
        return event

    def _at(self) -> dict[str, Any]:
        index = self.message_index
        return {"item_id": self.builder.item_id, "output_index": index, "content_index": 0}

    def _open_message(self) -> list[SSE]:
        self.message_open = True
        self.message_index = self.items
        self.items += 1
        b = self.builder
        item = b.item(None, "in_progress")
        return [
            self._event("response.output_item.added", output_index=self.message_index, item=item),
            self._event("response.content_part.added", **self._at(), part=b.part("")),
        ]

    def _reasoning_at(self) -> dict[str, Any]:
        index = self.reasoning_index
        return {"item_id": self.builder.reasoning_id, "output_index": index, "content_index": 0}

    def _reasoning(self, text: str) -> list[SSE]:
        """A reasoning delta, opening the reasoning item first if it is not open."""
        if not text:
            return []
        b = self.builder
        events = []
        if not self.reasoning_open:
            self.reasoning_open = True
            self.reasoning_index = self.items
            self.items += 1
            item = b.reasoning_item(None, "in_progress")
            events += [
                self._event(
                    "response.output_item.added", output_index=self.reasoning_index, item=item
                ),
                self._event(
                    "response.content_part.added",
                    **self._reasoning_at(),
                    part=b.reasoning_part(""),
                ),
            ]
        self.thought += text
        delta = self._event("response.reasoning_text.delta", **self._reasoning_at(), delta=text)
        return [*events, delta]

    def _close_reasoning(self) -> list[SSE]:
        if not self.reasoning_open:
            return []
        self.reasoning_open = False
        b = self.builder
        assert self.splitter is not None
        status = "completed" if self.splitter.closed else self.status
        item = b.reasoning_item(self.thought, status)
        self.output.append(item)
        at = self._reasoning_at()
        return [
            self._event("response.reasoning_text.done", **at, text=self.thought),
            self._event("response.content_part.done", **at, part=b.reasoning_part(self.thought)),
            self._event("response.output_item.done", output_index=self.reasoning_index, item=item),
        ]

    def _split(self, text: str, final: bool = False) -> tuple[list[SSE], str]:
        """The reasoning events of a piece, and its answer text."""
        if self.splitter is None:
            return [], text
        reasoning, content = self.splitter.add(text) if text or not final else ("", "")
        if final:
            more_reasoning, more_content = self.splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        events = self._reasoning(reasoning)
        if content or final:
            events += self._close_reasoning()
        return events, content

    def opening(self, index: int) -> list[SSE]:
        b = self.builder
        events = [
            self._event("response.created", response=b.response("in_progress", [])),
            self._event("response.in_progress", response=b.response("in_progress", [])),
        ]
        opens = self.plan is None and self.splitter is None
        return events + (self._open_message() if opens else [])

    def _delta(self, text: str) -> list[SSE]:
        """A text delta, opening the message item first if it is not open."""
        if not text:
            return []
        events = [] if self.message_open else self._open_message()
        self.text += text
        delta = self._event("response.output_text.delta", **self._at(), delta=text, logprobs=[])
        return [*events, delta]

    def token(self, index: int, event: TokenEvent) -> list[SSE]:
        events, text = self._split(event.text)
        return events + self._delta(text if self.held is None else self.held.add(text))

    def _close_message(self) -> list[SSE]:
        b = self.builder
        item = b.item(self.text, self.status)
        self.output.append(item)
        return [
            self._event("response.output_text.done", **self._at(), text=self.text, logprobs=[]),
            self._event("response.content_part.done", **self._at(), part=b.part(self.text)),
            self._event("response.output_item.done", output_index=self.message_index, item=item),
        ]

    def _call(self, call: dict[str, Any]) -> list[SSE]:
        """One call's item: added with empty arguments, which one delta fills."""
        b = self.builder
        index = self.items
        self.items += 1
        item = b.call_item(call)
        self.output.append(item)
        at = {"item_id": item["id"], "output_index": index}
        arguments = item["arguments"]
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=b.call_item(call, "in_progress"),
            ),
            self._event("response.function_call_arguments.delta", **at, delta=arguments),
            self._event("response.function_call_arguments.done", **at, arguments=arguments),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def finish(self, index: int, event: FinishEvent) -> list[SSE]:
        self.status = reply_status(event.finish_reason, [])  # the reasoning item's status
        events, text = self._split(event.text, final=True)
        if self.held is None or self.plan is None:
            rest, calls = text, []
        else:
            self.held.add(text)
            rest, calls = self.held.settle(self.plan)
        self.status = reply_status(event.finish_reason, calls)
        events += self._delta(rest)
        if not calls and not self.message_open and not self.thought:
            events += self._open_message()  # a reply without calls has its message
        if self.message_open:
            events += self._close_message()
        for call in calls:
            events += self._call(call)
        return events

    def closing(self, usage: dict[str, Any], mtplx: dict[str, Any]) -> list[SSE]:
        thinking = self.splitter.reasoning_pieces if self.splitter is not None else 0
        final = self.builder.response(
            self.status, self.output, usage, mtplx, reasoning_tokens=thinking
        )
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [self._event(kind, response=final)]

    def failure(self, error: APIError) -> list[SSE]:
        code = error.code or "server_error"
        failed = self.builder.response("failed", [], error={"code": code, "message": error.message})
        return [
            self._event("error", code=code, message=error.message, param=error.param),
            self._event("response.failed", response=failed),
        ]
